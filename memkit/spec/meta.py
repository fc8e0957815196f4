"""Build a model on the meta device from its config: the reference that hf.py's analytic counts are checked
against (accelerate's `init_empty_weights` idea: no memory, no download). Imports torch/transformers, so it
lives apart from hf.py, whose config work must stay instant.
"""
from __future__ import annotations

from memkit.spec.hf import load_model_spec
from memkit.spec.model import ModelSpec


def build_meta_model(model: str | ModelSpec):
    """The model `from_config` builds on the meta device, with its weight tying as a checkpoint loads it.

    One correction to plain from_config: transformers 5 forces T5Config.tie_word_embeddings=True, yet a
    T5 v1.1 / Flan-T5 checkpoint (config tie_word_embeddings=false) stores its own lm_head.weight, which
    from_pretrained keeps untied (modeling_utils.PreTrainedModel.tie_weights). The spec says untied; so here.
    """
    import torch
    import transformers

    spec = model if isinstance(model, ModelSpec) else load_model_spec(model)
    config = _auto_config(spec.config_path)
    auto = getattr(transformers, spec.auto_class)
    with torch.device("meta"):
        built = auto.from_config(config)
        head = getattr(built, "lm_head", None)
        embed = built.get_input_embeddings()
        if (not spec.tie_word_embeddings and isinstance(head, torch.nn.Linear)
                and head.weight is embed.weight):
            head.weight = torch.nn.Parameter(torch.empty_like(embed.weight))
    return built


def count_params_meta(model: str | ModelSpec) -> int:
    """sum(p.numel()) of the meta-device model, shared (tied) parameters counted once."""
    return sum(p.numel() for p in build_meta_model(model).parameters())


def _auto_config(config_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_path)  # a config.json path works as well as its folder
