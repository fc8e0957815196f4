"""The one model resolver: what `--model` (or plan.json's "model") names, for every command and
the runner. Accepted, in this order:
  1. a path to a config.json, or to a folder holding one (maybe with weights and a tokenizer);
  2. a bundled catalog name or alias (presets/models/catalog.json; case-insensitive, '_' == '-');
  3. a hub id (org/name) whose config.json is already in the local HF cache (its snapshot
     folder then also gives the weights and tokenizer when they were downloaded).
memkit never downloads. No torch or transformers import here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError, did_you_mean

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""File names transformers' from_pretrained loads weights from (transformers/utils/__init__.py:
SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    name: str
    """The model's name: the path as given, the catalog name, or the hub id."""
    config_path: Path
    folder: Path | None
    """Folder with the config and maybe weights and tokenizer; None for a bare config file or a
    catalog entry (configs only)."""
    has_weights: bool
    hub_id: str = ""


def resolve_model(name_or_path: str) -> ModelSource:
    """Where the model `name_or_path` names lives (MemkitError, one line, when nowhere)."""
    from memkit.spec.hf import find_catalog_model, model_catalog

    arg = str(name_or_path).strip()
    if not arg:
        raise MemkitError("--model is empty; pass a catalog name (see `memkit models`), a config.json path "
                          "or a cached hub id such as meta-llama/Llama-3.1-8B")
    path = Path(arg).expanduser()
    entry = find_catalog_model(arg)
    if path.is_file():
        return ModelSource(name=arg, config_path=path, folder=None, has_weights=False)
    if path.is_dir() and (entry is None or (path / "config.json").is_file()):
        if not (path / "config.json").is_file():
            raise MemkitError(f"folder {arg!r} holds no config.json; pass the model folder that has one, "
                              "the config.json itself, or a catalog name (memkit models)")
        return _folder(arg, path)
    if entry is not None:
        return ModelSource(name=entry.name, config_path=entry.config_path, folder=None, has_weights=False,
                           hub_id=entry.hub_id)
    if _looks_like_path(arg):
        raise MemkitError(f"config file {arg!r} does not exist; check the path, or pass a catalog name "
                          "(see `memkit models`)")
    if arg.count("/") == 1:
        cached = _cached_hub_config(arg)
        if cached is not None:
            return _folder(arg, cached.parent, hub_id=arg)
        hub_ids = [e.hub_id for e in model_catalog().values()]
        raise MemkitError(f"{arg!r} is not a catalog model{did_you_mean(arg, hub_ids)} and its config.json is not "
                          f"in the local Hugging Face cache ({hub_cache_dir()}); memkit never downloads: run "
                          f"`hf download {arg} config.json` first, or pass the path to a config.json")
    names = list(model_catalog())
    raise MemkitError(f"unknown model {arg!r}{did_you_mean(arg, names)}; `memkit models` lists the catalog; "
                      "or pass a config.json path or a cached hub id (org/name)")


def with_cached_weights(source: ModelSource) -> ModelSource:
    """`source`, or its hub id's snapshot folder in the local HF cache when that holds weights
    (a catalog name whose model the user downloaded: `hf download meta-llama/Llama-3.1-8B`)."""
    if source.has_weights or not source.hub_id:
        return source
    cached = _cached_hub_config(source.hub_id)
    if cached is None:
        return source
    found = _folder(source.name, cached.parent, hub_id=source.hub_id)
    return found if found.has_weights else source


def _folder(name: str, folder: Path, *, hub_id: str = "") -> ModelSource:
    return ModelSource(name=name, config_path=folder / "config.json", folder=folder,
                       has_weights=any((folder / f).exists() for f in WEIGHT_FILES), hub_id=hub_id)


def _looks_like_path(arg: str) -> bool:
    """A hub id is 'org/name'; anything with a .json suffix, a leading ./~, or more slashes is a path."""
    return arg.endswith(".json") or arg.startswith((".", "/", "~")) or arg.count("/") > 1 or "\\" in arg


def hub_cache_dir() -> str:
    """huggingface_hub's cache folder, read at call time (huggingface_hub/constants.py: HF_HUB_CACHE, HF_HOME)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _cached_hub_config(repo_id: str) -> Path | None:
    """config.json of `repo_id` from the local HF cache (no network; HF_HUB_OFFLINE-safe)."""
    from huggingface_hub import try_to_load_from_cache  # lazy: only hub ids need it

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir())
    except ValueError:  # HFValidationError: not a valid repo id, so not cached either
        return None
    return Path(found) if isinstance(found, str) else None
