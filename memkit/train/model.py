"""The model a run trains: loaded from a local folder with weights, or built from a config
with fresh weights. What `--model` names is resolved by memkit.spec.resolve (the same resolver
every command uses: a folder or config.json, a catalog name or alias, a cached hub id).

Then the plan's model-side knobs: attention kernel, activation checkpointing, LoRA.
Nothing is downloaded.
"""
from __future__ import annotations


from memkit.errors import MemkitError
from memkit.plan.plan import HF_ATTN_IMPLEMENTATION, TrainingPlan
from memkit.spec.resolve import WEIGHT_FILES, ModelSource, resolve_model  # noqa: F401 (the one resolver; main.py uses it)



def load_config(source: ModelSource):
    """The transformers config, read from the local file (no hub access)."""
    from memkit.fileio import read_json_object
    from memkit.spec.hf_config import build_hf_config

    data = read_json_object(source.config_path, what="config file")
    return build_hf_config(
        data, missing_type=f"{source.config_path} has no 'model_type'; is it a transformers config.json?",
        unbuildable="{where}: transformers cannot build model_type {model_type!r} ({reason})",
        where=str(source.config_path))


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


INITS = ("pretrained", "random")
"""--init: the weights `--model` points at, or fresh seeded weights built from its config."""


def choose_init(source: ModelSource, init: str | None) -> tuple[ModelSource, str, str]:
    """(source, init, note) for `--model` and `--init`, before any rank starts.

    A catalog name or hub id without weights refuses to train unless `--init random` says so (a
    fine-tune of fresh weights is never silent); a catalog name whose hub id is in the local HF
    cache with weights loads those. A local config.json / folder without weights trains fresh
    weights with a note. `note` is one line for the console ('' when there is nothing to say)."""
    from memkit.spec.resolve import with_cached_weights

    if init is not None and init not in INITS:
        raise MemkitError(f"--init {init!r} is not one of {', '.join(INITS)}")
    if init != "random" and not source.has_weights:
        source = with_cached_weights(source)
    if init == "random":
        return source, "random", f"--init random: fresh seeded weights from {source.name}'s config"
    if source.has_weights:
        return source, "pretrained", f"pretrained weights from {source.folder}"
    hub = source.hub_id
    if hub:
        raise MemkitError(
            f"--model {source.name} has no weights here (memkit knows its config, and {hub} is not in the "
            f"local HF cache with weights); pass a folder with weights (--model /path/to/{hub.split('/')[-1]}), "
            f"download it (hf download {hub}), or add --init random for a smoke test on fresh weights")
    if init == "pretrained":
        raise MemkitError(f"--init pretrained: {source.name} holds no weights ({', '.join(WEIGHT_FILES[:2])}, ...); "
                          "pass the folder save_pretrained wrote, or --init random")
    return source, "random", (f"{source.name} holds no weights: training fresh seeded weights from its config "
                              "(--init random says so)")


def build_model(source: ModelSource, config, *, attention: str, seed: int, pretrained: bool = True):
    """A causal LM in fp32: the folder's weights when `pretrained` and it has them, else fresh seeded weights.

    Under ZeRO-3 (zero3_init_flag) transformers builds it inside deepspeed.zero.Init, so each
    rank only ever holds its partition (transformers: integrations/deepspeed.py).
    """
    import torch
    # accelerate's set_seed, not transformers': the same seeding (random, numpy, torch and every
    # device's manual_seed_all; accelerate/utils/random.py and transformers/trainer_utils.py,
    # set_seed), but importing transformers.trainer_utils imports peft, which imports bitsandbytes,
    # which torch.compile-registers its ops and so imports torch._inductor: ~2.8 CPU s per rank
    # for plans that use none of them (measured, the tiny Llama of tests/e2e/runner_util.py).
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    if not any(arch.endswith("ForCausalLM") for arch in (config.architectures or ["?ForCausalLM"])):
        raise MemkitError(f"--model {source.name} is a {config.architectures[0]}; the runner trains causal "
                          "language models (…ForCausalLM)")
    set_seed(seed)
    kwargs = {"attn_implementation": HF_ATTN_IMPLEMENTATION[attention], "dtype": torch.float32}
    try:
        if pretrained and source.has_weights:
            model = AutoModelForCausalLM.from_pretrained(str(source.folder), config=config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except ImportError as exc:  # e.g. flash_attention_2 without the flash-attn package
        raise MemkitError(f"attention {attention!r}: {exc}") from None
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # no KV cache while training
    return model


def build_quantized(source: ModelSource, config, plan: TrainingPlan, *, seed: int, device, pretrained: bool = True):
    """build_model's model with its linears in 4 bits on `device`, prepared for k-bit training
    (memkit/train/quantize.py): the folder's checkpoint, or the fresh seeded weights through a
    temporary save."""
    from memkit.train.quantize import load_quantized, quantize_fresh

    if source.has_weights and pretrained:
        return load_quantized(source.folder, plan, device=str(device), config=config)
    return quantize_fresh(build_model(source, config, attention=plan.attention, seed=seed, pretrained=False),
                          plan, device=str(device))


def apply_plan(model, plan: TrainingPlan):
    """Activation checkpointing (all or the first K blocks), the loss head and LoRA as the plan
    says (memkit/train/techniques.py); returns the (maybe wrapped) model."""
    from memkit.train.techniques import apply_checkpointing, apply_loss

    apply_checkpointing(model, plan.checkpointing)
    apply_loss(model, plan)
    if plan.is_lora:
        from peft import LoraConfig, get_peft_model

        available = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in plan.lora_targets if t not in available]
        if missing:
            linears = sorted(n for n in available if n.endswith("proj") or n in ("c_attn", "c_proj", "fc1", "fc2"))
            raise MemkitError(f"LoRA targets {missing} are not modules of this model; try some of {linears}")
        from memkit.emit.trainer import lora_config

        config = LoraConfig(**lora_config(plan))  # the fields the bundle's adapter_config.json holds
        model = get_peft_model(model, config)
    return model


def count_params(model) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned parameters report ds_numel."""
    total = trainable = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", None) or param.numel()
        if type(param).__name__ == "Params4bit" and param.quant_state is not None:  # two elements per byte
            numel = param.quant_state.shape.numel()
        total += numel
        if param.requires_grad:
            trainable += numel
    return total, trainable


def has_batchnorm(model) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())
