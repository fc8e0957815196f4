"""The default --packing (#24): packed examples are isolated (per-example position ids, each attends
only to itself) where the model's transformers code builds the block-diagonal mask from them;
elsewhere, and for text streams, `on`, and the run start says which and why. `--packing on` stays
the explicit cross-attending choice; `--packing isolated` on a model that cannot isolate is one line."""
from __future__ import annotations

import argparse
import json

import pytest
from transformers import AutoConfig

from memkit.errors import MemkitError
from memkit.train.data import isolation_unsupported, resolve_packing

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 320,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


@pytest.mark.parametrize("model_type, supported", [
    ("llama", True), ("qwen2", True), ("mistral", True), ("gpt2", True),
    ("bloom", False),  # ALiBi: BloomForCausalLM.forward takes no position_ids
    ("mamba", False),  # a state-space model: no attention mask at all
])
def test_which_models_isolate(model_type, supported):
    why = isolation_unsupported(AutoConfig.for_model(model_type))
    assert (why is None) == supported, why


def test_the_default_resolves_per_model_and_says_so():
    llama, bloom = AutoConfig.for_model("llama"), AutoConfig.for_model("bloom")
    mode, note = resolve_packing(None, llama)
    assert mode == "isolated" and "--packing on lets packed examples attend to the earlier ones" in note
    mode, note = resolve_packing(None, bloom)
    assert mode == "on" and "BloomForCausalLM takes no position_ids" in note
    assert resolve_packing(None, llama, pipeline=True)[0] == "on"
    assert resolve_packing("on", llama) == ("on", "") and resolve_packing("off", bloom) == ("off", "")
    with pytest.raises(MemkitError, match=r"^--packing isolated: BloomForCausalLM takes no position_ids; use "
                                          r"--packing on"):
        resolve_packing("isolated", bloom)


def _start_lines(tmp_path, data: str, *argv) -> list[str]:
    from memkit.train.main import add_arguments, prepare, start_lines

    (tmp_path / "tiny").mkdir(exist_ok=True)
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "tiny"), "--init", "random", "--data", data,
                              "--output-dir", str(tmp_path / "out"), "--seq-len", "96", *argv])
    prepared = prepare(args, launched=False)
    assert args.packing == (argv[1] if argv else None)  # the flag as given: `memkit train` relays it unchanged
    packing = {"on": True, "off": False}.get(prepared.packing, prepared.packing)
    return [line for line in start_lines(prepared, world=1, packing=packing, packing_note=prepared.packing_note)
            if line.startswith("packing")]


def test_the_run_start_states_the_default(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"prompt": f"Q{i}: what is {i}+{i}?", "completion": f" {2 * i}"}) + "\n"
                          for i in range(6)))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(6)))
    assert _start_lines(tmp_path, str(qa)) == [
        "packing isolated (the default; --packing on lets packed examples attend to the earlier ones): whole "
        "examples share a sequence while they fit, none split; each attends only to itself (positions restart at "
        "each example: a block-diagonal causal mask)"]
    assert _start_lines(tmp_path, str(qa), "--packing", "on")[0].startswith(
        "packing on: whole examples share a sequence while they fit, none split; each is trained on its own "
        "labels, and attends to the earlier examples in its sequence")
    assert _start_lines(tmp_path, str(text))[0].startswith("packing on (the default for text): documents joined "
                                                          "by EOS")
