"""The model a run trains: loaded from a local folder with weights, or built from a config
(a catalog name, a folder with config.json, or a config.json file) with fresh weights.

Then the plan's model-side knobs: attention kernel, activation checkpointing, LoRA.
Nothing is downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError, did_you_mean
from memkit.plan import TrainingPlan
from memkit.presets_dir import presets_dir

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    name: str
    """What the user passed (--model or plan.json's model)."""
    config_path: Path
    folder: Path | None
    """Folder that holds config (and maybe weights and tokenizer); None for a bare config file."""
    has_weights: bool


def catalog_names() -> list[str]:
    root = presets_dir() / "models"
    return sorted(p.name for p in root.iterdir() if (p / "config.json").exists()) if root.is_dir() else []


def resolve_model(name: str) -> ModelSource:
    """A local folder / config.json path, else a catalog name (presets/models/<name>/config.json)."""
    path = Path(name).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.exists():
            raise MemkitError(f"--model {name}: folder has no config.json; pass an HF model folder, a "
                              "config.json file or a catalog name (memkit models)")
        has_weights = any((path / f).exists() for f in WEIGHT_FILES)
        return ModelSource(name=name, config_path=config, folder=path, has_weights=has_weights)
    if path.is_file():
        return ModelSource(name=name, config_path=path, folder=None, has_weights=False)
    names = catalog_names()
    key = name.lower()
    for catalog_name in names:
        if catalog_name.lower() == key:
            folder = presets_dir() / "models" / catalog_name
            return ModelSource(name=catalog_name, config_path=folder / "config.json", folder=None,
                               has_weights=False)
    raise MemkitError(f"--model {name!r} is neither a local folder/config.json nor a catalog model"
                      f"{did_you_mean(name, names)}; `memkit models` lists the catalog")


def load_config(source: ModelSource):
    """The transformers config, read from the local file (no hub access)."""
    from transformers import AutoConfig

    from memkit.fileio import read_json_object

    data = read_json_object(source.config_path, what="config file")
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise MemkitError(f"{source.config_path} has no 'model_type'; is it a transformers config.json?")
    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5 config validators
    except ImportError:  # older huggingface_hub
        StrictDataclassError = ValueError
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, StrictDataclassError) as exc:
        reason = " ".join(str(exc).split())  # its validator's multi-line text, as one line
        raise MemkitError(f"{source.config_path}: transformers cannot build model_type {model_type!r} "
                          f"({reason})") from None


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def build_model(source: ModelSource, config, *, attention: str, seed: int):
    """A causal LM in fp32: the folder's weights when it has them, else fresh seeded weights.

    Under ZeRO-3 (zero3_init_flag) transformers builds it inside deepspeed.zero.Init, so each
    rank only ever holds its partition (transformers: integrations/deepspeed.py).
    """
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    if not any(arch.endswith("ForCausalLM") for arch in (config.architectures or ["?ForCausalLM"])):
        raise MemkitError(f"--model {source.name} is a {config.architectures[0]}; the runner trains causal "
                          "language models (…ForCausalLM)")
    set_seed(seed)
    kwargs = {"attn_implementation": ATTN_IMPLEMENTATION[attention], "dtype": torch.float32}
    try:
        if source.has_weights:
            model = AutoModelForCausalLM.from_pretrained(str(source.folder), config=config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except ImportError as exc:  # e.g. flash_attention_2 without the flash-attn package
        raise MemkitError(f"attention {attention!r}: {exc}") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # no KV cache while training
    return model


def apply_plan(model, plan: TrainingPlan):
    """Activation checkpointing and LoRA as the plan says; returns the (maybe wrapped) model."""
    if plan.checkpointing == "full":
        # Non-reentrant checkpointing: works with frozen inputs (LoRA) and ZeRO-3
        # (torch.utils.checkpoint docs recommend use_reentrant=False).
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if plan.is_lora:
        from peft import LoraConfig, get_peft_model

        available = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in plan.lora_targets if t not in available]
        if missing:
            linears = sorted(n for n in available if n.endswith("proj") or n in ("c_attn", "c_proj", "fc1", "fc2"))
            raise MemkitError(f"LoRA targets {missing} are not modules of this model; try some of {linears}")
        config = LoraConfig(r=plan.lora_rank, lora_alpha=plan.lora_alpha,
                            lora_dropout=getattr(plan, "lora_dropout", 0.0),
                            target_modules=list(plan.lora_targets), task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    return model


def count_params(model) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned parameters report ds_numel."""
    total = trainable = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", None) or param.numel()
        total += numel
        if param.requires_grad:
            trainable += numel
    return total, trainable


def has_batchnorm(model) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())
