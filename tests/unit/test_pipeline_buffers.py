"""torch.distributed.pipelining's per-stage buffers (memkit/estimate/pipeline.py) against what was
alive at each rank's peak in tests/e2e/test_parallel_equivalence.py's pp=2 runs (tiny Llama, micro 2 x
seq 64 x hidden 128 fp32 = 65,536 B per boundary tensor, 4 micro-batches), listed by the op that
allocated each storage with memkit.measure.live_tensors:

- 1F1B stage 0: 4 gradient receive buffers (empty_strided) + the outputs of micro-batches 1, 2
  (fwd_cache) + micro-batch 0's output (kept by the warmup's send_work) = 7 tensors.
- 1F1B stage 1: 4 activation receive buffers, one of them the in-flight micro-batch's input, + the
  previous micro-batch's input gradient (bwd_sends) = 4 tensors beyond the blocks; that micro-batch's
  logits (fwd_cache) during its backward.
- GPipe stage 0: 4 gradient receive buffers + 4 outputs = 8; stage 1: the 4 receive buffers are the
  4 in-flight inputs, and the 4 micro-batches' logits are alive at the first backward.
- tp=2 x pp=2 stage 1: the logits fwd_cache keeps through the loss backward are the gathered
  (2, 64, 512) fp32 `cat` output (262,144 B), not the local (2, 64, 256) shard; stage 0's top-block
  backward starts from a gradient receive buffer (the 4 empty_strided buffers are all there is of
  the hidden-stream gradient at that stage's peak besides the down projection's two outputs).
"""
from __future__ import annotations

import pytest

from memkit.estimate.pipeline import stage_buffers, stage_logits_bytes
from memkit.plan.plan import TrainingPlan

BOUNDARY = 2 * 64 * 128 * 4
LOGITS = 2 * 64 * 512 * 4


def _plan(schedule: str, pp: int = 2) -> TrainingPlan:
    return TrainingPlan(precision="fp32", micro_batch_size=2, grad_accum=4, seq_len=64, pp=pp, pp_schedule=schedule)


@pytest.mark.parametrize("schedule, stage, in_flight, held, fwd_logits, bwd_logits", [
    ("1f1b", 0, 2, 7, 0, 0),
    ("1f1b", 1, 1, 4, 0, 1),
    ("gpipe", 0, 4, 8, 0, 0),
    ("gpipe", 1, 4, 0, 3, 4),
])
def test_stage_buffers_count_the_tensors_measured_at_the_peak(schedule, stage, in_flight, held, fwd_logits,
                                                              bwd_logits):
    got = stage_buffers(_plan(schedule), stage, in_flight=in_flight, boundary_bytes=BOUNDARY, logits_bytes=LOGITS)
    assert got.held_bytes == held * BOUNDARY
    assert (got.forward_logits_bytes, got.backward_logits_bytes) == (fwd_logits * LOGITS, bwd_logits * LOGITS)
    assert got.output_grad_in_buffer_bytes == (BOUNDARY if stage == 0 else 0)


def test_tensor_parallel_stage_returns_the_gathered_logits():
    plan = TrainingPlan(precision="fp32", micro_batch_size=2, grad_accum=4, seq_len=64, pp=2, tp=2,
                        engine="torch", tp_engine="tp_plan")
    assert stage_logits_bytes(plan, vocab_size=512, itemsize=4) == LOGITS
    # loss parallel (sequence parallel) keeps them sharded by vocabulary
    sp = TrainingPlan(precision="fp32", micro_batch_size=2, grad_accum=4, seq_len=64, tp=2, sequence_parallel=True,
                      engine="torch", tp_engine="tp_plan")
    assert stage_logits_bytes(sp, vocab_size=512, itemsize=4) == LOGITS // 2


def test_no_pipeline_no_buffers():
    plan = TrainingPlan(precision="fp32", micro_batch_size=2, grad_accum=4, seq_len=64)
    got = stage_buffers(plan, 0, in_flight=1, boundary_bytes=BOUNDARY, logits_bytes=LOGITS)
    assert (got.held_bytes, got.forward_logits_bytes, got.backward_logits_bytes,
            got.output_grad_in_buffer_bytes) == (0, 0, 0, 0)
