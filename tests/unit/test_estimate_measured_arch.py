"""The estimator against measured CPU steps of state-space, hybrid, encoder-decoder and encoder
families (issue #27): Mamba, Jamba, BART, ELECTRA, DeBERTa-v2, DistilBERT.

tests/golden/cpu_measurements_arch.json holds the peak live-tensor bytes of real training steps
(memkit/calibrate/cpu_step.py; regenerate with `python benchmarks/measure_cpu_arch.py --out
tests/golden/cpu_measurements_arch.json`); the estimate (device='cpu') must be within TOLERANCE.
`python benchmarks/arch_accuracy.py` prints the same comparison per family.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.generic import task_spec
from memkit.spec.hf import spec_from_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cpu_measurements_arch.json"
TOLERANCE = 0.05
ROWS = json.loads(GOLDEN.read_text())["rows"]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_estimate_within_tolerance_of_measured_peak(row):
    plan = TrainingPlan.from_dict(row["plan"])
    spec = task_spec(spec_from_config(row["model_config"], name=row["arch"]), plan)  # --task's head
    assert spec.num_params == row["num_params"] - (row["num_trainable_params"] if plan.is_lora else 0)
    est = estimate_memory(spec, plan, Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1), device="cpu")
    peak = row["measured"]["peak_bytes"]
    assert est.allocated_peak_bytes == pytest.approx(peak, rel=TOLERANCE), (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs measured {peak}")
    # exact, peft's own count on the measured model (a hybrid stack's Mamba-only and attention-only
    # targets too: ModelSpec.linear_in_out)
    assert est.num_trainable_params == row["num_trainable_params"]


def test_every_family_has_rows():
    assert {r["arch"] for r in ROWS} == {"mamba", "jamba", "bart", "electra", "deberta-v2", "distilbert",
                                         "bert", "t5"}
    tasks = {(r["arch"], r["plan"].get("task", "causal-lm")) for r in ROWS}
    assert {("bert", "seq-cls"), ("bert", "token-cls"), ("deberta-v2", "seq-cls"), ("electra", "seq-cls"),
            ("distilbert", "token-cls")} <= tasks
    assert {r["arch"] for r in ROWS if r["plan"].get("target_len")} == {"bart", "t5"}


def test_jamba_lora_count_is_peft_count():
    """Jamba's LoRA on Mamba-only (in_proj, x_proj) and attention-only (q_proj, o_proj) linears: the
    spec's count equals peft's on the model built from the config (meta device, no weights)."""
    import torch
    from peft import LoraConfig, get_peft_model

    import transformers

    from memkit.estimate.traced import build_config

    config = next(r["model_config"] for r in ROWS if r["arch"] == "jamba")
    targets = ("in_proj", "x_proj", "q_proj", "o_proj")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(build_config(config))
        model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets)))
    peft_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert spec_from_config(config, name="jamba").lora_params(4, targets) == peft_count
