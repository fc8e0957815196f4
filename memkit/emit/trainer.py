"""The Hugging Face Trainer path of a plan: every TrainingArguments flag, the model kwargs and the
peft config a user's own Trainer script needs to train the plan that was priced, in one
structured form (`trainer_recipe`). The bundle README prints it; tests/unit/test_trainer_fidelity.py
builds TrainingArguments from the printed flags and checks, knob by knob, that what Trainer would
run is the plan.

What decides what (transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig and
deepspeed_optim_sched): ds_config.json decides ZeRO stage, offload and the 16-bit mode; Trainer
checks per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm, learning_rate,
adam_beta1/2, adam_epsilon, weight_decay and --bf16/--fp16 against it. The optimizer comes from
the config's "optimizer" block when it has one, else Trainer builds `--optim` (8-bit AdamW,
Adafactor: the config then has none). Checkpointing, the attention kernel and LoRA are model
settings no DeepSpeed file carries: --gradient_checkpointing, from_pretrained(attn_implementation=)
and a peft config file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from memkit.emit.deepspeed import ADAM_BETAS, ADAM_EPS
from memkit.plan.plan import (DEFAULT_LR, DEFAULT_SEQ_LEN, HF_ATTN_IMPLEMENTATION, TrainingPlan, trainer_flags,
                              trainer_knobs)
from memkit.spec.hf_config import peft_task_type, task_class

PEFT_CONFIG_FILE = "adapter_config.json"
"""The file name peft's LoraConfig.from_pretrained(folder) reads (peft/utils/constants.py, CONFIG_NAME)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerRecipe:
    """What a Trainer script must be given to run a plan."""

    arguments: dict
    """TrainingArguments field -> value (besides --deepspeed and --output_dir)."""
    model_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of `model_class`.from_pretrained."""
    model_class: str = "AutoModelForCausalLM"
    """The transformers Auto class that builds the model trained (a classifier, a seq2seq LM, ...)."""
    peft_config: dict | None = None
    """peft LoraConfig fields (the bundle writes them to PEFT_CONFIG_FILE); None: full fine-tuning."""
    max_length: int = DEFAULT_SEQ_LEN
    """Tokens per training sequence: tokenize / pack the data to this length (Trainer has no flag)."""
    model_code: tuple[str, ...] = ()
    """Python lines to run on the model after from_pretrained (partial checkpointing, chunked loss)."""
    quantization: dict | None = None
    """transformers.BitsAndBytesConfig kwargs for a 4-bit base (from_pretrained quantization_config=)."""
    loss_path: str = "hf"
    """Who computes the loss the plan was priced with (memkit/plan/techniques.py LOSS_PATHS): 'hf' is
    Trainer's own (compute_loss -> model(**inputs) with labels); another path is the user's
    compute_loss / compute_loss_func, which model_code names in a comment."""

    def flags(self, *, deepspeed_path: str | None = None) -> list[str]:
        """The command-line flags, as HfArgumentParser(TrainingArguments) parses them."""
        out = [f"--deepspeed {deepspeed_path}"] if deepspeed_path else []
        for key, value in self.arguments.items():
            if isinstance(value, dict):
                out.append(f"--{key} '{json.dumps(value)}'")
            else:
                out.append(f"--{key} {value}")
        return out


def trainer_arguments(plan: TrainingPlan, *, lr: float = DEFAULT_LR, weight_decay: float = 0.0) -> dict:
    """The transformers TrainingArguments that agree with `deepspeed_config(plan)` and carry the
    model settings it cannot (checkpointing, optimizer when DeepSpeed does not build it). The
    knobs Trainer takes as they are (batch, accumulation, clipping) and the flags their values set
    (precision, optim, checkpointing, liger) are declared with the knobs in memkit/plan/plan.py
    (`trainer=`: trainer_knobs, trainer_flags); the optimizer's constants are ds_config.json's."""
    args = {
        **trainer_knobs(plan),
        "learning_rate": lr,
        "weight_decay": weight_decay,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        **trainer_flags(plan),
    }
    if plan.checkpointing == "full":
        # Non-reentrant, as memkit's runner does (memkit/train/model.py, apply_plan).
        args["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    return args


def lora_config(plan: TrainingPlan, *, model_class: str | None = None) -> dict | None:
    """peft LoraConfig fields of the plan's adapters (None for full fine-tuning); the runner, the CPU
    measurement and the bundle's adapter_config.json all take them from here. `model_class`: the
    transformers Auto class of the model trained (default: the plan's --task on a causal LM); its
    task_type picks peft's PeftModel class, and SEQ_CLS / TOKEN_CLS train the classifier head too
    (memkit/spec/hf_config.py PEFT_TASK_TYPES, PEFT_SAVED_HEADS)."""
    if not plan.is_lora:
        return None
    model_class = model_class or task_class(plan.task, "AutoModelForCausalLM")
    return {"peft_type": "LORA", "task_type": peft_task_type(model_class), "r": plan.lora_rank,
            "lora_alpha": plan.lora_alpha, "lora_dropout": plan.lora_dropout,
            "target_modules": list(plan.lora_targets), "bias": "none"}


LOSS_PATH_CODE = {
    "ce-16bit": "your compute_loss_func runs F.cross_entropy on the 16-bit logits (no .float())",
    "upcast": "your compute_loss_func upcasts the logits (.float()) and they stay alive until backward ends",
}
"""The one-line reminder of each user loss path in the Trainer recipe (memkit/train/loss_paths.py runs them)."""


def model_code(plan: TrainingPlan) -> tuple[str, ...]:
    """What the model needs besides TrainingArguments: partial checkpointing (Trainer's
    --gradient_checkpointing would checkpoint every block, so it stays off and the first K blocks
    are set here; memkit/plan/techniques.py says why the first) and the chunked loss (a model wrapper
    whose forward returns .loss without logits; memkit/train/chunked_loss.py)."""
    lines = []
    if plan.is_quantized:  # memkit/plan/quantize.py: fp32 rest, frozen base; the plan decides checkpointing
        lines += ["from peft import prepare_model_for_kbit_training",
                  "model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)"]
    if plan.checkpointing not in ("none", "full"):
        what = ("every block, per op: matmul and attention outputs kept" if plan.checkpointing == "selective"
                else f"the first {plan.checkpointing} decoder blocks")
        lines += ["from memkit.train.techniques import apply_checkpointing",
                  f"apply_checkpointing(model, {plan.checkpointing!r})  # {what}, non-reentrant"]
    if plan.loss == "chunked":
        lines += ["from memkit.train.chunked_loss import chunked_causal_lm",
                  "model = chunked_causal_lm(model)  # the loss over chunks; logits are never materialised"]
    if plan.loss_path != "hf" and plan.loss == "standard":  # the user's own loss (memkit/plan/techniques.py)
        lines += [f"# loss priced as --loss-path {plan.loss_path}: {LOSS_PATH_CODE[plan.loss_path]}"]
    if plan.offload_activations == "cpu":  # memkit/plan/backward_techniques.py
        lines += ["from memkit.train.backward_techniques import offload_activations",
                  "model = offload_activations(model)  # saved activations to pinned host RAM in forward"]
    return tuple(lines)


def bnb_config_kwargs(plan: TrainingPlan) -> dict | None:
    """transformers BitsAndBytesConfig kwargs of a 4-bit base (None without one): blocksize 64
    is bitsandbytes' default; the compute dtype follows the precision (memkit/plan/quantize.py).
    BitsAndBytesConfig takes the dtype by name (transformers utils/quantization_config.py)."""
    if not plan.is_quantized:
        return None
    from memkit.plan.quantize import COMPUTE_DTYPE

    return {"load_in_4bit": True, "bnb_4bit_quant_type": plan.quantize_base,
            "bnb_4bit_use_double_quant": plan.double_quant,
            "bnb_4bit_compute_dtype": COMPUTE_DTYPE[plan.precision]}


def trainer_recipe(plan: TrainingPlan, *, lr: float = DEFAULT_LR, weight_decay: float = 0.0,
                   model_class: str | None = None) -> TrainerRecipe:
    """`model_class`: the transformers Auto class of the model (plan.json's model_class; default the
    plan's --task on a causal LM); a classifier's from_pretrained takes num_labels."""
    model_class = model_class or task_class(plan.task, "AutoModelForCausalLM")
    labels = {"num_labels": plan.num_labels} if plan.task in ("seq-cls", "token-cls") else {}
    return TrainerRecipe(arguments=trainer_arguments(plan, lr=lr, weight_decay=weight_decay),
                         model_kwargs={"attn_implementation": HF_ATTN_IMPLEMENTATION[plan.attention], **labels},
                         model_class=model_class,
                         peft_config=lora_config(plan, model_class=model_class), max_length=plan.seq_len,
                         model_code=model_code(plan), quantization=bnb_config_kwargs(plan),
                         loss_path=plan.loss_path)
