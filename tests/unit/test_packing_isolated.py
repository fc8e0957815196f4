"""--packing isolated (#24): examples packed into one sequence each attend only to themselves. On a
real (tiny, seeded) Llama, a packed sequence's loss sum equals the sum of each example's loss run
alone, to float32 rounding; with --packing on (examples see the earlier ones) it does not."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA  # noqa: E402


@pytest.fixture
def setup(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.train.tokenizer import byte_tokenizer

    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                             dtype=torch.float32, attn_implementation="sdpa").eval()
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: what is {i}+{i}?", "completion": f" {2 * i}"}) + "\n"
                            for i in range(6)))
    return model, byte_tokenizer(), str(path)


def _loss(model, batch) -> float:
    from memkit.train.loop import causal_lm_loss_sum
    from memkit.train.techniques import micro_loss_sum

    with torch.no_grad():
        return float(micro_loss_sum(model, None, batch, causal_lm_loss_sum))


def test_isolated_packing_equals_each_example_alone(setup):
    from memkit.train.data import prepare_data

    model, tok, path = setup
    kw = dict(seq_len=96, max_positions=256, vocab_size=320)
    alone = prepare_data(path, tok, packing=False, **kw)
    isolated = prepare_data(path, tok, isolate=True, **kw)
    shared = prepare_data(path, tok, **kw)
    assert alone.num_sequences == 6 and isolated.num_sequences == shared.num_sequences < 6  # several per row
    assert torch.equal(isolated.input_ids, shared.input_ids) and torch.equal(isolated.labels, shared.labels)
    first = isolated.position_ids[0].tolist()
    assert first[0] == 0 and first.count(0) >= 2  # positions restart at each example
    expected = sum(_loss(model, alone.batch([i])) for i in range(alone.num_sequences))
    got = sum(_loss(model, isolated.batch([i])) for i in range(isolated.num_sequences))
    assert got == pytest.approx(expected, rel=1e-5)
    leaked = sum(_loss(model, shared.batch([i])) for i in range(shared.num_sequences))
    # sharing a sequence does change the loss (measured: 109.243 vs 109.345, 9e-4 relative, 90x the tolerance)
    assert leaked != pytest.approx(expected, rel=1e-4)
