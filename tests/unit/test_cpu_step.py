"""Real CPU training steps of a tiny HF model: the measured parts are exact multiples of the
parameter count (fp32 AdamW: 4 B weights, 4 B grads, 8 B m+v; Kingma & Ba 2015, Alg. 1), and the
golden matrix (tests/golden/cpu_measurements.json) is internally consistent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from memkit.errors import MemkitError  # noqa: E402
from memkit.calibrate.cpu_step import count_params, measure_training  # noqa: E402
from memkit.plan.plan import TrainingPlan  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 128, "tie_word_embeddings": False}
PLAN = TrainingPlan(engine="torch", precision="fp32", attention="sdpa", micro_batch_size=2, seq_len=32)
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "cpu_measurements.json"


def test_fp32_adamw_parts_are_exact_multiples_of_params():
    num_params = count_params(TINY, PLAN)["num_params"]
    assert num_params == 2 * 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64) + 64
    result = measure_training(TINY, PLAN, num_steps=2)
    after = result["boundary"]["after_step"]
    assert after["params_bytes"] == 4 * num_params
    assert after["grads_bytes"] == 4 * num_params
    assert after["optimizer_bytes"] == 8 * num_params
    # One 0-dim fp32 `step` counter per parameter tensor: 2 embeddings-ish + 9 per layer + final norm.
    assert after["optimizer_scalar_bytes"] == 4 * (2 + 2 * 9 + 1)
    assert result["boundary"]["after_zero_grad"]["grads_bytes"] == 0
    step = result["phases"]["optimizer_step"]
    # foreach AdamW (torch/optim/adam.py, _multi_tensor_adam): sqrt(v) for all params at once.
    assert step["peak_bytes"] - step["start_live_bytes"] == 4 * num_params
    assert result["peak_bytes"] >= result["phases"]["backward"]["peak_bytes"]


def test_bf16_pure_halves_every_state():
    num_params = count_params(TINY, PLAN)["num_params"]
    after = measure_training(TINY, PLAN.with_(precision="bf16-pure"), num_steps=2)["boundary"]["after_step"]
    assert (after["params_bytes"], after["grads_bytes"], after["optimizer_bytes"]) == (
        2 * num_params, 2 * num_params, 4 * num_params)


def test_lora_trains_only_adapters():
    plan = PLAN.with_(lora_rank=4, lora_targets=("q_proj", "v_proj"))
    counts = count_params(TINY, plan)
    # A: r x in, B: out x r for q (64->64) and v (64->32) in 2 layers.
    assert counts["num_trainable_params"] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    after = measure_training(TINY, plan, num_steps=2)["boundary"]["after_step"]
    assert after["grads_bytes"] == 4 * counts["num_trainable_params"]
    assert after["optimizer_bytes"] == 8 * counts["num_trainable_params"]


def test_rejects_plans_it_cannot_run():
    with pytest.raises(MemkitError, match="fp16"):
        measure_training(TINY, PLAN.with_(precision="fp16"))
    with pytest.raises(MemkitError, match="ZeRO"):
        measure_training(TINY, PLAN.with_(zero_stage=2))
    with pytest.raises(MemkitError, match="steps"):
        measure_training(TINY, PLAN, num_steps=1)


_BYTES = {"fp32": 4, "bf16": 4, "bf16-pure": 2}  # bytes per stored weight (bf16 = fp32 master params)


@pytest.mark.skipif(not GOLDEN.exists(), reason="golden measurements not generated")
def test_golden_single_rows_are_consistent():
    rows = [r for r in json.loads(GOLDEN.read_text())["rows"] if r["kind"] == "single"]
    assert len(rows) >= 25
    for row in rows:
        plan = TrainingPlan.from_dict(row["plan"])
        after = row["measured"]["boundary"]["after_step"]
        width = _BYTES[plan.precision]
        # peft keeps adapter weights in fp32 even in a bf16 model (get_peft_model's
        # autocast_adapter_dtype=True, peft/mapping_func.py).
        trainable_width = 4 if plan.is_lora else width
        num_frozen = row["num_params"] - row["num_trainable_params"]
        assert after["params_bytes"] == width * num_frozen + trainable_width * row["num_trainable_params"], \
            row["id"]
        assert after["grads_bytes"] == trainable_width * row["num_trainable_params"], row["id"]
        per_param = {"adamw": 2 * trainable_width, "sgd": trainable_width}.get(plan.optimizer)
        if per_param is not None:
            assert after["optimizer_bytes"] == per_param * row["num_trainable_params"], row["id"]
        phases = row["measured"]["phases"]
        assert row["measured"]["peak_bytes"] >= max(p["peak_bytes"] for p in phases.values() if p), row["id"]
