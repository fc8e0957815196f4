"""TrainingPlan: every knob of one way to train, per GPU. The estimator prices it, the planner
searches over it, the emitters write it, the runner honours it.

Knobs only, no behaviour beyond validation. Defaults are DeepSpeed's own defaults
(deepspeed/runtime/zero/config.py), so a plan built from a user's default DeepSpeed config
is estimated as DeepSpeed would run it; the planner sets them explicitly.
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from itertools import repeat
from operator import attrgetter
from typing import Literal, get_args, get_type_hints

from memkit.errors import MemkitError
from memkit.plan.parallel import split_knob_error
from memkit.plan.backward_techniques import (ACTIVATION_OFFLOADS, OPTIMIZER_IN_BACKWARD_FLAG, activation_offload_error,
                                        optimizer_in_backward_error)
from memkit.plan.techniques import (CHECKPOINTING, LOSS_PATHS, LOSSES, checkpointing_error,  # noqa: F401
                               checkpointing_type, loss_knob_error, loss_path_error, partial_blocks_error)
from memkit.plan.quantize import QUANTIZE_BASES, quantize_knob_error  # noqa: F401

Precision = Literal["fp32", "fp16", "bf16", "bf16-pure"]
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd"]
EIGHT_BIT_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit")
"""The bitsandbytes optimizers (bnb.optim.AdamW8bit, PagedAdamW8bit): 8-bit states, a per-tensor step."""
PAGED_OPTIMIZERS = ("paged-adamw-8bit",)
"""The bitsandbytes paged optimizers (is_paged=True): states of large tensors in CUDA managed memory
(estimate/states.py BNB_PAGED_MIN_NUMEL)."""
Offload = Literal["none", "cpu", "nvme"]
Attention = Literal["eager", "sdpa", "flash"]
Engine = Literal["deepspeed", "torch"]
ZeroStage = Literal[0, 1, 2, 3]
Loss = Literal[LOSSES]
LossPath = Literal[LOSS_PATHS]
QuantizeBase = Literal[QUANTIZE_BASES]
ActivationOffload = Literal[ACTIVATION_OFFLOADS]
TpEngine = Literal["autotp", "tp_plan"]
Task = Literal["causal-lm", "seq-cls", "token-cls"]
PpEngine = Literal["torch", "deepspeed"]
PpSchedule = Literal["1f1b", "gpipe"]
AllocConf = Literal["expandable", "default"]
ALLOC_CONF_ENV = {"expandable": "expandable_segments:True", "default": ""}
"""The PYTORCH_CUDA_ALLOC_CONF each TrainingPlan.alloc_conf stands for (c10/cuda/CUDAAllocatorConfig.cpp
parses it when the allocator initialises; '' = unset, torch's default segments). memkit's runner sets
the expandable one unless the user set theirs (memkit/train/main.py), bundles and launch scripts export it."""


def alloc_conf_of(value: str | None) -> str:
    """The plan setting a PYTORCH_CUDA_ALLOC_CONF value runs: 'expandable' when it turns
    expandable_segments on (c10/cuda/CUDAAllocatorConfig.cpp parseExpandableSegments: "True"), else
    'default'; None (unset) is 'default'."""
    if value is None:
        return "default"
    return "expandable" if "expandable_segments:true" in value.replace(" ", "").lower() else "default"
PRECISIONS = get_args(Precision)
OPTIMIZERS = get_args(Optimizer)
OFFLOADS = get_args(Offload)
ATTENTIONS = get_args(Attention)
ZERO_STAGES = get_args(ZeroStage)
HF_ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
"""transformers' attn_implementation for each plan attention (transformers modeling_utils.py,
_check_and_adjust_attn_implementation); the runner and the bundle's Trainer model kwargs use it."""
ENGINES = get_args(Engine)
TP_ENGINES = get_args(TpEngine)
PP_ENGINES = get_args(PpEngine)
PP_SCHEDULES = get_args(PpSchedule)
TASKS = get_args(Task)
"""What the model is trained to do: its own language-model head (causal LM, or the masked / seq2seq LM
of an encoder / encoder-decoder), or a classification head of num_labels outputs on the whole
sequence (AutoModelForSequenceClassification) or on every token (AutoModelForTokenClassification)."""
TASK_FIELDS = ("task", "num_labels", "target_len")
OMITTED_AT_DEFAULT = TASK_FIELDS + ("loss_path",)
"""to_dict leaves these out at their declared defaults, so plan.json files (and the presets) written
before they existed read, and are written, the same."""
MAX_MICRO_BATCH = 65_536
"""Largest micro-batch (sequences per GPU per step) memkit accepts or searches: 64k sequences of
even 128 tokens is 8M tokens per GPU per step, beyond any device's memory for a real model."""
MAX_SEQ_LEN = 2**24
"""16M tokens: longer than any released model's context window."""
DEFAULT_SEQ_LEN = 2048
HF_OPTIM = {"adamw": "adamw_torch", "adamw-8bit": "adamw_bnb_8bit", "paged-adamw-8bit": "paged_adamw_8bit",
            "adafactor": "adafactor", "sgd": "sgd"}
