"""The runner's side of QLoRA (rules and bytes: memkit/plan/quantize.py): load the base with its linear
weights in 4 bits through transformers' BitsAndBytesConfig, then peft's
prepare_model_for_kbit_training. Used by memkit/train/loop.py and memkit/calibrate/cpu_step.py, and
printed into the bundle's Trainer recipe (memkit/emit/trainer.py bnb_config_kwargs), so the
runner, the CPU measurements and a user's own script load the model the same way.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from memkit.plan.plan import HF_ATTN_IMPLEMENTATION, TrainingPlan
from memkit.plan.quantize import COMPUTE_DTYPE


def bnb_config(plan: TrainingPlan):
    """transformers.BitsAndBytesConfig for the plan (the kwargs the bundle prints)."""
    from transformers import BitsAndBytesConfig

    from memkit.emit.trainer import bnb_config_kwargs

    return BitsAndBytesConfig(**bnb_config_kwargs(plan))


def load_quantized(folder: str | Path, plan: TrainingPlan, *, device: str = "cpu", config=None):
    """from_pretrained(folder) with the 4-bit base on `device`, loaded in the compute dtype (as the
    QLoRA recipe does: the dequantised weights come back in it), prepared for k-bit training
    (use_gradient_checkpointing=False: the plan's checkpointing is applied afterwards)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    kwargs = {"config": config} if config is not None else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=bnb_config(plan), device_map={"": device},
        attn_implementation=HF_ATTN_IMPLEMENTATION[plan.attention], dtype=getattr(torch, COMPUTE_DTYPE[plan.precision]),
        **kwargs)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    keep_training_layout(model)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def keep_training_layout(model) -> int:
    """Keep every 4-bit linear in the layout it trains in, on any CPU. On a CPU with AVX512-BF16,
    bitsandbytes' Linear4bit.forward repacks its weight for CPU inference the first time it runs in
    eval mode without grad (bitsandbytes nn/modules.py, Linear4bit.forward, support_avx512bf16_for_cpu;
    functional.py, _convert_weight_packed_for_cpu): the absmax becomes bf16 in a new shape, and the
    repack itself fails where in_features < the quantisation block (absmax.reshape(out, in // blocksize)
    is [out, 0]) -- a run's eval and save probe on a small model died of it on such a host. The
    runner's eval and probe take the training kernels instead (the same on every CPU, and on GPU
    this path does not exist). Returns how many modules were switched."""
    switched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            switched += 1
    return switched


def quantize_fresh(model, plan: TrainingPlan, *, device: str = "cpu"):
    """A model built from a config (fresh weights) as a 4-bit base: bitsandbytes quantises while
    transformers loads a checkpoint, so the weights go through a temporary save_pretrained."""
    config = model.config
    with tempfile.TemporaryDirectory(prefix="memkit-qlora-") as tmp:
        # Every rank writes and quantises its own copy (transformers 5's save_pretrained leaves
        # the shard writing to rank 0 under torch.distributed); safetensors' save_model drops tied duplicates.
        from safetensors.torch import save_model

        config.save_pretrained(tmp)
        save_model(model, str(Path(tmp) / "model.safetensors"))
        del model
        return load_quantized(tmp, plan, device=device, config=config)


def count_4bit(model) -> int:
    """Elements of the base stored in 4 bits (Params4bit holds two per byte)."""
    return sum(p.quant_state.shape.numel() for p in model.parameters()
               if type(p).__name__ == "Params4bit" and p.quant_state is not None)
