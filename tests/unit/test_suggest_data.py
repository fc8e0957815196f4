"""`memkit suggest --data FILE` (issue 20): --seq-len from the data by the rule `memkit run --seq-len
from-data` applies, and what padding costs against packing at the chosen micro-batch, counted on
the runner's own tokenisation and packing (memkit/train/data.py)."""
from __future__ import annotations

import json
import random

import pytest

from memkit.cli.main import main

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 512, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("suggest-data")
    (root / "config.json").write_text(json.dumps(TINY))
    rng = random.Random(0)
    with open(root / "train.jsonl", "w") as handle:  # prompt/completion rows of varied length
        for i in range(60):
            handle.write(json.dumps({"prompt": "q" * rng.randint(5, 150), "completion": " a" * rng.randint(1, 40)})
                         + "\n")
    return root


def _suggest(folder, capsys, *extra):
    assert main(["suggest", "--model", str(folder / "config.json"), "--gpu", "rtx-4090", "--global-batch-size", "4",
                 "--data", str(folder / "train.jsonl"), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_seq_len_and_padding_are_the_runners(folder, capsys):
    from memkit.train.data import example_lengths, prepare_data, seq_len_from_data
    from memkit.train.tokenizer import load_tokenizer

    out = _suggest(folder, capsys)
    tokenizer = load_tokenizer(None, vocab_size=TINY["vocab_size"])  # no tokenizer beside config.json
    lengths = example_lengths(str(folder / "train.jsonl"), tokenizer)
    seq_len, line = seq_len_from_data(str(folder / "train.jsonl"), tokenizer, max_positions=512)
    data, plan = out["data"], out["plan"]
    assert plan["seq_len"] == seq_len == data["seq_len"] and data["seq_len_from_data"] == line
    assert (data["examples"], data["longest"]) == (60, max(lengths))
    packed = prepare_data(str(folder / "train.jsonl"), tokenizer, seq_len=seq_len, max_positions=512,
                          vocab_size=TINY["vocab_size"], packing=True)
    assert data["packed_rows"] == packed.num_sequences  # the rows memkit train would step over
    real = sum(lengths)
    assert data["padding_share"]["packed"] == round(1 - real / (packed.num_sequences * seq_len), 4)
    assert data["padding_share"]["seq-len"] == round(1 - real / (len(lengths) * seq_len), 4)
    assert 0 < data["padding_share"]["longest"] < data["padding_share"]["seq-len"]
    assert data["micro_batch_size"] == plan["micro_batch_size"]


def test_a_given_seq_len_is_kept_and_longer_examples_are_counted(folder, capsys):
    from memkit.train.data import example_lengths
    from memkit.train.tokenizer import load_tokenizer

    lengths = example_lengths(str(folder / "train.jsonl"), load_tokenizer(None, vocab_size=TINY["vocab_size"]))
    out = _suggest(folder, capsys, "--seq-len", "128")
    assert out["plan"]["seq_len"] == 128 and out["data"]["seq_len_from_data"] is None
    assert out["data"]["longer_than_seq_len"] == sum(n > 128 for n in lengths) > 0


def test_the_text_says_it(folder, capsys):
    assert main(["suggest", "--model", str(folder / "config.json"), "--gpu", "rtx-4090", "--global-batch-size", "4",
                 "--data", str(folder / "train.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "from the data: the longest of 60 prompt_completion records" in text
    assert "tokenized by memkit's byte tokenizer" in text and "packed into" in text


def test_without_data_the_default_seq_len_holds(capsys):
    assert main(["suggest", "--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--global-batch-size", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["seq_len"] == 2048 and "data" not in out
