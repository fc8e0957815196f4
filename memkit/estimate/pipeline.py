"""What torch.distributed.pipelining holds on a stage besides the blocks' saved activations.

Measured on CPU (tests/e2e/test_parallel_equivalence.py, live tensors at each rank's peak listed by
the op that allocated them): the stage's buffers, not the blocks, made the pipeline runs read
-4.5 % .. -6.7 %. The mechanisms, from torch/distributed/pipelining (torch 2.x):

- stage.py PipelineStage._setup_forward_recv_info: a non-first stage allocates one activation
  receive buffer per micro-batch (`args_recv_info[chunk].buffer`) at the first step and keeps them
  for the run; an in-flight micro-batch's buffer is its first block's input (priced with the block).
- stage.py _setup_backward_recv_info / _create_grad_recv_info: a non-last stage likewise keeps one
  gradient receive buffer per micro-batch.
- stage.py forward_one_chunk: `fwd_cache[chunk] = (output, inputs)` keeps each in-flight
  micro-batch's stage output until its backward_one_chunk pops it -- on the last stage the output
  is the logits, and backward_one_chunk's local `stage_output` keeps them through that backward.
- schedules.py Schedule1F1B._step_microbatches: the send ops / works of the last fired sends stay
  referenced after their wait (`send_work` from the warmup until the cooldown, `bwd_sends` until the
  next backward), and a pending send keeps its tensor: one more stage output on a non-last stage,
  one input gradient on a non-first stage. ScheduleGPipe keeps every forward send
  (`fwd_sends_to_wait`), outputs that are all in flight anyway at its peak (the first backward).
- stage.py backward_one_chunk / _retrieve_recv_grads: a non-last stage's backward starts from
  `grad = info.buffer`, the gradient receive buffer itself, so the top block's output gradient is
  a held buffer, not a fresh tensor (measured under tp=2 x pp=2, tests/e2e/test_parallel_equivalence.py).

Under tp x pp (tensor parallel inside the stages) the last stage returns the logits whole: its LM
head is ColwiseParallel(output_layouts=Replicate()) (memkit/train/parallel.py), whose output hook
redistributes Shard(-1) -> Replicate, an all-gather over the vocabulary, and hands on the local
tensor (torch/distributed/tensor/parallel/style.py, ColwiseParallel._prepare_output_fn). Measured:
the tensor fwd_cache keeps through the backward is the gathered (b, s, V) `cat` output.
"""
from __future__ import annotations

from dataclasses import dataclass

from memkit.plan.plan import TrainingPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class StageBuffers:
    held_bytes: int
    """Held at every moment of the step: receive buffers, stage outputs, pending sends."""
    forward_logits_bytes: int
    """Last stage, at a forward's loss: the other in-flight micro-batches' logits (fwd_cache)."""
    backward_logits_bytes: int
    """Last stage, during a backward: every in-flight micro-batch's logits, its own included."""
    output_grad_in_buffer_bytes: int
    """Non-last stage: the top block's output gradient is the receive buffer in held_bytes, so its
    backward allocates one hidden-stream tensor fewer than a block whose gradient is fresh."""


def stage_logits_bytes(plan: TrainingPlan, *, vocab_size: int, itemsize: int) -> int:
    """One micro-batch's logits as the last stage returns them (what fwd_cache keeps): whole,
    gathered over the TP group (module docstring), except under sequence parallel, whose loss
    parallel keeps them sharded by vocabulary (torch.distributed.tensor.parallel.loss_parallel)."""
    logits = plan.micro_batch_size * plan.seq_len * vocab_size * itemsize
    return logits // plan.tp if plan.sequence_parallel else logits


def stage_buffers(plan: TrainingPlan, stage: int, *, in_flight: int, boundary_bytes: int,
                  logits_bytes: int) -> StageBuffers:
    """Buffers of pipeline stage `stage` (nothing without pipeline parallelism).

    boundary_bytes: one micro-batch's hidden states at a stage boundary (b x s x h); logits_bytes:
    one micro-batch's logits as the last stage returns them (stage_logits_bytes)."""
    if plan.pp == 1:
        return StageBuffers(held_bytes=0, forward_logits_bytes=0, backward_logits_bytes=0,
                            output_grad_in_buffer_bytes=0)
    first, last = stage == 0, stage == plan.pp - 1
    m = plan.grad_accum
    one_f_one_b = plan.pp_schedule == "1f1b"
    held = 0
    if not last:
        outputs = in_flight + (1 if one_f_one_b and m > in_flight else 0)  # fwd_cache + send_work
        held += (outputs + m) * boundary_bytes  # + one gradient receive buffer per micro-batch
    if not first:
        held += (m - in_flight) * boundary_bytes  # receive buffers of the micro-batches not in flight
        held += (1 if one_f_one_b and m > 1 else 0) * boundary_bytes  # bwd_sends' input gradient
    if not last:
        return StageBuffers(held_bytes=held, forward_logits_bytes=0, backward_logits_bytes=0,
                            output_grad_in_buffer_bytes=boundary_bytes)
    return StageBuffers(held_bytes=held, forward_logits_bytes=(in_flight - 1) * logits_bytes,
                        backward_logits_bytes=in_flight * logits_bytes, output_grad_in_buffer_bytes=0)