"""TrainingArguments.optim for each plan optimizer (transformers training_args.py, OptimizerNames).
adamw_bnb_8bit is bitsandbytes' 8-bit AdamW and `adafactor` is transformers' Adafactor with
scale_parameter=False, relative_step=False (transformers trainer_optimizer.py): the optimizers
memkit prices and its runner builds (memkit/train/loop.py). Under DeepSpeed, adamw and sgd are
built from ds_config.json's optimizer block and --optim is not used."""
DEFAULT_LR = 2e-5
"""Peak LR for full fine-tuning with AdamW, the one default (plan.json's trainer_arguments,
ds_config.json, the Trainer recipe, the runner): Alpaca's full fine-tune of LLaMA 7B used 2e-5
(Taori et al. 2023, tatsu-lab/stanford_alpaca README, "Fine-tuning"). Not a plan knob: it sets no memory."""

# ---- one declaration per knob ------------------------------------------------------------------
# Each TrainingPlan field is declared once, with `knob(...)`: its default, its type (Literal[...]
# for choices: the flags' choices and validate()'s choice check read it), its range (the flags'
# range check, memkit.plan.limits.LIMITS, and plan_schema read it) and, per command, its help text.
# Commands (`cli` keys): "estimate" (a value, the plan default when not given), "pin" (suggest:
# None = the planner chooses), "workload" (suggest: a value the planner does not search),
# "run" (the runner's overrides of plan.json: None = not given), "launch" (the split harness).
# `add_knob_flags` builds the
# argparse flags and `knob_values` reads them back; `Request` (planner/space.py) derives its pins
# from the same fields.

COMMANDS = ("estimate", "pin", "workload", "run", "launch")
"""launch: launch/parallel_train.py (memkit/calibrate/parallel_step.py), the split-training harness
(None = not given; its own subsets of the choices). A `cli` value is the help text (None: none) or a dict with "help" and, where the
command differs, "choices" (None: a plain typed value) and "flag"; a "pin" spec may say
"lists_after" (pin_flags' order)."""


def knob(default, *, cli: dict | None = None, range: tuple | None = None, flag: str | None = None,  # noqa: A002
         parse=None, negated: bool = False, choice_error: str | None = None, estimate_default=MISSING,
         trainer: str | dict | None = None):
    """A TrainingPlan field with its flag metadata. cli: command -> help text (None: no help);
    range: (lowest, highest, what it is); flag: the option name (default --name-with-dashes);
    parse: argparse type; negated: a True-default bool whose flag turns it off (--no-...);
    choice_error: the message for a value outside the Literal's choices ({value});
    estimate_default: `estimate`'s default when it is not the plan's (None: chosen later);
    trainer: the transformers TrainingArguments field that takes the value as it is (trainer_knobs), or
    {field: rule} for the fields derived from it (trainer_flags): a tuple rule is the values that set
    the field True (written always), a dict rule what each value it names writes (written for those only)."""
    meta = {"cli": dict(cli or {}), "range": range, "flag": flag, "parse": parse, "negated": negated,
            "choice_error": choice_error, "estimate_default": estimate_default, "trainer": trainer}
    return field(default=default, metadata=meta)


_OIB_HELP = ("step each parameter in its gradient hook (one gradient alive); needs engine torch on one "
             "GPU, --grad-accum 1, no fp16 and no clipping (estimate/suggest set it to 0; the runner "
             "wants --gradient-clipping 0)")
_OFFLOAD_ACT_HELP = "cpu: saved activations to pinned host RAM in forward, back in backward (PCIe time)"
_DQ_HELP = "with --quantize-base: keep the block scales in fp32 (default: double quantisation)"
_CKPT_HELP = "none, full, or K: the first K decoder blocks (memkit/plan/techniques.py)"
_LOSS_PATH_HELP = ("who computes the loss on the logits: hf (default: the model with labels, HF Trainer's path "
                   "for your transformers version), ce-16bit (your own cross_entropy on 16-bit logits), upcast "
                   "(your code or model upcasts the logits to fp32 and the loop holds them through backward); "
                   "memkit's chunked loss and liger are --loss chunked / --loss fused")
_ALLOC_HELP = ("the CUDA allocator the run uses: expandable (default: PYTORCH_CUDA_ALLOC_CONF="
               "expandable_segments:True, which memkit's runner sets and its bundles export) or default "
               "(torch's default segments: your own script without that setting)")
_TASK_HELP = ("causal-lm (default: the model's own LM head, masked/seq2seq LM for encoders/encoder-decoders), "
              "seq-cls or token-cls (a classification head of --num-labels)")
