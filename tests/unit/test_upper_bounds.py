"""Upper bounds: prediction + the generated margin at bounds.QUANTILE; the table is what the data gives."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memkit.estimate.bounds import QUANTILE_LABEL, choose_quantile, loso_coverage, margin, plan_kind, quantile
from memkit.estimate.memory import estimate_memory
from memkit.estimate.residuals_table import RESIDUAL_MARGIN
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO.parent / "shared" / "calibration"


def test_quantile_interpolates_like_numpy_linear():
    assert quantile([0.0, 1.0], 0.9) == pytest.approx(0.9)
    assert quantile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert quantile([], 0.9) == 0.0


def test_quantile_is_the_smallest_reaching_the_held_out_target():
    # two sources, five rows each; a held-out source's 0.10 row is covered only by the other's max
    rows = [(src, "allocated", r) for src in "ab" for r in (0.0, 0.0, 0.0, 0.0, 0.10)]
    assert loso_coverage(rows, 0.995) == pytest.approx(0.8)  # p99.5 of the other source: 0.08
    assert choose_quantile(rows) == (1.0, 1.0)
    flat = [(src, "cached", 0.0) for src in "ab" for _ in range(5)]
    assert choose_quantile(flat) == (0.9, 1.0)  # p90 already covers every held-out row


def test_estimate_carries_upper_bounds_from_the_table():
    spec = load_model_spec("llama-3.1-8b")
    plan = TrainingPlan(precision="bf16", zero_stage=3, dp=8, micro_batch_size=1, seq_len=2048)
    est = estimate_memory(spec, plan, Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8))
    # pooled by figure (estimate/bounds.py): reserved / nvidia-smi share the 'cached' margin
    m = RESIDUAL_MARGIN["cached"]
    assert est.upper_margin == pytest.approx(max(0.0, m), abs=1e-4)
    assert est.nvidia_smi_peak_upper_bytes == int(est.nvidia_smi_peak_bytes * (1 + est.upper_margin))
    m_alloc = max(0.0, RESIDUAL_MARGIN["allocated"])
    assert est.allocated_peak_upper_bytes == int(est.allocated_peak_bytes * (1 + m_alloc))
    # a local profile's table is keyed by plan kind (memkit/profile.py)
    assert margin(plan, {plan_kind(plan): 0.3, "all": 0.1}) == pytest.approx(0.3)
    assert est.allocated_peak_upper_bytes >= est.allocated_peak_bytes
    d = est.to_dict()
    for name in ("allocated_peak", "reserved_peak", "nvidia_smi_peak"):
        assert d[f"{name}_upper_bytes"] >= d[f"{name}_bytes"]
    assert margin(plan, {"all": -0.2}) == 0.0  # a bound is never below the prediction
    assert est.upper_basis.startswith(f"{QUANTILE_LABEL} of under-prediction")


@pytest.mark.skipif(not (CALIBRATION / "published_gpu_measurements.jsonl").is_file(),
                    reason="../shared/calibration not present")
def test_residual_table_is_generated_from_the_data():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_residuals.py"), "--check",
                        "--calibration", str(CALIBRATION)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
