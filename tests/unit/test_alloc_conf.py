"""PYTORCH_CUDA_ALLOC_CONF: what the runner sets, what the estimate prices, what bundles and
launch scripts export, and the one line when a user's setting differs."""
from __future__ import annotations

import json

from memkit.cli.estimate import alloc_conf_note
from memkit.emit.bundle import alloc_conf_lines
from memkit.estimate.memory import estimate_memory
from memkit.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.train.main import ALLOC_CONF, set_alloc_conf


def test_runner_sets_expandable_segments_unless_the_user_did():
    env: dict[str, str] = {}
    assert set_alloc_conf(env) == "" and env["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF == "expandable_segments:True"
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    note = set_alloc_conf(mine)
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # kept
    assert "max_split_size_mb:128" in note and "expandable_segments:True" in note and "\n" not in note
    same = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}
    assert set_alloc_conf(same) == ""


def test_estimate_prices_the_allocator_setting_and_plan_json_records_it():
    model = load_model_spec("llama-3.2-1b")
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    plan = TrainingPlan(precision="bf16", micro_batch_size=4, seq_len=1024, lora_rank=16)
    assert plan.expandable_segments and plan.to_dict()["expandable_segments"] is True
    assert TrainingPlan.from_dict({k: v for k, v in plan.to_dict().items() if k != "expandable_segments"}) == plan
    expandable = estimate_memory(model, plan, hw)
    default = estimate_memory(model, TrainingPlan.from_dict({**plan.to_dict(), "expandable_segments": False}), hw)
    # the same tensors; expandable segments split any remainder >= 512 B, default large blocks only
    # a remainder > 1 MiB (allocator.py should_split), so fewer bytes are handed out whole
    assert expandable.allocated_peak_bytes <= default.allocated_peak_bytes <= expandable.allocated_peak_bytes + 2 ** 24
    assert expandable.reserved_peak_bytes <= default.reserved_peak_bytes
    cpu = estimate_memory(model, plan, hw, device="cpu")
    assert cpu.reserved_peak_bytes == cpu.allocated_peak_bytes  # no caching allocator on CPU


def test_one_line_when_the_shell_setting_differs():
    plan = TrainingPlan()
    assert alloc_conf_note(plan, {}) == ""
    assert alloc_conf_note(plan, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == ""
    line = alloc_conf_note(plan, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    assert "max_split_size_mb:64" in line and "\n" not in line
    default = TrainingPlan(expandable_segments=False)
    assert "default segments" in alloc_conf_note(default, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_bundle_readme_exports_it():
    lines = "\n".join(alloc_conf_lines(json.loads(json.dumps(TrainingPlan().to_dict()))))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in lines
    assert "export" not in "\n".join(alloc_conf_lines(TrainingPlan(expandable_segments=False).to_dict()))
