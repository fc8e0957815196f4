"""The golden CPU rows' one reader and one estimate rule (tests/golden/cpu_measurements_*.json):
a row's HF config and plan, priced on one a100-80gb with device='cpu' (the CPU allocator's rules)."""
from __future__ import annotations

import json
from pathlib import Path

from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import spec_from_config

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"


def golden_rows(name: str) -> list[dict]:
    """The rows of tests/golden/cpu_measurements_<name>.json."""
    return json.loads((GOLDEN_DIR / f"cpu_measurements_{name}.json").read_text())["rows"]


def estimate_row(row: dict):
    spec = spec_from_config(dict(row["model_config"]), name=row["arch"])
    plan = TrainingPlan.from_dict(row["plan"])
    return estimate_memory(spec, plan, Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1), device="cpu")