_TARGET_LEN_HELP = "encoder-decoders (T5, BART): decoder tokens per sequence (default 0: --seq-len)"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingPlan:
    precision: Precision = knob("bf16", cli={"estimate": None, "pin": None, "run": None,
                                             "launch": {"choices": ("fp32", "bf16", "bf16-pure")}},
                                trainer={"bf16": ("bf16", "bf16-pure"), "fp16": ("fp16",)})
    """fp32; fp16/bf16 = mixed precision with fp32 master weights; bf16-pure = everything in bf16."""
    optimizer: Optimizer = knob("adamw", cli={
        "estimate": None, "run": None,
        "pin": "default: AdamW; 8-bit AdamW / Adafactor / pure bf16 only if nothing else fits"},
                                 trainer={"optim": HF_OPTIM})
    zero_stage: ZeroStage = knob(0, flag="--zero", cli={"estimate": None, "pin": None,
                                                        "launch": {"flag": "--zero-stage", "choices": None}},
                                 choice_error="--zero {value} is not a ZeRO stage; use 0, 1, 2 or 3")
    """ZeRO stage 0-3 (Rajbhandari et al. 2020, Sec. 5). With engine='torch', 3 means FSDP full shard."""
    offload_optimizer: Offload = knob("none", cli={"estimate": None, "pin": None})
    offload_params: Offload = knob("none", cli={"estimate": None, "pin": None})
    checkpointing: str = knob("none", parse=checkpointing_type, cli={
        "estimate": _CKPT_HELP, "run": "none, full, or K (the first K blocks)",
        "launch": {"choices": ("none", "full")},
        "pin": "none, full, or K (the first K blocks); default: the planner picks the smallest K that fits"},
                               trainer={"gradient_checkpointing": ("full",)})
    """'full': HF activation_checkpointing_enable(), one checkpoint per block; 'K' (digits):
    the first K blocks only (memkit/plan/techniques.py says which and why)."""
    loss: Loss = knob("standard", cli={
        "estimate": "standard (full fp32 logits), chunked (memkit's chunked cross-entropy), fused (liger-kernel, "
                    "CUDA only)",
        "pin": "default: standard, or chunked when the logits keep a plan from fitting", "run": None},
                     # Trainer applies liger-kernel's patches, fused linear cross-entropy included
                     # (transformers training_args.py use_liger_kernel; liger_kernel.transformers).
                     trainer={"use_liger_kernel": {"fused": True}})
    """'standard': HF's full fp32 logits; 'chunked': memkit's chunked cross-entropy; 'fused':
    liger-kernel's fused linear cross-entropy (CUDA only). memkit/plan/techniques.py."""
    loss_path: LossPath = knob("hf", cli={"estimate": _LOSS_PATH_HELP, "workload": _LOSS_PATH_HELP})
    """Who computes the loss on the standard loss's logits (memkit/plan/techniques.py LOSS_PATHS):
    'hf' (the model with labels, per transformers version), 'ce-16bit', 'upcast'."""
    offload_activations: ActivationOffload = knob("none", cli={
        "estimate": _OFFLOAD_ACT_HELP, "pin": _OFFLOAD_ACT_HELP, "run": _OFFLOAD_ACT_HELP})
    """'cpu': every saved activation to host RAM in forward, back in backward (memkit/plan/backward_techniques.py)."""
    optimizer_in_backward: bool = knob(False, flag=OPTIMIZER_IN_BACKWARD_FLAG, cli={
        "estimate": _OIB_HELP, "pin": _OIB_HELP, "run": _OIB_HELP})
    """Each parameter steps in its post-accumulate-grad hook; one gradient alive at a time
    (memkit/plan/backward_techniques.py states what it cannot run with)."""
    alloc_conf: AllocConf = knob("expandable", cli={"estimate": _ALLOC_HELP, "workload": _ALLOC_HELP, "run": _ALLOC_HELP})
    """The CUDA caching allocator the run uses (ALLOC_CONF_ENV): 'expandable' (memkit's runner, bundles and
    launch scripts set expandable_segments:True) or 'default' (torch's segments: a run that sets nothing).
    How the estimate prices it: memkit/estimate/memory.py EXPANDABLE_REPLAY_IN_ESTIMATES."""
    attention: Attention = knob("sdpa", cli={"estimate": None, "workload": "attention kernel (default sdpa)",
                                             "run": None, "launch": {"choices": ("eager", "sdpa")}})
    micro_batch_size: int = knob(1, range=(1, MAX_MICRO_BATCH, "sequences per GPU per step"),
                                 cli={"estimate": None, "run": None, "launch": None},
                                 trainer="per_device_train_batch_size")
    grad_accum: int = knob(1, range=(1, 2**20, "micro-batches per optimizer step"),
                           cli={"estimate": None, "run": None, "launch": None}, trainer="gradient_accumulation_steps")
    seq_len: int = knob(DEFAULT_SEQ_LEN, range=(1, MAX_SEQ_LEN, "tokens per sequence"), cli={
        "estimate": None, "workload": f"tokens per sequence (default {DEFAULT_SEQ_LEN})", "run": None, "launch": None})
    task: Task = knob("causal-lm", cli={
        "estimate": _TASK_HELP, "workload": _TASK_HELP})
    """One of TASKS; the head (and its logits) priced (estimate/activations.py head_logits)."""
    num_labels: int = knob(2, range=(1, 2**20, "classification labels"), cli={
        "estimate": "outputs of the seq-cls / token-cls head (default 2)",
        "workload": "outputs of the seq-cls / token-cls head (default 2)"})
    """Outputs of a seq-cls / token-cls head (transformers PretrainedConfig.num_labels, default 2)."""
    target_len: int = knob(0, range=(0, MAX_SEQ_LEN, "decoder tokens per sequence (0 = --seq-len)"), cli={
        "estimate": _TARGET_LEN_HELP, "workload": _TARGET_LEN_HELP})
    """Encoder-decoders (T5, BART): decoder tokens per sequence; 0 = seq_len (the encoder's)."""
    dp: int = knob(1, range=(1, 1024 * 100_000, "data-parallel degree"),
                   cli={"launch": "default: world size / (tp*pp)"})
    """Data-parallel degree; dp * tp * pp must equal the number of GPUs."""
    tp: int = knob(1, range=(1, 1024, "tensor-parallel degree"), cli={
        "estimate": None, "launch": None,
        "pin": {"text": True,  # a degree or 'auto': cli/suggest.py parse_degree reads it
                "help": "tensor-parallel degree (DeepSpeed AutoTP), or 'auto' (default): split only when nothing "
                        "fits otherwise or the step-time model prices the split faster by more than its uncertainty"}})
    pp: int = knob(1, range=(1, 1024, "pipeline-parallel degree"), cli={
        "estimate": None, "launch": None,
        "pin": {"text": True, "help": "pipeline-parallel degree (torch.distributed.pipelining, 1F1B), or 'auto' (as --tp)"}})
    tp_engine: TpEngine = knob("autotp")
    """How TP runs: DeepSpeed AutoTP ('autotp') or transformers tp_plan/DTensor ('tp_plan')."""
    sequence_parallel: bool = knob(False)
    """With tp > 1: shard the hidden-sized activations (norms, residuals, dropout) and the loss
    over the TP ranks too (Korthikanti et al. 2022, Sec. 4.2.2; torchtitan's TP + loss parallel).
    DeepSpeed AutoTP does not do this; torch tp_plan/DTensor plans can."""
    pp_engine: PpEngine = knob("torch")
    """How PP runs: torch.distributed.pipelining ('torch') or DeepSpeed PipelineModule ('deepspeed')."""
    pp_schedule: PpSchedule = knob("1f1b", cli={"launch": None})
    lora_rank: int = knob(0, range=(0, 65_536, "LoRA rank (0 = full fine-tuning)"), cli={
        "estimate": None, "workload": "fine-tune LoRA adapters of this rank (0 = full)", "run": None})
    """0 = full fine-tuning."""
    lora_targets: tuple[str, ...] = knob(("q_proj", "v_proj"), cli={
        "estimate": "comma-separated module names (default q_proj,v_proj or the model's equivalents)",
        "workload": "comma-separated module names (default q/v projections)",
        "run": "comma-separated module names, e.g. q_proj,v_proj"})
    lora_alpha: int = knob(16, range=(1, 2**20, "LoRA alpha"), cli={
        "estimate": "LoRA scaling numerator: adapters scale by alpha/rank (peft LoraConfig.lora_alpha, default 16); "
                    "no memory effect",
        "workload": "LoRA alpha (peft LoraConfig.lora_alpha, default 16); recorded in plan.json and "
                    "adapter_config.json",
        "run": None})
    """peft LoraConfig.lora_alpha: the adapter output is scaled by alpha / rank
    (peft/tuners/lora/layer.py, LoraLayer.update_layer: scaling = lora_alpha / r). No memory term."""
    lora_dropout: float = knob(0.05, range=(0.0, 0.99, "dropout probability"), cli={
        "estimate": "dropout on the LoRA input (peft LoraConfig.lora_dropout, default 0.05); > 0 saves a mask "
                    "and a dropped copy of each adapted input for backward, 0 saves neither",
        "workload": "dropout on the LoRA input (peft LoraConfig.lora_dropout, default 0.05; priced: > 0 saves a "
                    "mask and a copy per adapted linear)",
        "run": None})
    """peft LoraConfig.lora_dropout. peft/tuners/lora/layer.py, Linear.forward: `result + lora_B(
    lora_A(dropout(x))) * scaling`; with p > 0, `dropout` is nn.Dropout (LoraLayer.update_layer,
    else nn.Identity), which saves its mask and its output (lora_A's input) for backward. The
    estimate prices them only when p > 0 (estimate/activations.py, _BlockReplay.proj ->
    Tape.lora_linear(dropout=...))."""
    quantize_base: QuantizeBase = knob("none", cli={
        "estimate": "none, nf4 or fp4: a frozen 4-bit base under the LoRA adapters (QLoRA, bitsandbytes; needs "
                    "--lora-rank; memkit/plan/quantize.py)",
        "pin": {"lists_after": "loss",
                "help": "with --lora-rank: nf4/fp4 pins a 4-bit base (QLoRA), none refuses it; default: a 16-bit base "
                        "(with --allow qlora: nf4 when every 16-bit-base LoRA plan that fits offloads and QLoRA is faster)"},
        "run": "nf4/fp4: load the base in 4 bits (bitsandbytes) under the LoRA adapters (QLoRA)"})
    """'nf4' / 'fp4': the frozen base's linear weights in 4 bits (bitsandbytes), LoRA on top
    (QLoRA); compute dtype from the precision. memkit/plan/quantize.py states the rules."""
    double_quant: bool = knob(True, flag="--no-double-quant", negated=True, cli={
        "estimate": _DQ_HELP, "pin": "with a 4-bit base: keep the block scales in fp32 (default: double quantisation)",
        "run": "with a 4-bit base: fp32 block scales"})
    """With a 4-bit base: quantise the block scales too (QLoRA Sec. 3; bnb_4bit_use_double_quant)."""
    engine: Engine = knob("deepspeed", estimate_default=None, cli={
        "estimate": "deepspeed (default; torch with --quantize-base) or torch (plain PyTorch AMP/DDP; zero 3 = FSDP)"})
    """'deepspeed' (ZeRO via DeepSpeed) or 'torch' (plain PyTorch/AMP, DDP, FSDP)."""
    fsdp_use_orig_params: bool = knob(False)
    """torch FSDP1 `use_orig_params` (its default: False; Lightning Fabric's FSDPStrategy sets True
    with torch >= 2.0). True lets a wrapped unit mix frozen and trainable parameters, and the
    unit's gradient then covers all of it (estimate/states.py)."""
    # DeepSpeed ZeRO buffers, in elements (deepspeed/runtime/zero/config.py defaults).
    reduce_bucket_size: int = knob(500_000_000)
    allgather_bucket_size: int = knob(500_000_000)
    overlap_comm: bool = knob(False)
    contiguous_gradients: bool = knob(True)
    stage3_prefetch_bucket_size: int = knob(50_000_000)
    stage3_max_live_parameters: int = knob(1_000_000_000)
    stage3_max_reuse_distance: int = knob(1_000_000_000)
    stage3_param_persistence_threshold: int = knob(100_000)
    gradient_clipping: float = knob(1.0, range=(0.0, 1e6, "max gradient norm (0 = off)"),
                                    cli={"run": "max global grad norm (0 = off)", "launch": None}, trainer="max_grad_norm")

    # ---- derived ----
    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        """micro x accum x data-parallel ranks (sequences per optimizer step)."""
        return self.micro_batch_size * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def is_quantized(self) -> bool:
        return self.quantize_base != "none"

    @property
    def is_mixed(self) -> bool:
        return self.precision in ("fp16", "bf16")

    def validate(self, *, num_gpus: int | None = None, num_blocks: int | None = None) -> "TrainingPlan":
        """Raise MemkitError for any knob out of range or contradictory; return self. With the
        hardware's GPU count, dp x tp x pp must equal it; with the model's decoder blocks, partial
        checkpointing K must be below it (memkit/plan/techniques.py)."""
        declared, read, tests = _declared()  # each knob's declared choices and range (knob(...) above)
        for f, valid, value in zip(declared, tests, read(self)):
            if not valid(value):
                _check_declared(f, value)
        for error in (checkpointing_error(self.checkpointing),
                      loss_knob_error(self.loss, tp=self.tp, pp=self.pp),
                      loss_path_error(self.loss_path, task=self.task)):
            if error:
                raise MemkitError(error)
        if self.checkpointing not in CHECKPOINTING and self.pp > 1:
            raise MemkitError(f"--checkpointing {self.checkpointing} with --pp {self.pp}: partial "
                              "checkpointing is priced for unsplit models; use none or full with --pp")
        task_error = task_knob_error(self)
        if task_error:
            raise MemkitError(task_error)
        quantize_error = quantize_knob_error(self.quantize_base, lora_rank=self.lora_rank, precision=self.precision,
                                             engine=self.engine, zero_stage=self.zero_stage, tp=self.tp, pp=self.pp)
        if quantize_error:
            raise MemkitError(quantize_error)
        if bf16_pure_needs_zero(self):
            raise MemkitError(BF16_PURE_ZERO_ERROR)
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise MemkitError(
                f"--offload-optimizer {self.offload_optimizer} needs ZeRO; use --zero 1, 2 or 3"
                " (DeepSpeed offloads only partitioned optimizer states)")
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            raise MemkitError(
                f"--offload-optimizer nvme with --zero {self.zero_stage}: DeepSpeed offloads the "
                "optimizer to NVMe only under ZeRO-3; use --zero 3 or --offload-optimizer cpu")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise MemkitError(
                f"--offload-params {self.offload_params} with --zero {self.zero_stage}: parameter "
                "offload exists only in ZeRO-3; use --zero 3")
        if self.offload_params != "none" and self.engine != "deepspeed":
            raise MemkitError("parameter offload is a DeepSpeed feature; use engine deepspeed")
        if self.optimizer in (*EIGHT_BIT_OPTIMIZERS, "adafactor") and self.offload_optimizer != "none":
            raise MemkitError(
                f"--optimizer {self.optimizer} cannot be offloaded: DeepSpeed's CPU optimizers are "
                "Adam/AdamW/Adagrad/Lion; use --optimizer adamw or --offload-optimizer none")
        for error in (activation_offload_error(self.offload_activations, pp=self.pp, tp=self.tp),
                      optimizer_in_backward_error(self)):
            if error:
                raise MemkitError(error)
        split_error = split_knob_error(self)  # memkit/plan/parallel.py states the split rules
        if split_error:
            raise MemkitError(split_error)
        if num_gpus is not None and self.num_gpus != num_gpus:
            raise MemkitError(f"dp {self.dp} x tp {self.tp} x pp {self.pp} = {self.num_gpus} GPUs, but the "
                              f"hardware has {num_gpus}; make dp x tp x pp equal the GPU count")
        blocks_error = partial_blocks_error(self.checkpointing, num_blocks) if num_blocks else None
        if blocks_error:
            raise MemkitError(blocks_error)
        return self

    def with_(self, **changes) -> "TrainingPlan":
        """`dataclasses.replace(self, **changes)` in a fraction of its time (the planner derives
        tens of thousands of plans per search): TrainingPlan has no __post_init__ and no init=False
        field, so copying the fields is all replace does. The copy reads every field at once
        (_GET_FIELDS) and stores each through its slot (_SET_SLOT), in C loops."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown or type(self) is not TrainingPlan:  # replace's own error, or a subclass's fields
            return replace(self, **changes)
        values = list(_GET_FIELDS(self))
        for name, value in changes.items():
            values[_FIELD_INDEX[name]] = value
        new = object.__new__(TrainingPlan)
        deque(map(_SET_SLOT, _SLOTS, repeat(new), values), maxlen=0)
        return new

    def to_dict(self) -> dict:
        defaults = {f.name: f.default for f in fields(self) if f.name in OMITTED_AT_DEFAULT}
        out = {k: v for k, v in asdict(self).items() if k not in defaults or defaults[k] != v}
        out["lora_targets"] = list(self.lora_targets)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingPlan":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MemkitError(f"plan has unknown keys {unknown}; is it from a newer memkit?")
        data = dict(data)
        if "lora_targets" in data:
            data["lora_targets"] = tuple(data["lora_targets"])
        return cls(**data)


_FIELD_ORDER = tuple(f.name for f in fields(TrainingPlan))
_FIELD_NAMES = frozenset(_FIELD_ORDER)
_FIELD_INDEX = {name: i for i, name in enumerate(_FIELD_ORDER)}
_GET_FIELDS = attrgetter(*_FIELD_ORDER)
"""Every field's value, as a tuple in _FIELD_ORDER (TrainingPlan.with_)."""
_SLOTS = tuple(TrainingPlan.__dict__[name] for name in _FIELD_ORDER)
"""Each field's slot (member descriptor), in _FIELD_ORDER."""
_SET_SLOT = type(_SLOTS[0]).__set__
"""_SET_SLOT(slot, plan, value) stores a field: what object.__setattr__ -- how a frozen dataclass's
own __init__ sets its fields -- ends in for a slot, without the attribute lookup."""


