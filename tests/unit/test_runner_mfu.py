"""The runner's measured MFU counts the same model FLOPs per token as the predicted MFU (commit
9433250, reverted as 503b41d, re-landed): the input-embedding lookup is no matmul, a tied LM head
still multiplies (estimate/throughput.py matmul_params; PaLM App. B)."""
from __future__ import annotations

import json

import pytest

from memkit.plan.plan import TrainingPlan

BASE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 256}


@pytest.mark.parametrize("tied", [False, True])
def test_runner_flops_per_token_equal_the_estimate(tmp_path, tied):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.estimate.throughput import flops_per_token
    from memkit.measure.runtime import train_flops_per_token
    from memkit.spec.hf import load_model_spec
    from memkit.spec.resolve import resolve_model
    from memkit.train.loop import _lookup_params

    cfg = {**BASE, "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = resolve_model(str(tmp_path))
    config = dict(cfg)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                             dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())  # what the loop counts (tied weights once)
    lookup = _lookup_params(source)
    assert lookup == (0 if tied else 320 * 64)
    runner = train_flops_per_token(num_params=num_params, num_trainable_params=num_params, num_layers=2,
                                   hidden_size=64, seq_len=128, embedding_params=min(lookup, num_params))
    predicted, _ = flops_per_token(load_model_spec(str(tmp_path)), TrainingPlan(seq_len=128))
    assert runner == predicted
