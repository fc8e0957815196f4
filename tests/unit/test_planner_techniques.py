"""The planner uses the chunked loss and partial checkpointing (memkit/plan/techniques.py) where
they make a plan fit without offload, and picks the smallest number of checkpointed blocks."""
from __future__ import annotations

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.planner import Request, search
from memkit.planner.search import device_peak_bytes
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec


def request(**pins) -> Request:
    """llama-3.2-1b (128k vocabulary: 4 GiB of fp32 logits per 8k-token sequence) on 2 x A100-40GB,
    global batch 8 x 8192 tokens."""
    return Request(model=load_model_spec("llama-3.2-1b"), hardware=Hardware(gpu=find_gpu("a100-40gb"),
                   num_gpus_per_node=2), global_batch_size=8, seq_len=8192, split="if-needed", **pins)


def _offloads(plan) -> bool:
    return plan.offload_optimizer != "none" or plan.offload_params != "none"


def test_without_the_techniques_only_an_offload_fits():
    plan = search(request(loss="standard", checkpointing="none")).chosen.plan
    assert _offloads(plan)


def test_fits_only_with_the_chunked_loss_gets_it_instead_of_an_offload():
    offload = search(request(loss="standard", checkpointing="none")).chosen
    chosen = search(request(checkpointing="none")).chosen
    assert chosen.plan.loss == "chunked" and not _offloads(chosen.plan)
    assert chosen.speed.step_time_s < offload.speed.step_time_s


def test_fits_only_with_partial_checkpointing_gets_the_smallest_k_instead_of_an_offload():
    req = request(loss="standard")
    chosen = search(req).chosen
    plan = chosen.plan
    k = int(plan.checkpointing)  # a number of blocks, not none/full
    assert 0 < k < req.model.total_layers and not _offloads(plan)
    # the smallest K: one block fewer does not fit the same plan
    fewer = estimate_memory(req.model, plan.with_(checkpointing=str(k - 1) if k > 1 else "none"), req.hardware)
    # (the planner's fit rule: prediction inside the budget, upper bound inside the device)
    assert (device_peak_bytes(fewer) > req.budget_bytes
            or fewer.nvidia_smi_peak_upper_bytes > req.hardware.gpu.memory_bytes)
    assert chosen.speed.step_time_s < search(request(loss="standard", checkpointing="full")).chosen.speed.step_time_s
    assert f"ckpt {k} blocks" in chosen.label


@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_memory_does_not_grow_with_more_checkpointed_blocks(loss):
    """What the planner's bisection over K relies on (search._partial_checkpointing)."""
    req = request()
    base = search(request(loss=loss, checkpointing="full")).chosen.plan
    peaks = [estimate_memory(req.model, base.with_(checkpointing=c), req.hardware).allocated_peak_bytes
             for c in ["none", *map(str, range(1, req.model.total_layers)), "full"]]
    assert all(a >= b for a, b in zip(peaks, peaks[1:]))
    assert peaks[0] > peaks[-1]


def test_readme_main_job_uses_the_chunked_loss():
    """llama-3.1-8b on 2 x RTX 4090, 64 x 2048: with the standard loss and full checkpointing the
    fp32 logits are the largest tensor group after the weights at the peak."""
    req = Request(model=load_model_spec("llama-3.1-8b"), hardware=Hardware(gpu=find_gpu("rtx-4090"),
                  num_gpus_per_node=2), global_batch_size=64, seq_len=2048)
    chosen = search(req).chosen
    before = search(Request(**{**{f: getattr(req, f) for f in req.__dataclass_fields__}, "loss": "standard",
                               "checkpointing": "full"})).chosen
    assert chosen.plan.loss == "chunked"
    parts = dict(before.memory.components)
    parts.pop("weights")
    assert max(parts, key=parts.get) == "logits_and_loss"
    assert chosen.speed.step_time_s < before.speed.step_time_s
