"""Upper bounds: prediction + the generated p90 margin; the table is what the data gives."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memkit.estimate.bounds import margin, plan_kind, quantile
from memkit.estimate.memory import estimate_memory
from memkit.estimate.residuals_table import RESIDUAL_P90
from memkit.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO.parent / "shared" / "calibration"


def test_quantile_interpolates_like_numpy_linear():
    assert quantile([0.0, 1.0], 0.9) == pytest.approx(0.9)
    assert quantile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert quantile([], 0.9) == 0.0


def test_estimate_carries_upper_bounds_from_the_table():
    spec = load_model_spec("llama-3.1-8b")
    plan = TrainingPlan(precision="bf16", zero_stage=3, dp=8, micro_batch_size=1, seq_len=2048)
    est = estimate_memory(spec, plan, Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8))
    # pooled by figure (estimate/bounds.py): reserved / nvidia-smi share the 'cached' margin
    m = RESIDUAL_P90["cached"]
    assert est.upper_margin == pytest.approx(max(0.0, m), abs=1e-4)
    assert est.nvidia_smi_peak_upper_bytes == int(est.nvidia_smi_peak_bytes * (1 + est.upper_margin))
    m_alloc = max(0.0, RESIDUAL_P90["allocated"])
    assert est.allocated_peak_upper_bytes == int(est.allocated_peak_bytes * (1 + m_alloc))
    # a local profile's table is keyed by plan kind (memkit/profile.py)
    assert margin(plan, {plan_kind(plan): 0.3, "all": 0.1}) == pytest.approx(0.3)
    assert est.allocated_peak_upper_bytes >= est.allocated_peak_bytes
    d = est.to_dict()
    for name in ("allocated_peak", "reserved_peak", "nvidia_smi_peak"):
        assert d[f"{name}_upper_bytes"] >= d[f"{name}_bytes"]
    assert margin(plan, {"all": -0.2}) == 0.0  # a bound is never below the prediction


@pytest.mark.skipif(not (CALIBRATION / "published_gpu_measurements.jsonl").is_file(),
                    reason="../shared/calibration not present")
def test_residual_table_is_generated_from_the_data():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_residuals.py"), "--check",
                        "--calibration", str(CALIBRATION)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
