"""What a QLoRA bundle tells a user, run as printed: `suggest --quantize-base nf4 --out DIR` on a
tiny Llama checkpoint writes plan.json with the BitsAndBytesConfig kwargs and a README whose
Trainer code (memkit/emit/bundle.py) loads the base in 4 bits with bitsandbytes on CPU, prepares
it and puts the plan's LoRA on top; its TrainingArguments flags parse. Plus the CLI's one-line
refusals and estimate --json's component names."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from memkit.cli.main import main

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny")
    data = dict(TINY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(data.pop("model_type"), **data)).save_pretrained(folder)
    return folder


def test_bundle_code_loads_a_4bit_base_with_the_plans_lora(checkpoint, tmp_path, capsys):
    out = tmp_path / "bundle"
    assert main(["suggest", "--model", str(checkpoint), "--gpu", "rtx-4090", "--global-batch-size", "4",
                 "--seq-len", "64", "--lora-rank", "8", "--quantize-base", "nf4", "--precision", "bf16",
                 "--out", str(out)]) == 0  # bf16 pinned: a model this tiny runs fastest in fp32 (host-bound)
    capsys.readouterr()
    doc = json.loads((out / "plan.json").read_text())
    assert doc["bitsandbytes"] == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                   "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    assert (doc["plan"]["quantize_base"], doc["plan"]["engine"], doc["request"]["quantize_base"]) == \
        ("nf4", "torch", "nf4")
    readme = (out / "README.md").read_text()
    assert "| 4-bit base | nf4, double quant on" in readme
    section = readme[readme.index("With Hugging Face Trainer instead"):]
    flags, code = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)[:2]
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        shlex.split(flags) + ["--output_dir", str(tmp_path / "t"), "--report_to", "none", "--use_cpu", "True"])
    assert (args.per_device_train_batch_size * args.gradient_accumulation_steps, args.bf16) == (4, True)
    scope: dict = {}
    exec(code, scope)  # the README's lines, as a user pastes them
    model = scope["model"]
    kinds = {type(p).__name__ for n, p in model.named_parameters() if "lora_" not in n and "proj" in n}
    assert kinds == {"Params4bit"}
    trainable = {n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A", "lora_B"}
    assert model.peft_config["default"].r == 8


def test_quantize_base_without_lora_is_one_line(capsys):
    code = main(["estimate", "--model", "llama-3.2-1b", "--gpu", "a100-80gb", "--quantize-base", "nf4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "add --lora-rank" in err[0]


def test_estimate_json_names_the_4bit_components(capsys):
    assert main(["estimate", "--model", "llama-3.2-1b", "--gpu", "a100-80gb", "--lora-rank", "8",
                 "--quantize-base", "fp4", "--checkpointing", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"weights_4bit", "quant_state"} <= set(out["components"])