def bf16_pure_needs_zero(plan) -> bool:
    """DeepSpeed keeps bf16 master weights and gradients (its bf16 block's
    bf16_master_weights_and_grads, deepspeed/runtime/precision_config.py, which memkit/emit/deepspeed.py
    writes) only under ZeRO 1-3: bf16-pure under DeepSpeed needs ZeRO 1-3; plain PyTorch keeps bf16
    weights itself. The one statement of the rule (plan validation; the planner skips such structures)."""
    return plan.precision == "bf16-pure" and plan.engine == "deepspeed" and plan.zero_stage == 0


BF16_PURE_ZERO_ERROR = ("--precision bf16-pure with --zero 0: bf16-pure under DeepSpeed needs ZeRO 1-3 (DeepSpeed "
                        "keeps bf16 master weights only there: bf16_master_weights_and_grads); use --zero 1 or higher")

_HINTS: dict = {}


def knob_choices(f) -> tuple | None:
    """The choices a knob's Literal type declares, or None."""
    if not _HINTS:
        _HINTS.update(get_type_hints(TrainingPlan))
    hint = _HINTS[f.name]
    return get_args(hint) if getattr(hint, "__origin__", None) is Literal else None


def knob_kind(f) -> str:
    """The Python type name of a knob's values: 'str', 'int', 'float', 'bool' or 'tuple'."""
    choices = knob_choices(f)
    if choices is not None:
        return type(choices[0]).__name__
    return "tuple" if str(f.type).startswith("tuple") else str(f.type)


