"""The estimator against measured memory for the memory-saving techniques: the chunked loss,
partial checkpointing (first K of 4 blocks), selective checkpointing and bitsandbytes' 8-bit AdamW, on Llama (GQA, untied
head), GPT-2 (tied head, dropout), Qwen2 (tied) and GPT-NeoX, single process and 2-rank DeepSpeed
ZeRO-2/3. tests/golden/cpu_measurements_techniques.json is written by
`python benchmarks/measure_cpu_techniques.py --out tests/golden/cpu_measurements_techniques.json`
(the runner's own code: memkit/train/techniques.py, chunked_loss.py). Same tolerance as
tests/unit/test_estimate_measured.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import spec_from_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cpu_measurements_techniques.json"
TOLERANCE = 0.05
ROWS = json.loads(GOLDEN.read_text())["rows"]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_technique_estimate_within_tolerance_of_measured_peak(row):
    spec = spec_from_config(dict(row["model_config"]), name=row["arch"])
    plan = TrainingPlan.from_dict(row["plan"])
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=plan.num_gpus)
    est = estimate_memory(spec, plan, hardware, device="cpu")
    measured = row["measured"]
    peak = measured.get("peak_bytes") or max(r["peak_bytes"] for r in measured["ranks"])
    assert est.allocated_peak_bytes == pytest.approx(peak, rel=TOLERANCE), (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs measured {peak}")
    assert est.num_trainable_params == row["num_trainable_params"]


def test_every_technique_is_measured_on_two_architectures():
    by_technique: dict[str, set[str]] = {}
    for row in ROWS:
        plan = row["plan"]
        if plan["loss"] != "standard":
            by_technique.setdefault("chunked loss", set()).add(row["arch"])
        if plan["checkpointing"] == "selective":
            by_technique.setdefault("selective checkpointing", set()).add(row["arch"])
        elif plan["checkpointing"] not in ("none", "full"):
            by_technique.setdefault("partial checkpointing", set()).add(row["arch"])
        if plan["optimizer"] == "adamw-8bit":
            by_technique.setdefault("8-bit AdamW", set()).add(row["arch"])
    assert {k: len(v) >= 2 for k, v in by_technique.items()} == {
        "chunked loss": True, "partial checkpointing": True, "selective checkpointing": True,
        "8-bit AdamW": True}
