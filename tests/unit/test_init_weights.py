"""Where the runner's weights come from (#15): a catalog name without weights refuses to train
unless --init random says so; a local folder or a hub id in the local HF cache loads its weights;
a catalog name whose hub id the user downloaded loads the downloaded weights."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from memkit.errors import MemkitError

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300,
        "max_position_embeddings": 64, "tie_word_embeddings": False}


def _save_tiny(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY)
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(folder)
    return model


def _cache_repo(cache, repo_id: str):
    """A snapshot in the huggingface_hub cache layout (huggingface_hub/file_download.py:
    models--{org}--{name}/refs/main -> commit, snapshots/{commit}/files)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return _save_tiny(repo / "snapshots" / commit)


def _prepare(tmp_path, *argv):
    from memkit.train.main import add_arguments, prepare

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data", "synthetic:8", "--output-dir", str(tmp_path / "out"), "--seq-len", "16",
                              *argv])
    return prepare(args, launched=False)


def test_catalog_name_without_weights_refuses_in_one_line(tmp_path, capfd, monkeypatch):
    from memkit.train.main import run_finetune

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code = run_finetune(["--model", "llama-3.2-1b", "--data", "synthetic:8", "--output-dir", str(tmp_path / "out"),
                 "--seq-len", "16", "--max-steps", "1"])
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith("finetune: error: --model llama-3.2-1b has no weights here")
    assert "--model /path/to/Llama-3.2-1B" in lines[0] and "--init random" in lines[0]
    assert not (tmp_path / "out").exists()


def test_init_random_says_so_for_a_catalog_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    prepared = _prepare(tmp_path, "--model", "llama-3.2-1b", "--init", "random")
    assert prepared.run.init == "random" and prepared.model_config.vocab_size == 128256
    assert prepared.init_note == "--init random: fresh seeded weights from llama-3.2-1b's config"


def test_config_only_folder_trains_fresh_weights_with_a_note_and_refuses_init_pretrained(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(TINY))
    prepared = _prepare(tmp_path, "--model", str(tmp_path / "cfg"))
    assert prepared.run.init == "random" and "holds no weights" in prepared.init_note
    with pytest.raises(MemkitError, match=r"^--init pretrained: .*cfg holds no weights"):
        _prepare(tmp_path, "--model", str(tmp_path / "cfg"), "--init", "pretrained")


def _first_weight(prepared):
    from memkit.train.model import build_model

    model = build_model(prepared.source, prepared.model_config, attention="sdpa", seed=0,
                        pretrained=prepared.run.init == "pretrained")
    return model.model.layers[0].self_attn.q_proj.weight


def test_local_folder_loads_its_weights_and_init_random_ignores_them(tmp_path):
    saved = _save_tiny(tmp_path / "tiny")
    prepared = _prepare(tmp_path, "--model", str(tmp_path / "tiny"))
    assert prepared.run.init == "pretrained" and prepared.init_note == f"pretrained weights from {tmp_path / 'tiny'}"
    torch.testing.assert_close(_first_weight(prepared), saved.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)
    fresh = _first_weight(_prepare(tmp_path, "--model", str(tmp_path / "tiny"), "--init", "random"))
    assert not torch.equal(fresh, saved.model.layers[0].self_attn.q_proj.weight)


def test_cached_hub_id_loads_the_downloaded_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    saved = _cache_repo(tmp_path / "hub", "someorg/tiny-chat")
    prepared = _prepare(tmp_path, "--model", "someorg/tiny-chat")
    assert prepared.run.init == "pretrained" and prepared.source.folder.parent.name == "snapshots"
    torch.testing.assert_close(_first_weight(prepared), saved.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)


def test_catalog_name_whose_hub_id_is_downloaded_loads_those_weights(tmp_path, monkeypatch):
    # The catalog entry llama-3.2-1b is meta-llama/Llama-3.2-1B; a (tiny) snapshot of that repo in the cache
    # is what the runner trains, config and weights both.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    saved = _cache_repo(tmp_path / "hub", "meta-llama/Llama-3.2-1B")
    for name in ("llama-3.2-1b", "meta-llama/Llama-3.2-1B"):
        prepared = _prepare(tmp_path, "--model", name)
        assert prepared.run.init == "pretrained" and prepared.model_config.vocab_size == 300
        torch.testing.assert_close(_first_weight(prepared), saved.model.layers[0].self_attn.q_proj.weight,
                                   rtol=0, atol=0)
