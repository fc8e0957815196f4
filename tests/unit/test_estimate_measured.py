"""The estimator against measured memory: real CPU training steps of small HF models.

tests/golden/cpu_measurements.json holds the peak bytes of live tensors of real training steps
(memkit/calibrate/cpu_step.py and deepspeed_step.py under a LiveTensorTracker; regenerate with
`python benchmarks/measure_cpu.py --out tests/golden/cpu_measurements.json`). Each row carries
its model config and TrainingPlan; the estimate (device='cpu') must be within TOLERANCE of the
measured peak. This is the estimator's main correctness test: the same op-level accounting
prices the GPU runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cpu_measurements.json"
TOLERANCE = 0.05
# Rows with a wider, stated tolerance and why (each is a known gap of the model, not noise).
# None now: ds-z3-bf16-offload (-5.1 %) was ZeRO-3's gradient partition buffer, which sits on the host
# under optimizer offload (estimate/states.py) and was not priced; it reads -0.2 %.
KNOWN_GAPS: dict[str, float] = {}
ROWS = json.loads(GOLDEN.read_text())["rows"]


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    cache = {}

    def get(model_config: dict):
        key = json.dumps(model_config, sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp("cfg")
            (folder / "config.json").write_text(key)
            cache[key] = load_model_spec(str(folder))
        return cache[key]
    return get


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_estimate_within_tolerance_of_measured_peak(row, specs):
    spec = specs(row["model_config"])
    plan = TrainingPlan.from_dict(row["plan"])
    assert spec.num_params == row["num_params"] - (row["num_trainable_params"] if plan.is_lora
                                                   and row["num_params"] != spec.num_params else 0)
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=plan.num_gpus)
    est = estimate_memory(spec, plan, hardware, device="cpu")
    measured = row["measured"]
    peak = measured.get("peak_bytes") or max(r["peak_bytes"] for r in measured["ranks"])
    tolerance = KNOWN_GAPS.get(row["id"], TOLERANCE)
    assert est.allocated_peak_bytes == pytest.approx(peak, rel=tolerance), (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs measured {peak}")
    assert est.num_trainable_params == row["num_trainable_params"]
