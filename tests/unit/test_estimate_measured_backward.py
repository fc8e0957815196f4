"""The estimator against measured memory for activation offload and the optimizer in backward
(memkit/plan/backward_techniques.py) on Llama (GQA, untied), GPT-2 (tied, dropout), Qwen2 (tied) and
GPT-NeoX. tests/golden/cpu_measurements_backward.json is written by
`python benchmarks/measure_cpu_backward.py --out tests/golden/cpu_measurements_backward.json`
(the runner's own hooks: memkit/train/backward_techniques.py; offload measured with a store the
tracker does not see, i.e. the device side). Same tolerance as tests/unit/test_estimate_measured.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memkit.estimate.backward_techniques import offloaded_activation_bytes
from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import spec_from_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cpu_measurements_backward.json"
TOLERANCE = 0.05
ROWS = json.loads(GOLDEN.read_text())["rows"]


def _estimate(row):
    spec = spec_from_config(dict(row["model_config"]), name=row["arch"])
    plan = TrainingPlan.from_dict(row["plan"])
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=plan.num_gpus)
    return spec, plan, estimate_memory(spec, plan, hardware, device="cpu")


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_backward_technique_estimate_within_tolerance_of_measured_peak(row):
    spec, plan, est = _estimate(row)
    peak = row["measured"]["peak_bytes"]
    error = est.allocated_peak_bytes / peak - 1
    assert abs(error) <= TOLERANCE, (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs {peak}")
    assert est.num_trainable_params == row["num_trainable_params"]


@pytest.mark.parametrize("row", [r for r in ROWS if r["plan"]["offload_activations"] != "none"],
                         ids=lambda r: r["id"])
def test_offloaded_bytes_match_what_the_pack_hook_copied(row):
    spec, plan, _ = _estimate(row)
    moved = row["measured"]["offloaded_bytes_per_micro_batch"]
    error = offloaded_activation_bytes(spec, plan, device="cpu") / moved - 1
    assert abs(error) <= TOLERANCE, row["id"]


def test_each_technique_is_measured_on_two_architectures():
    archs = {"offload": set(), "in_backward": set()}
    for row in ROWS:
        if row["plan"]["offload_activations"] != "none":
            archs["offload"].add(row["arch"])
        if row["plan"]["optimizer_in_backward"]:
            archs["in_backward"].add(row["arch"])
    assert {k: len(v) >= 2 for k, v in archs.items()} == {"offload": True, "in_backward": True}
