"""The estimator against measured memory for QLoRA (4-bit bitsandbytes bases + LoRA): NF4 and
FP4, with and without double quantisation, fp32 and bf16 autocast, checkpointing and the chunked
loss on top, on Llama (GQA, untied head), Qwen2 (tied head) and GPT-2 (Conv1D linears).
tests/golden/cpu_measurements_qlora.json is written by
`python benchmarks/measure_cpu_qlora.py --out tests/golden/cpu_measurements_qlora.json`
(the runner's loading code: memkit/train/quantize.py). Same tolerance as
tests/unit/test_estimate_measured.py; measured: all rows within 3.2 %.
"""
from __future__ import annotations


import pytest
from golden_rows import estimate_row, golden_rows  # tests/unit/golden_rows.py

from memkit.plan.plan import TrainingPlan

TOLERANCE = 0.05
ROWS = golden_rows("qlora")
_estimate = estimate_row


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_qlora_estimate_within_tolerance_of_measured_peak(row):
    est = _estimate(row)
    peak = row["measured"]["peak_bytes"]
    assert est.allocated_peak_bytes == pytest.approx(peak, rel=TOLERANCE), (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs measured {peak}")
    assert est.num_trainable_params == row["num_trainable_params"]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_packed_weights_and_fp32_rest_are_the_measured_parameter_bytes(row):
    """Exact: the Params4bit storages (ceil(n/2) bytes each) + the fp32 embedding, norms, head and
    adapters are the parameter bytes measured from the model's objects."""
    est = _estimate(row)
    measured = row["measured"]["boundary"]["after_zero_grad"]["params_bytes"]
    assert est.components["weights"] + est.components["weights_4bit"] == measured


def test_each_4bit_setting_is_measured_on_two_architectures():
    by_setting: dict[str, set[str]] = {}
    for row in ROWS:
        plan = row["plan"]
        by_setting.setdefault(plan["quantize_base"], set()).add(row["arch"])
        by_setting.setdefault("double quant" if plan["double_quant"] else "fp32 scales", set()).add(row["arch"])
        by_setting.setdefault(plan["precision"], set()).add(row["arch"])
    assert {k: len(v) >= 2 for k, v in by_setting.items()} == {
        "nf4": True, "fp4": True, "double quant": True, "fp32 scales": True, "fp32": True, "bf16": True}