def flag_name(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


@functools.cache
def _declared() -> tuple:
    """(the knobs that declare choices or a range, an attrgetter of their values, each one's `valid`),
    worked out once: validate() runs for every plan the planner builds, and a value `valid(value)`
    accepts is one _check_declared accepts (its choices, its range as _check_declared reads it), so
    only a value it refuses pays for the full check and its message."""
    declared = [f for f in fields(TrainingPlan) if knob_choices(f) is not None or f.metadata.get("range")]
    return tuple(declared), attrgetter(*(f.name for f in declared)), tuple(map(_accepts, declared))


def _accepts(f):
    """A predicate true only of values _check_declared(f, value) accepts (False: ask it), for a
    knob that declares choices or a range (one that declares neither accepts every value)."""
    choices = knob_choices(f)
    bounds = f.metadata.get("range")
    if bounds is not None:
        lo, hi, _ = bounds
        if isinstance(lo, int) and not isinstance(lo, bool) and isinstance(f.default, int):
            in_range = lambda v: isinstance(v, int) and v >= lo  # noqa: E731
        elif isinstance(f.default, float):
            in_range = lambda v: isinstance(v, (int, float)) and lo <= v <= hi  # noqa: E731
        else:
            in_range = lambda v: False  # noqa: E731  # neither kind: _check_declared decides
        if choices is None:
            return in_range
        return lambda v: v in choices and in_range(v)
    return choices.__contains__


def _check_declared(f, value) -> None:
    choices = knob_choices(f)
    if choices is not None and value not in choices:
        template = f.metadata.get("choice_error")
        raise MemkitError(template.format(value=value) if template else
                          f"{flag_name(f)} {value!r} is not one of {', '.join(map(str, choices))}")
    bounds = f.metadata.get("range")
    if bounds is None:
        return
    lo, hi, what = bounds
    if isinstance(lo, int) and not isinstance(lo, bool) and isinstance(f.default, int):
        if not isinstance(value, int) or value < lo:
            if lo == 1:
                raise MemkitError(f"{flag_name(f)} {value} must be a positive integer")
            raise MemkitError(f"{flag_name(f)} {value} must be >= {lo} ({what.split('(')[-1].rstrip(')')})")
    elif isinstance(f.default, float) and not lo <= value <= hi:  # a float knob: both ends
        raise MemkitError(f"{flag_name(f)} {value} must be between {lo} and {hi} ({what})")


def knob_ranges() -> dict[str, tuple]:
    """field name -> (lowest, highest, what): the range each ranged knob declares (memkit.plan.limits)."""
    return {f.name: f.metadata["range"] for f in fields(TrainingPlan) if f.metadata.get("range")}


def trainer_knobs(plan: "TrainingPlan") -> dict:
    """TrainingArguments field -> value of every knob that declares one (`trainer=`), in declaration
    order: the knobs Trainer takes as they are (emit/trainer.py derives the others)."""
    return {f.metadata["trainer"]: getattr(plan, f.name) for f in fields(plan)
            if isinstance(f.metadata.get("trainer"), str)}


def trainer_flags(plan: "TrainingPlan") -> dict:
    """TrainingArguments field -> value of every field a knob's value derives (`trainer={field: rule}`),
    in declaration order (knob's rules: a tuple of the values that set it True, or a dict of what
    each named value writes)."""
    out = {}
    for f in fields(plan):
        rules, value = f.metadata.get("trainer"), getattr(plan, f.name)
        for name, rule in (rules.items() if isinstance(rules, dict) else ()):
            if isinstance(rule, tuple):
                out[name] = value in rule
            elif value in rule:
                out[name] = rule[value]
    return out


def knob_fields(command: str) -> list:
    """The TrainingPlan fields `command` (COMMANDS) takes as flags, in declaration order."""
    return [f for f in fields(TrainingPlan) if command in f.metadata.get("cli", {})]


def pin_flags() -> dict[str, str]:
    """Plan field -> the suggest flag that pins it (`--zero 2` fixes zero_stage), for every "pin"
    knob that takes a value (a flag-only bool pin, --optimizer-in-backward, is its flag alone), in
    declaration order except where a "pin" spec says "lists_after": the order suggest's pins are
    listed, checked and shown (planner/space.py pins, cli/explain.py pin_words)."""
    names = [f for f in knob_fields("pin") if f.type != "bool"]
    order = [f for f in names if "lists_after" not in _cli_spec(f, "pin")]
    for f in names:
        if (after := _cli_spec(f, "pin").get("lists_after")) is not None:
            order.insert(next(i for i, g in enumerate(order) if g.name == after) + 1, f)
    return {f.name: _cli_spec(f, "pin").get("flag") or flag_name(f) for f in order}


def add_knob_flags(group, command: str) -> None:
    """argparse flags of the knobs `command` takes, from their declarations. estimate / workload:
    the plan default when not given; pin / run: None (the planner, or plan.json, decides)."""
    given = command in ("estimate", "workload")
    for f in knob_fields(command):
        meta, kwargs = f.metadata, {}
        spec = _cli_spec(f, command)
        flag = spec.get("flag") or flag_name(f)
        if spec.get("help") is not None:
            kwargs["help"] = spec["help"]
        if meta["negated"]:
            group.add_argument(flag, action="store_true", **kwargs)
            continue
        if f.type == "bool":
            group.add_argument(flag, action="store_true", default=f.default if given else None, **kwargs)
            continue
        default = f.default if given else None
        if command == "estimate" and meta["estimate_default"] is not MISSING:
            default = meta["estimate_default"]
        choices = spec["choices"] if "choices" in spec else knob_choices(f)
        if spec.get("text"):
            pass  # the command reads the text itself (a cli spec's "text": True)
        elif meta["parse"] is not None and "choices" not in spec:
            kwargs["type"] = meta["parse"]
        elif choices is not None:
            kwargs["choices"] = choices
            if isinstance(choices[0], int):
                kwargs["type"] = int
        elif knob_kind(f) in ("int", "float"):
            kwargs["type"] = {"int": int, "float": float}[knob_kind(f)]
        if knob_kind(f) == "tuple":
            default = None  # comma-separated text; memkit.cli.common.lora_targets / knob_values read it
        group.add_argument(flag, default=default, **kwargs)


def _cli_spec(f, command: str) -> dict:
    spec = f.metadata["cli"][command]
    return dict(spec) if isinstance(spec, dict) else {"help": spec}


def knob_values(args, command: str) -> dict:
    """field name -> the value of each knob flag `command` took (None: not given, for pin/run).
    A tuple knob (--lora-targets) comes back as a tuple of names (None when not given)."""
    out = {}
    given = command in ("estimate", "workload")
    for f in knob_fields(command):
        dest = (_cli_spec(f, command).get("flag") or flag_name(f))[2:].replace("-", "_")
        value = getattr(args, dest)
        if f.metadata["negated"]:
            value = False if value else (f.default if given else None)
        elif knob_kind(f) == "tuple" and value:  # comma-separated names
            value = tuple(t.strip() for t in value.split(",") if t.strip())
        out[f.name] = value
    return out


def request_knob_fields() -> list[tuple]:
    """(name, type, field) of the planner Request's knob fields (planner/space.py derives them):
    each "pin" knob as `type | None = None` (None: the planner chooses; a flag-only bool keeps its
    plan default), each "workload" knob with its plan default."""
    if not _HINTS:
        _HINTS.update(get_type_hints(TrainingPlan))
    out = []
    for f in fields(TrainingPlan):
        cli = f.metadata.get("cli", {})
        if "workload" in cli or (f.type == "bool" and "pin" in cli):
            out.append((f.name, _HINTS[f.name], field(default=f.default)))
        elif "pin" in cli:
            out.append((f.name, _HINTS[f.name] | None, field(default=None)))
    return out


def task_knob_error(plan: "TrainingPlan") -> str | None:
    """Why the task knobs cannot be priced with the rest of `plan` (one line: why, what to pass), or None.
    The task heads are priced on unsplit models with HF's standard loss (estimate/activations.py)."""
    # --num-labels >= 1 and --target-len >= 0: their declared ranges (TrainingPlan fields)
    if plan.task != "causal-lm":
        if plan.loss != "standard":
            return (f"--loss {plan.loss} with --task {plan.task}: chunked/fused losses replace a language-model "
                    "head; a classification head's logits are small, use --loss standard")
        if plan.tp > 1 or plan.pp > 1:
            return (f"--task {plan.task} with --tp {plan.tp} --pp {plan.pp}: memkit prices classification heads "
                    "on unsplit models; use --tp 1 --pp 1 (data parallel / ZeRO)")
    if plan.target_len and (plan.tp > 1 or plan.pp > 1):
        return (f"--target-len {plan.target_len} with --tp {plan.tp} --pp {plan.pp}: memkit prices two lengths "
                "on unsplit models; use --tp 1 --pp 1 (data parallel / ZeRO)")
    return None
