"""--task / --num-labels / --target-len (issue #27): plan.json keeps them (and leaves them out at
their defaults, so older plan files and the presets read and write the same), the estimate prices
the task's head from transformers' own classes, and every variant memkit cannot price or run is
one line with exit 2. The measured accuracy of these plans: tests/unit/test_estimate_measured_arch.py."""
from __future__ import annotations

import json

import pytest

from memkit.cli.main import main
from memkit.plan.plan import TrainingPlan

BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 128}
MAMBA = {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8, "expand": 2,
         "conv_kernel": 4, "vocab_size": 500}


def _model(tmp_path, config, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _estimate(tmp_path, config, name, *extra):
    return ["estimate", "--model", _model(tmp_path, config, name), "--gpu", "a100-80gb", "--seq-len", "64",
            "--micro-batch-size", "2", *extra]


def test_plan_dict_leaves_out_default_task_fields():
    assert not {"task", "num_labels", "target_len"} & set(TrainingPlan().to_dict())
    plan = TrainingPlan(task="token-cls", num_labels=7, target_len=0)
    data = plan.to_dict()
    assert data["task"] == "token-cls" and data["num_labels"] == 7 and "target_len" not in data
    assert TrainingPlan.from_dict(data) == plan


def test_seq_cls_prices_the_classifier_not_the_lm_head(tmp_path, capsys):
    lm = _estimate(tmp_path, BERT, "lm", "--json")
    assert main(lm) == 0
    lm_out = json.loads(capsys.readouterr().out)
    assert main(_estimate(tmp_path, BERT, "cls", "--json", "--task", "seq-cls", "--num-labels", "3")) == 0
    cls_out = json.loads(capsys.readouterr().out)
    assert cls_out["plan"]["task"] == "seq-cls" and cls_out["plan"]["num_labels"] == 3
    # BertForSequenceClassification (pooler h*h+h, classifier h*3+3) against BertForMaskedLM
    # (transform h*h+h, its LayerNorm 2h, decoder bias vocab; decoder weight tied to the embedding)
    h, v = 64, 500
    assert cls_out["num_params"] - lm_out["num_params"] == (h * h + h + h * 3 + 3) - (h * h + h + 2 * h + v)
    assert cls_out["allocated_peak_bytes"] < lm_out["allocated_peak_bytes"]  # no batch x seq x vocab logits


@pytest.mark.parametrize("config, name, extra, message", [
    (MAMBA, "mamba", ["--task", "seq-cls"], "no SequenceClassification class for model_type 'mamba'"),
    (BERT, "bert", ["--target-len", "32"], "is an encoder, not an encoder-decoder"),
    (BERT, "bert2", ["--task", "token-cls", "--loss", "chunked"], "use --loss standard"),
    (BERT, "bert3", ["--task", "seq-cls", "--num-labels", "0"], "--num-labels 0"),
])
def test_refused_variants_are_one_line_exit_2(tmp_path, capsys, config, name, extra, message):
    assert main(_estimate(tmp_path, config, name, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_runner_refuses_what_it_cannot_train_in_one_line():
    from transformers import BertConfig, LlamaConfig

    from memkit.errors import MemkitError
    from memkit.train.model import data_task

    bert = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    assert data_task(TrainingPlan(task="seq-cls", num_labels=3), bert).num_labels == 3
    with pytest.raises(MemkitError, match="--target-len 64: bert with --task causal-lm has no decoder"):
        data_task(TrainingPlan(target_len=64), bert)
    with pytest.raises(MemkitError, match="QLoRA with a seq-cls model"):
        data_task(TrainingPlan(task="seq-cls", lora_rank=8, quantize_base="nf4"), bert)
    assert data_task(TrainingPlan(), LlamaConfig()).task == "causal-lm"  # the runner's own plans
