"""Hand-worked check of a run fact the step-time model can be told (session 10, issue 21): a timed
step that is one micro-batch inside torch's no_sync() (estimate_step_time no_sync_step), which is
what VectorLM's profiling/benchmark.py measures."""
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


def test_vectorlm_rows_map_to_one_no_sync_micro_batch():
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "data" / "holdout_throughput.jsonl").read_text().splitlines()]
    cfg = ROOT / "benchmarks" / "calibration_configs"
    by_id = {r["id"]: r for r in rows}
    vl = map_record(by_id["vectorlm-full-n2-s4096"], configs_dir=cfg)
    assert vl.no_sync_step
    assert (vl.plans[0].grad_accum, vl.plans[0].micro_batch_size, vl.plans[0].gradient_clipping) == (1, 4, 1.0)
    tt = map_record(by_id["torchtune-flags-3b-packed"], configs_dir=cfg)
    assert not tt.no_sync_step
