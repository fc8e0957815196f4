"""Hand-worked checks of two run facts the step-time model can be told (session 10, issue 21):
FlashAttention-2 priced as its own benchmark measures it (kernels.fa2_attention_time_s), and a
timed step that is one micro-batch inside torch's no_sync() (estimate_step_time no_sync_step),
which is what VectorLM's profiling/benchmark.py measures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.calibrate.published_throughput import map_record
from memkit.estimate import kernels
from memkit.estimate import throughput as tp_model
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

ROOT = Path(__file__).resolve().parents[2]
LLAMA1B = load_model_spec("llama-3.2-1b")
A100 = find_gpu("a100-80gb")
A6000 = find_gpu("rtx-a6000")
H100 = find_gpu("h100-80gb")
A100_CLOCK = 1305 / 1410


def test_fa2_runs_half_the_causal_work_at_the_figure_bar():
    fwd = 4.0 * 16384 * 2048 * 32 * 128          # 4 T s H Q: the forward's counted FLOPs
    t = kernels.fa2_attention_time_s(A100, "bf16", 3 * fwd, seq_len=2048, head_dim=128, causal=True)
    # half the forward's blocks, x3.5 for forward + backward, at Figure 4's 155 TFLOP/s (causal, d128, 2k)
    assert t == pytest.approx(fwd * 0.5 * 3.5 / (155e12 * A100_CLOCK))
    # non-causal at 4k: all the work, at the 196 TFLOP/s bar
    t = kernels.fa2_attention_time_s(A100, "bf16", 3 * fwd, seq_len=4096, head_dim=128, causal=False)
    assert t == pytest.approx(fwd * 3.5 / (196e12 * A100_CLOCK))
    # another Ampere part runs the A100 bar scaled by its 16-bit peak (154.8 of 312 TFLOP/s)
    t = kernels.fa2_attention_time_s(A6000, "bf16", 3 * fwd, seq_len=8192, head_dim=64, causal=True)
    assert t == pytest.approx(fwd * 0.5 * 3.5 / (165e12 * 154.8 / 312 * A100_CLOCK))
    # H100: its own figure (causal d128 at 16k: 328 TFLOP/s) at the Hopper sustained clock
    t = kernels.fa2_attention_time_s(H100, "bf16", 3 * fwd, seq_len=16384, head_dim=128, causal=True)
    assert t == pytest.approx(fwd * 0.5 * 3.5 / (328e12 * 1575 / 1980))


def test_flash_attention_time_s_dispatches_on_the_stated_kernel():
    fwd = 4.0 * 8192 * 8192 * 32 * 128
    headline = kernels.flash_attention_time_s(A100, "bf16", 3 * fwd, seq_len=8192, head_dim=128)
    assert headline == pytest.approx(3 * fwd / (312e12 * 0.50 * A100_CLOCK * 182 / 189))
    fa2 = kernels.flash_attention_time_s(A100, "bf16", 3 * fwd, seq_len=8192, head_dim=128, kernel="fa2")
    assert fa2 == pytest.approx(fwd * 1.75 / (182e12 * A100_CLOCK))
    # on the same length and head dim the two differ by 1.75 / (3 x 189 / 312 / 0.5) = 0.48x
    assert fa2 / headline == pytest.approx(1.75 * 312 * 0.5 / (3 * 189))
    with pytest.raises(ValueError):
        kernels.flash_attention_time_s(A100, "bf16", fwd, kernel="fa3")


def test_attention_pass_keeps_the_kernels_forward_share_under_fa2():
    plan = TrainingPlan(micro_batch_size=2, seq_len=4096, precision="bf16", attention="flash")
    tokens = plan.micro_batch_size * plan.seq_len
    p = tp_model._attention_pass(A100, plan, LLAMA1B, tokens, attention_kernel="fa2")
    assert p.bwd_s == pytest.approx(2.5 * p.fwd_s)
    fwd = 4.0 * tokens * 4096 * LLAMA1B.num_attention_heads * LLAMA1B.head_dim
    assert LLAMA1B.head_dim == 64   # Figure 4's causal d64 bar at 4k: 156 TFLOP/s
    assert p.fwd_s + p.bwd_s == pytest.approx(fwd * 1.75 / (156e12 * A100_CLOCK))
    default = tp_model._attention_pass(A100, plan, LLAMA1B, tokens)
    assert default.fwd_s > p.fwd_s
    # the step as a whole: only the attention core moves
    base = estimate_step_time(LLAMA1B, plan, Hardware(gpu=A100))
    fa2 = estimate_step_time(LLAMA1B, plan, Hardware(gpu=A100), attention_kernel="fa2")
    saved = (default.fwd_s + default.bwd_s - p.fwd_s - p.bwd_s) * LLAMA1B.num_layers
    assert base.components_s["compute"] - fa2.components_s["compute"] == pytest.approx(saved)


def test_no_sync_fsdp_gathers_forward_and_backward_and_reduces_nothing():
    hw = Hardware(gpu=A100, num_gpus_per_node=8)
    plan = TrainingPlan(engine="torch", zero_stage=3, dp=4, micro_batch_size=2, seq_len=2048,
                        precision="bf16-pure", attention="flash")
    comm = tp_model._dp_comm(plan, LLAMA1B, hw, 1.0, 2.0, no_sync=True)
    layers = LLAMA1B.total_layers
    ag = tp_model._ring_time_s(LLAMA1B.num_params * 2, 4, tp_model._dp_link(plan, hw), allreduce=False, count=layers)
    assert comm.micro_s == pytest.approx(tp_model._overlapped(ag, 1.0) + tp_model._overlapped(ag, 2.0) + 2 * ag / layers)
    assert comm.boundary_s == 0.0
    assert comm.micro_s < tp_model._dp_comm(plan, LLAMA1B, hw, 1.0, 2.0).micro_s   # the reduce-scatter is gone
    # DDP skips its all-reduce, SHARD_GRAD_OP keeps its unsharded params: nothing at all
    for stage in (0, 2):
        assert tp_model._dp_comm(plan.with_(zero_stage=stage), LLAMA1B, hw, 1.0, 2.0, no_sync=True) == tp_model._Comm()


def test_no_sync_step_has_no_optimizer_step_and_clips_the_unsharded_grads():
    hw = Hardware(gpu=A100, num_gpus_per_node=8)
    plan = TrainingPlan(engine="torch", zero_stage=3, dp=2, micro_batch_size=2, seq_len=2048,
                        precision="bf16-pure", attention="flash", gradient_clipping=1.0)
    est = estimate_step_time(LLAMA1B, plan, hw, no_sync_step=True)
    # bf16 gradients, every element on each rank: norm read + rescale read and write
    assert est.components_s["optimizer_step"] == pytest.approx(
        kernels.memory_time_s(A100, 3 * 2 * LLAMA1B.num_params))
    unclipped = estimate_step_time(LLAMA1B, plan.with_(gradient_clipping=0.0), hw, no_sync_step=True)
    assert unclipped.components_s["optimizer_step"] == 0.0
    assert est.components_s["compute"] == estimate_step_time(LLAMA1B, plan, hw).components_s["compute"]
    with pytest.raises(ValueError):
        estimate_step_time(LLAMA1B, plan.with_(engine="deepspeed"), hw, no_sync_step=True)


def test_vectorlm_rows_map_to_one_no_sync_micro_batch_on_fa2():
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "data" / "holdout_throughput.jsonl").read_text().splitlines()]
    cfg = ROOT / "benchmarks" / "calibration_configs"
    by_id = {r["id"]: r for r in rows}
    vl = map_record(by_id["vectorlm-full-n2-s4096"], configs_dir=cfg)
    assert vl.no_sync_step and vl.attention_kernel == "fa2"
    assert (vl.plans[0].grad_accum, vl.plans[0].micro_batch_size, vl.plans[0].gradient_clipping) == (1, 4, 1.0)
    tt = map_record(by_id["torchtune-flags-3b-packed"], configs_dir=cfg)
    assert not tt.no_sync_step and tt.attention_kernel is None
