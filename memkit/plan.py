"""TrainingPlan: every knob of one way to train, per GPU. The estimator prices it, the planner
searches over it, the emitters write it, the runner honours it.

Knobs only, no behaviour beyond validation. Defaults are DeepSpeed's own defaults
(deepspeed/runtime/zero/config.py), so a plan built from a user's default DeepSpeed config
is estimated as DeepSpeed would run it; the planner sets them explicitly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from memkit.errors import MemkitError
from memkit.parallel import split_knob_error
from memkit.backward_techniques import activation_offload_error, optimizer_in_backward_error
from memkit.techniques import CHECKPOINTING, LOSSES, checkpointing_error, loss_knob_error, partial_blocks_error  # noqa: F401
from memkit.quantize import QUANTIZE_BASES, quantize_knob_error  # noqa: F401

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd")
OFFLOADS = ("none", "cpu", "nvme")
ATTENTIONS = ("eager", "sdpa", "flash")
HF_ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
"""transformers' attn_implementation for each plan attention (transformers modeling_utils.py,
_check_and_adjust_attn_implementation); the runner and the bundle's Trainer model kwargs use it."""
ENGINES = ("deepspeed", "torch")
TP_ENGINES = ("autotp", "tp_plan")
PP_ENGINES = ("torch", "deepspeed")
PP_SCHEDULES = ("1f1b", "gpipe")
TASKS = ("causal-lm", "seq-cls", "token-cls")
"""What the model is trained to do: its own language-model head (causal LM, or the masked / seq2seq LM
of an encoder / encoder-decoder), or a classification head of num_labels outputs on the whole
sequence (AutoModelForSequenceClassification) or on every token (AutoModelForTokenClassification)."""
TASK_DEFAULTS = {"task": "causal-lm", "num_labels": 2, "target_len": 0}
"""Defaults of the task fields; to_dict leaves them out at these values, so plan.json files (and the
presets) written before they existed read, and are written, the same."""
MAX_MICRO_BATCH = 65_536
"""Largest micro-batch (sequences per GPU per step) memkit accepts or searches: 64k sequences of
even 128 tokens is 8M tokens per GPU per step, beyond any device's memory for a real model."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingPlan:
    precision: str = "bf16"
    """fp32; fp16/bf16 = mixed precision with fp32 master weights; bf16-pure = everything in bf16."""
    optimizer: str = "adamw"
    zero_stage: int = 0
    """ZeRO stage 0-3 (Rajbhandari et al. 2020, Sec. 5). With engine='torch', 3 means FSDP full shard."""
    offload_optimizer: str = "none"
    offload_params: str = "none"
    checkpointing: str = "none"
    """'full': HF activation_checkpointing_enable(), one checkpoint per block; 'K' (digits):
    the first K blocks only (memkit/techniques.py says which and why)."""
    loss: str = "standard"
    """'standard': HF's full fp32 logits; 'chunked': memkit's chunked cross-entropy; 'fused':
    liger-kernel's fused linear cross-entropy (CUDA only). memkit/techniques.py."""
    offload_activations: str = "none"
    """'cpu': every saved activation to host RAM in forward, back in backward (memkit/backward_techniques.py)."""
    optimizer_in_backward: bool = False
    """Each parameter steps in its post-accumulate-grad hook; one gradient alive at a time
    (memkit/backward_techniques.py states what it cannot run with)."""
    attention: str = "sdpa"
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    task: str = "causal-lm"
    """One of TASKS; the head (and its logits) priced and trained (estimate/activations.py head_logits)."""
    num_labels: int = 2
    """Outputs of a seq-cls / token-cls head (transformers PretrainedConfig.num_labels, default 2)."""
    target_len: int = 0
    """Encoder-decoders (T5, BART): decoder tokens per sequence; 0 = seq_len (the encoder's)."""
    dp: int = 1
    """Data-parallel degree; dp * tp * pp must equal the number of GPUs."""
    tp: int = 1
    pp: int = 1
    tp_engine: str = "autotp"
    """How TP runs: DeepSpeed AutoTP ('autotp') or transformers tp_plan/DTensor ('tp_plan')."""
    sequence_parallel: bool = False
    """With tp > 1: shard the hidden-sized activations (norms, residuals, dropout) and the loss
    over the TP ranks too (Korthikanti et al. 2022, Sec. 4.2.2; torchtitan's TP + loss parallel).
    DeepSpeed AutoTP does not do this; torch tp_plan/DTensor plans can."""
    pp_engine: str = "torch"
    """How PP runs: torch.distributed.pipelining ('torch') or DeepSpeed PipelineModule ('deepspeed')."""
    pp_schedule: str = "1f1b"
    lora_rank: int = 0
    """0 = full fine-tuning."""
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    quantize_base: str = "none"
    """'nf4' / 'fp4': the frozen base's linear weights in 4 bits (bitsandbytes), LoRA on top
    (QLoRA); compute dtype from the precision. memkit/quantize.py states the rules."""
    double_quant: bool = True
    """With a 4-bit base: quantise the block scales too (QLoRA Sec. 3; bnb_4bit_use_double_quant)."""
    engine: str = "deepspeed"
    """'deepspeed' (ZeRO via DeepSpeed) or 'torch' (plain PyTorch/AMP, DDP, FSDP)."""
    fsdp_use_orig_params: bool = False
    """torch FSDP1 `use_orig_params` (its default: False; Lightning Fabric's FSDPStrategy sets True
    with torch >= 2.0). True lets a wrapped unit mix frozen and trainable parameters, and the
    unit's gradient then covers all of it (estimate/states.py)."""
    # DeepSpeed ZeRO buffers, in elements (deepspeed/runtime/zero/config.py defaults).
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    gradient_clipping: float = 1.0

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
        checkpointing K must be below it (memkit/techniques.py)."""
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("offload-optimizer", self.offload_optimizer, OFFLOADS)
        _choice("offload-params", self.offload_params, OFFLOADS)
        for error in (checkpointing_error(self.checkpointing),
                      loss_knob_error(self.loss, tp=self.tp, pp=self.pp)):
            if error:
                raise MemkitError(error)
        if self.checkpointing not in CHECKPOINTING and self.pp > 1:
            raise MemkitError(f"--checkpointing {self.checkpointing} with --pp {self.pp}: partial "
                              "checkpointing is priced for unsplit models; use none or full with --pp")
        _choice("attention", self.attention, ATTENTIONS)
        _choice("task", self.task, TASKS)
        task_error = task_knob_error(self)
        if task_error:
            raise MemkitError(task_error)
        _choice("engine", self.engine, ENGINES)
        _choice("tp engine", self.tp_engine, TP_ENGINES)
        _choice("pp engine", self.pp_engine, PP_ENGINES)
        _choice("pp schedule", self.pp_schedule, PP_SCHEDULES)
        if self.zero_stage not in (0, 1, 2, 3):
            raise MemkitError(f"--zero {self.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
        for name in ("micro_batch_size", "grad_accum", "seq_len", "dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MemkitError(f"--{name.replace('_', '-')} {value} must be a positive integer")
        if self.lora_rank < 0:
            raise MemkitError(f"--lora-rank {self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        quantize_error = quantize_knob_error(self.quantize_base, lora_rank=self.lora_rank, precision=self.precision,
                                             engine=self.engine, zero_stage=self.zero_stage, tp=self.tp, pp=self.pp)
        if quantize_error:
            raise MemkitError(quantize_error)
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
        if self.optimizer in ("adamw-8bit", "paged-adamw-8bit", "adafactor") and self.offload_optimizer != "none":
            raise MemkitError(
                f"--optimizer {self.optimizer} cannot be offloaded: DeepSpeed's CPU optimizers are "
                "Adam/AdamW/Adagrad/Lion; use --optimizer adamw or --offload-optimizer none")
        for error in (activation_offload_error(self.offload_activations, pp=self.pp, tp=self.tp),
                      optimizer_in_backward_error(self)):
            if error:
                raise MemkitError(error)
        split_error = split_knob_error(self)  # memkit/parallel.py states the split rules
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
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if TASK_DEFAULTS.get(k, object()) != v}
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


def task_knob_error(plan: "TrainingPlan") -> str | None:
    """Why the task knobs cannot be priced with the rest of `plan` (one line: why, what to pass), or None.
    The task heads are priced on unsplit models with HF's standard loss (estimate/activations.py)."""
    if plan.num_labels < 1:
        return f"--num-labels {plan.num_labels} must be a positive integer"
    if plan.target_len < 0:
        return f"--target-len {plan.target_len} must be >= 1 (or 0: the same as --seq-len)"
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


def _choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MemkitError(f"--{what.replace(' ', '-')} {value!r} is not one of {', '.join(choices)}")
