"""Step-time model: how long one optimizer step of a TrainingPlan takes, hence tokens/s and MFU.

The planner ranks feasible plans with it. Compute is priced kernel by kernel from the shapes the
plan gives each GPU (memkit/estimate/kernels.py: matmuls at the achievable rate of the GPU
generation and dtype, attention kernels at their published utilisation, elementwise ops as HBM
traffic); communication from the mechanism each engine and ZeRO stage uses (DeepSpeed 0.19
runtime/zero/stage_1_and_2.py and stage3.py, torch DDP / FSDP); nothing is fitted to the
throughput benchmark (benchmarks/throughput_accuracy.py measures it). What each technique adds
(recompute, offload traffic, the optimizer step, the pipeline) is a StepTechnique of
estimate/step_terms.py, which estimate_step_time walks.

Per GPU and per optimizer step (m = grad_accum micro-steps):

    step = bubble * m * micro + once-per-step terms
    micro = max(GPU compute, host dispatch) + exposed communication + offload traffic + TP/PP comm
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from memkit.estimate import kernels
from memkit.estimate.activations import PlanPart, head_logits, numerics
from memkit.estimate.flops import train_flops_per_token
from memkit.estimate.techniques import loss_recompute_flops_per_token, recompute_share
from memkit.plan.plan import TrainingPlan
from memkit.presets_dir import presets_dir
from memkit.spec.generic import task_spec
from memkit.spec.hardware import GPU, Hardware
from memkit.spec.model import Linear, ModelSpec
from memkit.spec.stack import Stack, behaviour

if TYPE_CHECKING:
    from memkit.estimate.step_terms import StepContext, StepTerms

# ---- constants (each cites where it comes from) -----------------------------------------------

OP_DISPATCH_S = 10e-6
"""CPU time PyTorch eager needs to issue one op (Python, dispatcher, kernel launch): ~10 us (Horace
He, "Making Deep Learning Go Brrrr From First Principles", 2022, Sec. "Overhead"). Kernels run
asynchronously, so a micro-step is host-bound only when this exceeds the GPU time."""

OPS_PER_LINEAR = 3
"""Forward + input-grad + weight-grad kernels of one nn.Linear (addmm / mm / mm)."""

NORM_FED_ROLES = ("q", "k", "v", "qkv", "gate", "up")
"""Linears whose input is a norm's output, which is fp32 under torch autocast (layer_norm is on its
fp32 list), so autocast casts that input to 16 bits at every call."""

ELEMENTWISE_OPS_PER_BLOCK = 100
"""Non-matmul ops of one transformer block, forward and backward, counted from
transformers/models/llama/modeling_llama.py LlamaDecoderLayer: ~40 forward (RMSNorm is 6 ops, twice;
rotary ~10; reshapes/transposes and the attention call ~8; two residual adds; act * up; casts) and
~1.5x that many autograd nodes in backward."""

LOSS_BYTES_PER_LOGIT = 32
"""HBM bytes per logit of the cross-entropy: 16-bit logits upcast to fp32 (2 read + 4 written),
log-softmax (4 + 4), and its backward (4 + 4 read, 4 written, cast back 4 + 2); torch
nn.functional.cross_entropy = log_softmax + nll_loss."""

COMPILED_CHUNK_LOSS_BYTES_PER_LOGIT = 6
"""HBM bytes per logit of a chunked cross-entropy whose upcast runs inside the compiled loss:
torchtune's CEWithChunkedOutputLoss.compute_cross_entropy is `F.cross_entropy(logits.float(), ...)`
on one chunk of 16-bit logits (torchtune/modules/loss/ce_chunked_output_loss.py @ 1814feb17), and
its recipes compile exactly that method (torchtune/training/_compile.py compile_loss), so Inductor
fuses cast, log-softmax and NLL: forward reads the 16-bit chunk once (2), backward reads it again
and writes its 16-bit gradient (2 + 2). The fp32 copy LOSS_BYTES_PER_LOGIT counts is never in HBM."""

DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP bucket_cap_mb default 25 MiB (torch/nn/parallel/distributed.py): the last bucket's
all-reduce starts only after backward ends, so it is never hidden (Li et al. 2020, Sec. 3.2.3)."""

HOST_MEMORY_GBPS_PER_NODE = 100.0
"""Host DRAM bandwidth CPU-Adam achieves on one node (all its cores). CPU-Adam is a streaming,
memory-bound kernel (ZeRO-Offload, Ren et al. 2021, Sec. 5.1 vectorises it with AVX for that
reason); a two-socket server streams ~200-300 GB/s, and the optimizer reaches about half."""

CPU_ADAM_BYTES_PER_PARAM = 30
"""fp32 param, fp32 grad, m, v read (16 B) + param, m, v written (12 B) + the 16-bit copy (2 B)."""

NVME_GBPS_PER_NODE = 6.0
"""One PCIe 4.0 NVMe drive per node (~7 GB/s read, ~5 GB/s write); ZeRO-Infinity (Rajbhandari et
al. 2021, Sec. 6.2) stripes several for more."""

GPU_OPTIMIZER_BYTES_PER_PARAM = {"adamw": 32, "adamw-8bit": 10, "paged-adamw-8bit": 10, "adafactor": 68,
                                 "sgd": 12}
"""HBM bytes the optimizer step reads+writes per trainable parameter; memory-bound (roofline).
AdamW: the fused fp32 step with the 16-bit copy, adamw_step_bytes(4, fused=True, master_copy=True);
the step itself is priced by adamw_step_bytes, by implementation and item size (OptimizerStep). 8-bit Adam:
bnb_8bit_step_bytes at 16-bit params (10; OptimizerStep prices it by item size); the paged variant
runs the same kernel on CUDA unified memory (bitsandbytes/optim/adamw.py PagedAdamW8bit). Adafactor
(transformers/optimization.py Adafactor.step, factored): grad^2 written, its row and column means,
the factored approximation materialised, times grad, its RMS, the clip division, the lr scaling
and the param update are separate full-size fp32 passes, ~17 reads/writes of 4 B = 68. SGD with
momentum: param, grad, buffer read, param and buffer written (12 with the copy)."""

ADAMW_FOREACH_PASSES = 20
"""Element passes of torch's default AdamW step (torch/optim/adam.py _multi_tensor_adam, the
foreach path torch.optim.AdamW takes on CUDA when neither foreach nor fused is given,
torch/optim/optimizer.py _default_to_fused_or_foreach), each one state-sized tensor read or
written: _foreach_mul_(params, 1 - lr*wd) 2, _foreach_lerp_(exp_avgs, grads) 3,
_foreach_mul_(exp_avg_sqs) 2, _foreach_addcmul_(exp_avg_sqs, grads, grads) 3,
_foreach_sqrt(exp_avg_sqs) 2 (a new tensor), _foreach_div_ 2, _foreach_add_(eps) 2,
_foreach_addcdiv_(params, exp_avgs, denom) 4. Every pass is its own kernel over HBM."""

ADAMW_FUSED_PASSES = 7
"""torch's fused AdamW (AdamW(fused=True): torch/optim/adam.py _fused_adam -> _fused_adamw_) and
DeepSpeed's FusedAdam (deepspeed/ops/adam/fused_adam.py, one multi_tensor_adam kernel): param,
grad, exp_avg, exp_avg_sq read, param, exp_avg, exp_avg_sq written."""

CLIP_GRAD_PASSES = 3
"""torch.nn.utils.clip_grad_norm_ (torch/nn/utils/clip_grad.py): _get_total_norm runs
torch._foreach_norm over every gradient (one read), _clip_grads_with_norm_ then
torch._foreach_mul_(grads, clip_coef_clamped) unconditionally (the coefficient is clamped to 1,
not skipped: one read and one write). DeepSpeed ZeRO-1/2 does the same over its fp32 gradient
partition (runtime/zero/stage_1_and_2.py scaled_global_norm -> unscale_and_clip_grads)."""


def bnb_8bit_step_bytes(param_itemsize: int) -> int:
    """HBM bytes per parameter of bitsandbytes' blockwise 8-bit Adam step
    (csrc/kernels.cu kOptimizerStatic8bit2StateBlockwise, launched once per tensor by
    csrc/ops.cu optimizerStatic8bitBlockwise, 0.44.0 through HEAD): it loads g, state1, state2 and p
    and stores p, state1 and state2, g and p in the parameter's dtype (update_step passes p.grad and
    p), the states one byte each: 3 x itemsize + 4. Not counted: the per-256-element-block absmax
    (4 B read and written per state per block, 1/16 B an element) and the two 256-entry fp32
    quantile maps each block copies into shared memory (L2-resident, 2 KB a block); tensors under
    min_8bit_size = 4096 elements (norm weights) take optimizer_update_32bit with fp32 states
    (bitsandbytes/optim/optimizer.py Optimizer2State.init_state), a vanishing share of the bytes."""
    return 3 * param_itemsize + 4


def adamw_step_bytes(state_itemsize: int, *, fused: bool, master_copy: bool) -> int:
    """HBM bytes per trainable parameter of one AdamW step: ADAMW_FUSED_PASSES or
    ADAMW_FOREACH_PASSES element passes at the states' item size (the parameter's: bf16 under
    bf16-pure, torch's optimizer states are zeros_like(param)), plus the 16-bit copy of an fp32
    master (4 with its read) where the engine keeps one."""
    return (ADAMW_FUSED_PASSES if fused else ADAMW_FOREACH_PASSES) * state_itemsize + 4 * master_copy


OPTIMIZER_OPS_PER_TENSOR = {"adamw": 0, "sgd": 0, "adamw-8bit": 3, "paged-adamw-8bit": 3, "adafactor": 15}
"""Python-issued ops per parameter tensor in the optimizer step, where the implementation loops
over tensors: torch AdamW/SGD use the multi-tensor (foreach) path by default on CUDA
(torch/optim/adamw.py _multi_tensor_adamw), a few launches in all; bitsandbytes AdamW8bit calls
one fused kernel per tensor plus state bookkeeping (bitsandbytes/optim/optimizer.py
Optimizer8bit.step -> update_step); transformers Adafactor runs ~15 tensor ops per parameter
(transformers/optimization.py Adafactor.step: grad^2, row/col means, two lerps, rsqrt factors,
their product, times grad, RMS, clamp, divide, lr scale, RMS of the param, update)."""

SINGLE_TENSOR_OPTIMIZER = {"adamw": (9, 92), "sgd": (3, 32)}
"""(kernels per parameter tensor, HBM bytes per parameter) of torch.optim's per-parameter loop,
which torch < 2.0 runs by default (spec/stack.py FOREACH_DEFAULT_TORCH): torch 1.x
torch/optim/_functional.py adamw issues param.mul_ (weight decay), exp_avg.mul_().add_(),
exp_avg_sq.mul_().addcmul_(), sqrt(), / bias correction, .add_(eps), param.addcdiv_() -- 9 kernels,
each a full fp32 pass (8 + 8 + 12 + 8 + 16 + 8 + 8 + 8 + 16 = 92 B per parameter, against 32 for
the fused / foreach step); sgd with momentum buf.mul_().add_(), param.add_() -- 3 kernels, 32 B.
transformers' own AdamW (the Trainer's `adamw_hf`) has the same loop shape
(transformers/optimization.py AdamW.step, 8 kernels)."""

ZERO3_OVERHEAD_S_PER_LAYER = 3.0e-3
"""DeepSpeed ZeRO-3 only: its pre/post forward and backward hooks on each of a block's ~10
parameterised submodules (~40 calls) fetch, release and track partitioned parameters in Python and
wait on the fetches, at ~50-75 us a call (deepspeed/runtime/zero/parameter_offload.py,
partitioned_param_coordinator.py). Not hidden by prefetch, and independent of the micro-batch.
FSDP gathers one flat parameter per wrapped block instead, so it pays no such per-module cost."""

ZERO12_OPS_PER_GRAD = 6
"""Dispatched ops DeepSpeed ZeRO-1/2 issues per gradient tensor each time it handles it
(deepspeed 0.19 runtime/zero/stage_1_and_2.py): reduce_independent_p_g_buckets_and_remove_grads
narrows the ipg bucket buffer, copy_()s the gradient into it (contiguous_gradients) and re-views
param.grad onto it (3); reduce_ipg_grads -> copy_grads_in_partition narrows grads_in_partition,
copy_()s the rank's part and re-views it (3). Stage 2 runs this from each parameter's
grad-accumulation hook (create_gradient_handling_hooks -> process_gradients, partition_gradients)
in every micro-step's backward; stage 1 only at the accumulation boundary
(reduce_ready_partitions_and_remove_grads: is_gradient_accumulation_boundary), from
reduce_gradients after backward."""

ZERO3_DEBUG_CALLS_PER_PARAM = 4
"""DeepSpeed < 0.9.4 only: PartitionedParameterCoordinator.fetch_sub_module and __release_param
built their debug strings even with logging off -- per parameter of each fetched submodule
f"-fetch: {param.ds_summary()}", "-wait: ...", "-release: ..." and, for prefetched ones,
"-prefetch: ...", each ds_summary() a dict of the param's ds_* fields formatted to text; removed
by deepspeedai/DeepSpeed#3622 ("zero3 performance optimizations", v0.9.4,
partitioned_param_coordinator.py: `if logger.isEnabledFor(logging.DEBUG)`). Each is priced as
one dispatched op's worth of Python (OP_DISPATCH_S), in forward and again in backward."""

STEP_OVERHEAD_S = 10e-3
"""Fixed per optimizer step: gradient-norm clipping, overflow checks, scheduler, logging."""

GB = 1e9


@lru_cache(maxsize=1)
def _uncertainty_doc() -> dict:
    return json.loads((presets_dir() / "step_time_uncertainty.json").read_text())


def step_time_uncertainty() -> float:
    """The model's stated relative uncertainty: p75 of |predicted - measured| / measured over the
    published runs, as benchmarks/throughput_accuracy.py --write-uncertainty last wrote it."""
    return float(_uncertainty_doc()["p75_abs_error"])


def step_time_ranking_uncertainty() -> float:
    """How far the model's predicted ratio of two plans' step times may be off: the p75 over the
    published runs' ranked pairs (same source, model and GPU, both scored in absolute terms) of
    |predicted ratio / measured ratio - 1| (memkit.calibrate.published_throughput.pair_ratio_errors),
    as benchmarks/throughput_accuracy.py --write-uncertainty last wrote it. Two plans whose predicted
    step times differ by less than this are not ranked by speed (planner/search.py
    _prefer_low_risk, _prefer_data_parallel)."""
    return float(_uncertainty_doc()["p75_pair_ratio_error"])


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeEstimate:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation: memkit.estimate.flops per token x tokens / (time x peak)."""
    hfu: float
    """Hardware FLOPs utilisation: counts the recompute forward too (Korthikanti et al. 2022, Sec. 6)."""
    model_flops_per_step: float
    compute_efficiency: float
    """Achieved share of the dense peak while computing (model + recompute FLOPs over compute time)."""
    components_s: dict[str, float] = field(default_factory=dict)
    """Seconds per optimizer step by term; they sum to step_time_s."""

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "hfu": self.hfu, "model_flops_per_step": self.model_flops_per_step,
                "compute_efficiency": self.compute_efficiency, "components_s": dict(self.components_s)}


# ---- FLOPs --------------------------------------------------------------------------------------

def matmul_params(model: ModelSpec) -> int:
    """Parameters a token meets in a matmul: all but the embedding lookup, plus the LM head when it
    is tied to the embedding (the head still multiplies). Active experts only for MoE."""
    n = model.num_params - model.embedding_params
    if model.tie_word_embeddings and model.kind != "encoder":
        n += model.vocab_size * model.hidden_size
    if model.is_moe and model.num_experts_per_tok:
        expert = sum(lin.num_params for lin in model.layer_linears if lin.role.startswith("expert"))
        n -= int(model.num_layers * expert * (1 - model.num_experts_per_tok / model.num_experts))
    return n


FLOPS_PLAN_FIELDS = ("precision", "engine", "zero_stage", "micro_batch_size", "seq_len", "target_len", "task",
                     "num_labels", "tp", "lora_rank", "lora_targets", "checkpointing", "loss")
"""The TrainingPlan fields flops_per_token reads (task_spec, its helpers, recompute_share and
loss_recompute_flops_per_token), the plan's part of its memo key (as LAYER_PASS_PLAN_FIELDS)."""


def flops_per_token(model: ModelSpec, plan: TrainingPlan) -> tuple[float, float]:
    """(model FLOPs, extra recompute FLOPs) per token of one training step (memkit.estimate.flops), a
    token being one of the micro-batch's seq_len input positions: the task's head (_per_token_params)
    and an encoder-decoder's decoder at --target-len (_attention_positions). Memoised on the model
    and FLOPS_PLAN_FIELDS."""
    return _memo_flops_per_token(model, PlanPart(plan, FLOPS_PLAN_FIELDS))


@lru_cache(maxsize=4096)
def _memo_flops_per_token(model: ModelSpec, part) -> tuple[float, float]:
    plan = part.plan
    model = task_spec(model, plan)  # the task's head and lengths (spec/generic.py)
    n = _per_token_params(model, plan)
    lora = model.lora_params(plan.lora_rank, plan.lora_targets) + model.lora_saved_params
    trainable = min(n, lora) if plan.is_lora else n
    width = model.num_attention_heads * model.head_dim
    positions = _attention_positions(model, plan)
    total = train_flops_per_token(matmul_params=n, trainable_matmul_params=trainable,
                                  num_layers=1, attention_width=width, seq_len=positions)
    # Checkpointing re-runs each checkpointed block's forward in backward (Chen et al. 2016;
    # Korthikanti et al. 2022, Sec. 5): 2N + the forward third of the attention term, times K/L for
    # partial checkpointing (selective re-runs no matmul); the chunked loss re-runs the head matmul
    # (memkit/estimate/techniques.py).
    recompute = ((2.0 * n + 4.0 * width * positions) * recompute_share(plan, model.total_layers)
                 + loss_recompute_flops_per_token(model, plan))
    return total, recompute


def _target_share(model: ModelSpec, plan: TrainingPlan) -> float:
    """Decoder positions per input position: an encoder-decoder's decoder runs at --target-len
    (0: seq_len) over an encoder at seq_len (bart/modeling_bart.py BartForConditionalGeneration:
    decoder_input_ids are the labels shifted right); 1 for every other model."""
    if model.kind != "encoder-decoder" or not plan.target_len:
        return 1.0
    return plan.target_len / plan.seq_len


def _cross_kv_params(model: ModelSpec) -> int:
    """Parameters of the decoder blocks' cross-attention K and V projections, which run on the
    encoder's seq_len states, not the decoder's tokens (bart/modeling_bart.py BartAttention with
    key_value_states; t5/modeling_t5.py T5Attention): the second k and v of a decoder block."""
    if model.kind != "encoder-decoder":
        return 0
    seen: dict[str, int] = {}
    cross = 0
    for lin in model.layer_linears:
        if lin.role in ("k", "v"):
            seen[lin.role] = seen.get(lin.role, 0) + 1
            cross += lin.num_params if seen[lin.role] > 1 else 0
    return model.num_layers * cross


def _head_rows(model: ModelSpec, plan: TrainingPlan, micro_tokens: float) -> float:
    """Rows the task head's matmuls multiply per micro-batch of `micro_tokens` input positions. An
    encoder's (or encoder-decoder's) sequence classifier pools one position first, then its pooler
    and classifier run once per sequence (bert/modeling_bert.py BertForSequenceClassification: BertPooler
    on hidden_states[:, 0]; deberta_v2 ContextPooler; electra ElectraClassificationHead features[:, 0];
    distilbert hidden_state[:, 0]; bart BartForSequenceClassification, the eos position); a decoder's
    scores every position, then gathers the last (transformers/modeling_layers.py
    GenericForSequenceClassification.forward: `logits = self.score(hidden_states)`, then pooled_logits).
    A token classifier and an LM head: every (decoder) position."""
    if plan.task == "seq-cls" and model.kind != "decoder":
        return micro_tokens / plan.seq_len
    if plan.task == "causal-lm":
        return micro_tokens * _target_share(model, plan)
    return micro_tokens


def _head_matmul_params(model: ModelSpec, plan: TrainingPlan) -> int:
    """Weights of the head's matmuls: the LM head's vocab x hidden (tied or not), or a classifier's
    linears (spec.head_matmul_params: pooler / dense and classifier, with their biases)."""
    return model.vocab_size * model.hidden_size if plan.task == "causal-lm" else model.head_matmul_params


def _per_token_params(model: ModelSpec, plan: TrainingPlan) -> float:
    """matmul_params weighted by how many positions meet each per input position: the head at its
    rows (_head_rows), an encoder-decoder's decoder blocks at --target-len but their cross-attention
    K/V at seq_len (_cross_kv_params); everything else once per position."""
    n = matmul_params(model)
    head = min(n, _head_matmul_params(model, plan))
    decoder = (model.num_layers * model.layer_params - _cross_kv_params(model)
               if model.kind == "encoder-decoder" else 0)
    head_share = _head_rows(model, plan, plan.seq_len) / plan.seq_len
    return n - head * (1 - head_share) - decoder * (1 - _target_share(model, plan))


def _attention_positions(model: ModelSpec, plan: TrainingPlan) -> float:
    """Sum over attention modules of the key positions each query meets, per input position (the
    attention term of flops.py is 12 x width x this): seq_len per block for encoders and decoders; an
    encoder-decoder's encoder blocks seq_len, its decoder's self-attention t x t and cross-attention
    t x seq_len per sequence (t = --target-len; bart/modeling_bart.py BartDecoderLayer: self_attn,
    encoder_attn), divided by seq_len."""
    s = plan.seq_len
    if model.kind != "encoder-decoder":
        return float(model.total_layers * s)
    t = _target_share(model, plan) * s
    return model.num_encoder_layers * s + model.num_layers * (t * t + t * s) / s


# ---- compute, kernel by kernel -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Pass:
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    num_ops: int = 0

    def __add__(self, other: "_Pass") -> "_Pass":
        return _Pass(self.fwd_s + other.fwd_s, self.bwd_s + other.bwd_s, self.num_ops + other.num_ops)

    def scaled(self, k: float) -> "_Pass":
        return _Pass(self.fwd_s * k, self.bwd_s * k, int(self.num_ops * k))


def _amp_fp32_weights(plan: TrainingPlan) -> bool:
    """torch autocast with DDP / one GPU keeps fp32 parameters and gradients (torch.amp: autocast
    casts weights per op, AccumulateGrad writes the param's dtype); DeepSpeed's fp16/bf16 engine
    and FSDP MixedPrecision hold 16-bit copies instead."""
    return plan.engine == "torch" and plan.is_mixed and plan.zero_stage < 2


def _grad_bytes(plan: TrainingPlan) -> int:
    """Bytes per gradient element as it is reduced: the training dtype, fp32 under torch AMP."""
    return 4 if plan.precision == "fp32" or _amp_fp32_weights(plan) else 2


def _elt(plan: TrainingPlan) -> int:
    """Activation bytes: 16-bit under fp16/bf16 autocast and bf16-pure, 4 under fp32."""
    return 4 if plan.precision == "fp32" else 2


def _linear_pass(gpu: GPU, plan: TrainingPlan, model: ModelSpec, lin: Linear, tokens: int, *,
                 fp32_adapters: bool = False) -> _Pass:
    """One nn.Linear (or a 3-D expert weight) forward and backward; the weight gradient only when
    the weight trains (LoRA freezes it: activation gradients only, Hu et al. 2021, Sec. 4)."""
    prec = plan.precision
    k_in, n_out = lin.in_features, lin.out_features
    if lin.tp_style == "column":
        n_out //= plan.tp
    elif lin.tp_style == "row":
        k_in //= plan.tp
    batch, m = lin.count, tokens
    if lin.count > 1 and model.num_experts_per_tok and lin.role.startswith("expert"):
        m = tokens * model.num_experts_per_tok / lin.count  # tokens routed to each expert
    fwd = kernels.gemm_time_s(gpu, prec, m, n_out, k_in, batch=batch)
    bwd = kernels.gemm_time_s(gpu, prec, m, k_in, n_out, batch=batch)           # input gradient
    if not plan.is_lora:
        bwd += kernels.gemm_time_s(gpu, prec, k_in, n_out, m, batch=batch)      # weight gradient
    ops = OPS_PER_LINEAR
    if _amp_fp32_weights(plan):
        # torch autocast's cached_cast (aten/src/ATen/autocast_mode.cpp): an fp32 weight / bias is
        # cast once per autocast region (a trainable one also gets a ToCopyBackward node in
        # backward), an fp32 input at every call; each cast is one more dispatched op.
        per_param = 1 + (not plan.is_lora)
        ops += per_param * (1 + lin.bias) + (2 if lin.role in NORM_FED_ROLES else 0)
    if plan.is_lora and lin.name in plan.lora_targets:
        adapter = lora_adapter_pass(gpu, plan, m, k_in, n_out, fp32_adapters=fp32_adapters)
        fwd, bwd, ops = fwd + adapter.fwd_s, bwd + adapter.bwd_s, ops + adapter.num_ops
    return _Pass(fwd, bwd, ops)


def peft_fp32_adapters(plan: TrainingPlan, adapter_dtype: str | None = None) -> bool:
    """Whether a LoRA plan's adapter weights are fp32 while the base runs in 16 bits.
    peft's get_peft_model(..., autocast_adapter_dtype=True) (the default) upcasts fp16/bf16 adapter
    weights to fp32 (peft/tuners/tuners_utils.py BaseTuner._cast_adapter_dtype), and memkit's runs
    (train/model.py apply_plan) and the Trainer scripts it writes keep that default. DeepSpeed's
    engine later casts the whole module to the training dtype (deepspeed/runtime/engine.py
    DeepSpeedEngine._configure_distributed_model: module.half() / .bfloat16()), as the memory model
    assumes too (estimate/activations.py adapter_itemsize). `adapter_dtype` states it for runs
    outside memkit ("fp32", or "bf16"/"fp16" where the framework casts the model after peft, e.g.
    VectorLM's lora_model.bfloat16(), or runs its own LoRA in the model dtype, e.g. torchtune's
    LoRALinear).
    FSDP (torch engine, ZeRO 2-3) computes with its flat parameters cast to MixedPrecision's
    param_dtype, adapters included (torch/distributed/fsdp MixedPrecision), so it too runs them in
    the training dtype."""
    if not plan.is_lora or plan.precision == "fp32":
        return False
    if adapter_dtype is not None:
        return adapter_dtype == "fp32"
    return plan.engine == "torch" and plan.zero_stage < 2


def lora_adapter_pass(gpu: GPU, plan: TrainingPlan, m: float, k_in: int, n_out: int, *,
                      fp32_adapters: bool) -> _Pass:
    """One LoRA adapter of rank r on an m x k_in -> n_out linear, forward and backward, as peft's
    Linear.forward runs it (peft/tuners/lora/layer.py Linear.forward):

        x = self._cast_input_dtype(x, lora_A.weight.dtype)     # x.to(adapter dtype), when it differs
        result = result + lora_B(lora_A(dropout(x))) * scaling
        result = result.to(torch_result_dtype)

    16-bit adapters: x A and (xA) B in the compute dtype, dropout, scale and add at 16-bit width.
    fp32 adapters (peft_fp32_adapters): the cast x.to(fp32) and dropout run at fp32 width. Under
    autocast (fp16/bf16 mixed) F.linear casts its fp32 input back to 16 bits (aten autocast_mode.cpp,
    linear is on the lower-precision list), so the GEMMs stay on the tensor cores and the input
    pays two casts each way. Without autocast (bf16-pure) the four adapter GEMMs of backward and two
    of forward run in fp32 on the CUDA cores (kernels.gemm_time_s "fp32"), and the scale, the add
    (16-bit result + fp32 delta promotes to fp32) and the cast back are fp32-wide passes. Each cast
    and elementwise op has a backward of the same width; dropout keeps a 1-byte mask."""
    r, e = plan.lora_rank, _elt(plan)
    autocast = numerics(plan).autocast is not None
    x_e = 4 if fp32_adapters else e                  # width of x as dropout and lora_A see it
    gemm_prec = "fp32" if fp32_adapters and not autocast else plan.precision
    out_e = 4 if fp32_adapters and not autocast else e   # width of the adapter's output, scale and add
    fwd = kernels.gemm_time_s(gpu, gemm_prec, m, r, k_in) + kernels.gemm_time_s(gpu, gemm_prec, m, n_out, r)
    bwd = (kernels.gemm_time_s(gpu, gemm_prec, m, r, n_out) + kernels.gemm_time_s(gpu, gemm_prec, m, k_in, r)
           + kernels.gemm_time_s(gpu, gemm_prec, r, n_out, m) + kernels.gemm_time_s(gpu, gemm_prec, k_in, r, m))
    ops = 8
    if fp32_adapters and not autocast:
        # * scaling (read + write fp32), result + delta -> fp32 (2 + 4 read, 4 written), .to(16 bits)
        out = kernels.memory_time_s(gpu, (2 * 4 + (e + 4 + 4) + (4 + e)) * m * n_out)
        fwd, bwd, ops = fwd + out, bwd + out, ops + 2
    else:
        fwd += kernels.memory_time_s(gpu, 3 * e * m * n_out)                     # scale + add
    if fp32_adapters:
        cast = kernels.memory_time_s(gpu, (e + 4) * m * k_in)                    # x.to(fp32)
        if autocast:
            cast *= 2                                                          # and autocast's back
        fwd, bwd, ops = fwd + cast, bwd + cast, ops + (4 if autocast else 2)
    if plan.lora_dropout > 0:   # peft: nn.Dropout feeds A (nn.Identity when lora_dropout is 0)
        drop = kernels.memory_time_s(gpu, (2 * x_e + 1) * m * k_in)
        fwd, bwd = fwd + drop, bwd + 2 * drop
    return _Pass(fwd, bwd, ops)


def _attention_pass(gpu: GPU, plan: TrainingPlan, model: ModelSpec, tokens: int) -> _Pass:
    """The attention core (scores, softmax, weighted values) of one attention module."""
    prec, s, q = plan.precision, plan.seq_len, model.head_dim
    heads = model.num_attention_heads // plan.tp
    b = tokens / s
    if plan.attention in ("flash", "sdpa") and kernels.has_flash_kernel(gpu, prec):
        # No score matrix in HBM; the counted FLOPs are those of memkit.estimate.flops (4 T H Q s
        # forward, twice that backward, which recomputes the scores: Dao 2023, Sec. 3.1.2).
        # Time of forward + backward at the kernel's rate for this length, split as the kernel's
        # own FLOPs are (kernels.FLASH_BACKWARD_FLOP_RATIO).
        counted = 4.0 * tokens * s * heads * q
        both = kernels.flash_attention_time_s(gpu, prec, 3 * counted, seq_len=s, head_dim=q,
                                              causal=model.kind == "decoder")
        fwd = both / (1 + kernels.FLASH_BACKWARD_FLOP_RATIO)
        return _Pass(fwd, both - fwd, 2)
    # Eager: two batched GEMMs forward (Q K^T, P V), four backward, and the b x heads x s x s score
    # matrix through HBM: scale/mask, softmax (fp32 under autocast: torch autocast op list),
    # dropout, cast (transformers/models/bert/modeling_bert.py eager attention).
    bh = b * heads
    fwd = kernels.gemm_time_s(gpu, prec, s, s, q, batch=bh) + kernels.gemm_time_s(gpu, prec, s, q, s, batch=bh)
    bwd = 2 * fwd
    e = _elt(plan)
    soft = 4 if plan.is_mixed else e
    per_score = e + 2 * e + (e + soft)
    if model.attention_dropout > 0:
        per_score += 2 * soft + 1
    if plan.is_mixed:
        per_score += soft + e
    scores = bh * s * s
    fwd += kernels.memory_time_s(gpu, per_score * scores)
    bwd += kernels.memory_time_s(gpu, 2 * per_score * scores)
    return _Pass(fwd, bwd, 8)


def eager_rmsnorm_bytes(res_bytes: int) -> int:
    """HBM bytes per element of one eager RMSNorm forward, op by op as transformers'
    LlamaRMSNorm.forward (and torchtitan's / litgpt's RMSNorm) run it, each op its own kernel:
    x.to(float32) (r a, w 4; a no-op when x is fp32), pow(2) (r4 w4), mean(-1) (r4), x * rsqrt (r4 w4),
    .to(input dtype) (r4 w a; a no-op for fp32), weight * x (r a w a). LayerNorm is one native
    kernel (aten native_layer_norm: r + w), and so is an RMSNorm under torch.compile, whose Inductor
    fuses the pointwise / reduction chain into one generated kernel (Ansel et al. 2024, "PyTorch 2",
    Sec. 5: TorchInductor's fusion)."""
    casts = 0 if res_bytes == 4 else 2 * (res_bytes + 4)
    return casts + 8 + 4 + 8 + 2 * res_bytes


def gelu_new_bytes(e: int, *, autocast: bool) -> int:
    """HBM bytes per MLP element of GPT-2's eager gelu_new forward (transformers/activations.py
    NewGELUActivation.forward: 0.5 * input * (1.0 + tanh(sqrt(2/pi) * (input + 0.044715 *
    pow(input, 3.0))))), eight kernels: 0.5 * x (r e, w e), pow (x cast to fp32 under autocast,
    pow being on its fp32 list: r e w 4, then r 4 w 4), 0.044715 * (r 4 w 4), x + (r e + 4, w 4),
    sqrt(2/pi) * (8), tanh (8), 1.0 + (8), the product (r e + 4, w 4); the fp32 result is cast back
    to e bytes for c_proj (r 4, w e). Without autocast every op stays at e bytes: six unary ops at
    2e and two binary ones at 3e. One fused kernel (r e + w e) under torch.compile, and for
    gelu_pytorch_tanh (F.gelu(approximate='tanh'))."""
    if autocast:
        return (2 * e) + (e + 12) + 8 + (e + 8) + 8 + 8 + 8 + (e + 8) + (4 + e)
    return 6 * 2 * e + 2 * 3 * e


def eager_fp32_rope_bytes(e: int) -> tuple[int, int]:
    """(forward, backward) HBM bytes per rotated q / k element of torchtune's eager
    RotaryPositionalEmbeddings.forward (torchtune/modules/position_embeddings.py @ 1814feb17; Llama
    3.1/3.2's Llama3ScaledRoPE.forward, torchtune/models/llama3_1/_position_embeddings.py, runs the
    same ops), op by op, each op its own kernel; an fp32 access of stride 2 (xshaped[..., 0]) touches every 32-byte
    DRAM sector of the tensor, so it reads all of it (CUDA C++ Best Practices Guide, "Coalesced
    Access to Global Memory": strided accesses). Per element of x (e bytes):
    forward -- x.float() (r e, w 4); four products xshaped[..., i] * rope_cache[..., j], each a
    strided read of the fp32 tensor and a half-size fp32 write (r 4, w 2: 24); the subtraction and
    the addition, two half-size reads and a half-size write (r 4, w 2: 12); torch.stack (r 4, w 4);
    type_as(x) (r 4, w e): 2e + 52. Backward, autograd's nodes (torch/csrc/autograd derivatives.yaml):
    the cast back to fp32 (r e, w 4); stack's unbind gives strided views; sub's neg (r 4 strided, w 2);
    the four mul backwards, grad * cache (the cache is a buffer: no grad), three of a strided grad
    (r 4, w 2) and one of neg's contiguous output (r 2, w 2): 22; four select_backward, each zeros of
    the full fp32 shape (w 4) and a copy into its strided half (r 2, w 4): 40; three accumulations of
    the four full-size fp32 gradients of xshaped (r 8, w 4: 36); float()'s backward cast (r 4, w e):
    2e + 112. The rope cache has no head dimension ([s, h_d], or a [b, s, h_d] gather by input_pos
    for packed rows: 1/(heads) of the traffic) and is not counted."""
    fwd = (e + 4) + 4 * (4 + 2) + 2 * (4 + 2) + (4 + 4) + (4 + e)
    bwd = (e + 4) + (4 + 2) + (3 * (4 + 2) + (2 + 2)) + 4 * (4 + 2 + 4) + 3 * (8 + 4) + (4 + e)
    return fwd, bwd


def _elementwise_pass(gpu: GPU, plan: TrainingPlan, model: ModelSpec, num_attn: int, tokens: int, *,
                      compiled: bool = False, eager_fp32_rope: bool = False) -> _Pass:
    """Norms, residual adds, activation, dropout, rotary of one block: HBM bytes (roofline); the
    backward reads input and gradient and writes a gradient, about twice the forward traffic.
    The residual stream is in the parameters' dtype: fp32 under torch AMP (the embedding output is
    fp32 and autocast runs layer_norm in fp32, torch autocast op reference), 16-bit when the model
    itself is 16-bit (DeepSpeed fp16/bf16, FSDP MixedPrecision, bf16-pure); matmul outputs and the
    MLP activation are 16-bit under autocast. An eager RMSNorm is a chain of kernels
    (eager_rmsnorm_bytes); compiled: the run uses torch.compile, which fuses it into one.
    eager_fp32_rope: the rotary embedding is torchtune's fp32 eager one (eager_fp32_rope_bytes),
    unless compiled (Inductor fuses it into one kernel, r e + w e, as the default prices it)."""
    h = model.hidden_size / (plan.tp if plan.sequence_parallel else 1)
    i = model.intermediate_size / plan.tp
    res_bytes = 4 if plan.precision == "fp32" or _amp_fp32_weights(plan) else 2
    norm_bytes = (eager_rmsnorm_bytes(res_bytes) if model.norm_type == "rmsnorm" and not compiled
                  else 2 * res_bytes)                    # one fused kernel: r + w
    residual_bytes = (num_attn + 1) * (norm_bytes * h + 3 * h * res_bytes)   # a norm and a residual add (2r+w)
    if model.hidden_dropout > 0:                         # per sub-block; dropout: r + w + 1-byte mask
        residual_bytes += (num_attn + 1) * 2.5 * h * res_bytes
    e = _elt(plan)
    if model.hidden_act == "gelu_new" and not model.gated_mlp and not compiled:
        act_bytes = gelu_new_bytes(e, autocast=numerics(plan).autocast is not None) * i
    else:
        act_bytes = (3 * i if model.gated_mlp else 2 * i) * e   # act(gate) * up, or act(x): one kernel
    rope_fwd = rope_bwd = 0.0
    if model.position_embedding == "rope":
        rotated = (model.num_attention_heads + model.num_key_value_heads) * model.head_dim / plan.tp
        if eager_fp32_rope and not compiled:
            f, b = eager_fp32_rope_bytes(e)
            rope_fwd, rope_bwd = (kernels.memory_time_s(gpu, f * rotated * tokens),
                                  kernels.memory_time_s(gpu, b * rotated * tokens))
        else:
            act_bytes += 2 * rotated * e
    fwd = kernels.memory_time_s(gpu, (residual_bytes + act_bytes) * tokens)
    return _Pass(fwd + rope_fwd, 2 * fwd + rope_bwd, ELEMENTWISE_OPS_PER_BLOCK)


def _block_pass(gpu: GPU, plan: TrainingPlan, model: ModelSpec, linears: tuple[Linear, ...], tokens: int,
                *, early_stop: bool = False, compiled: bool = False, fp32_adapters: bool = False,
                eager_fp32_rope: bool = False) -> tuple[_Pass, _Pass]:
    """(one block's whole pass, its forward alone = what full checkpointing re-runs)."""
    num_attn = max(1, sum(lin.role in ("o", "attn_out") for lin in linears))
    total = _Pass()
    for lin in linears:
        total = total + _linear_pass(gpu, plan, model, lin, tokens, fp32_adapters=fp32_adapters)
    total = total + _attention_pass(gpu, plan, model, tokens).scaled(num_attn)
    total = total + _elementwise_pass(gpu, plan, model, num_attn, tokens, compiled=compiled,
                                      eager_fp32_rope=eager_fp32_rope)
    recompute_s = total.fwd_s
    last = linears[-1] if linears else None
    if early_stop and last is not None and _output_unsaved(plan, model, last):
        recompute_s -= _linear_pass(gpu, plan, model, last, tokens, fp32_adapters=fp32_adapters).fwd_s
    return total, _Pass(recompute_s, 0.0, total.num_ops // 3)


def _output_unsaved(plan: TrainingPlan, model: ModelSpec, last: Linear) -> bool:
    """Whether the block's last linear produces nothing backward needs, so a recompute that stops
    at the last saved tensor (spec/stack.py CHECKPOINT_EARLY_STOP_TORCH) never runs it: a dense
    down projection whose output only meets the residual add (which saves nothing) -- not under a
    post-norm or sandwich norm (the norm saves its input), hidden dropout (its mask is drawn on the
    output), MoE (the routing weights multiply the expert outputs), or a LoRA adapter on it (peft
    runs the base matmul before the adapter, whose input is saved)."""
    return (last.role == "down" and model.block.norm_placement == "pre" and model.hidden_dropout == 0
            and not (plan.is_lora and last.name in plan.lora_targets))


def _head_pass(gpu: GPU, plan: TrainingPlan, model: ModelSpec, tokens: int) -> _Pass:
    """The task's head GEMMs (an LM head, vocab split over TP under loss parallel, at the decoder's
    positions; or a classifier's linears at _head_rows), the cross-entropy over its logits
    (activations.head_logits), the embedding lookup (an encoder-decoder's decoder inputs too)."""
    model = task_spec(model, plan)  # the task's head and lengths (spec/generic.py)
    prec, h = plan.precision, model.hidden_size
    rows = _head_rows(model, plan, tokens)
    if plan.task == "causal-lm":
        width = model.vocab_size // (plan.tp if plan.sequence_parallel else 1)
    else:
        width = max(1, _head_matmul_params(model, plan) // h)
    fwd = kernels.gemm_time_s(gpu, prec, rows, width, h)
    bwd = kernels.gemm_time_s(gpu, prec, rows, h, width)
    if not plan.is_lora or model.lora_saved_params:  # peft trains a classifier's head copy (spec/model.py)
        bwd += kernels.gemm_time_s(gpu, prec, h, width, rows)
    logit_rows, logit_width = (rows, width) if plan.task == "causal-lm" else \
        head_logits(model, plan, max(1, round(tokens / plan.seq_len)))  # seq-cls: one row per sequence
    loss = kernels.memory_time_s(gpu, LOSS_BYTES_PER_LOGIT * logit_rows * logit_width)
    looked_up = tokens * (1 + (_target_share(model, plan) if model.kind == "encoder-decoder" else 0))
    emb = kernels.memory_time_s(gpu, 3 * _elt(plan) * looked_up * h)   # gather forward, scatter-add backward
    return _Pass(fwd + loss / 2 + emb / 3, bwd + loss / 2 + 2 * emb / 3, 8)


LAYER_PASS_PLAN_FIELDS = ("precision", "engine", "zero_stage", "attention", "micro_batch_size", "seq_len",
                          "target_len", "task", "num_labels", "tp", "pp", "sequence_parallel", "lora_rank",
                          "lora_targets", "lora_dropout", "quantize_base")
"""The TrainingPlan fields _layer_passes reads (its passes, numerics, task_spec, head_logits), the
plan's part of its memo key: the planner prices structures that differ only in the other fields
(ZeRO offload, checkpointing, the loss, overlap, data parallelism) at the same micro-batch.
tests/unit/test_estimate_memo.py checks that changing any other field changes nothing."""


def _layer_passes(gpu: GPU, plan: TrainingPlan, model: ModelSpec, tokens: int, *,
                  early_stop: bool = False, compiled: bool = False, fp32_adapters: bool = False,
                  eager_fp32_rope: bool = False) -> tuple[_Pass, float]:
    """(fwd+bwd of the layers this GPU holds, the forward of every block of the model = what full
    checkpointing re-runs) for one micro-batch, before any technique adds its terms
    (estimate/step_terms.py). Memoised on its arguments with the plan's LAYER_PASS_PLAN_FIELDS
    (a pure function of them; the result is frozen)."""
    return _memo_layer_passes(gpu, PlanPart(plan, LAYER_PASS_PLAN_FIELDS), model, tokens, early_stop, compiled,
                              fp32_adapters, eager_fp32_rope)


@lru_cache(maxsize=8192)
def _memo_layer_passes(gpu: GPU, part, model: ModelSpec, tokens: int, early_stop: bool, compiled: bool,
                       fp32_adapters: bool, eager_fp32_rope: bool) -> tuple[_Pass, float]:
    plan = part.plan
    kw = dict(early_stop=early_stop, compiled=compiled, fp32_adapters=fp32_adapters,
              eager_fp32_rope=eager_fp32_rope)
    block, block_fwd = _block_pass(gpu, plan, model, model.layer_linears, tokens, **kw)
    total = block.scaled(model.num_layers)
    fwd_only = block_fwd.scaled(model.num_layers)
    if model.num_encoder_layers:
        enc, enc_fwd = _block_pass(gpu, plan, model, model.encoder_layer_linears, tokens, **kw)
        total = total + enc.scaled(model.num_encoder_layers)
        fwd_only = fwd_only + enc_fwd.scaled(model.num_encoder_layers)
    total = (total + _head_pass(gpu, plan, model, tokens)).scaled(1.0 / plan.pp)
    return total, fwd_only.fwd_s


@dataclass(frozen=True, slots=True)
class _Walk:
    """What the step-time walk needs from estimate/step_terms.py: its StepContext and StepTerms, and
    per phase the methods of STEP_TECHNIQUES it runs, in STEP_TECHNIQUES' order -- each technique's
    own, leaving out the phases it does not override (StepTechnique's are empty, so skipping them
    changes no term)."""

    context: type
    terms: type
    setups: tuple
    computes: tuple
    exposeds: tuple
    exposeds_no_sync: tuple
    """exposeds without the boundary_only techniques' (a no_sync micro-step, _exposed_terms)."""


_WALK: list[_Walk] = []


def _walk() -> _Walk:
    """_Walk, built once. estimate/step_terms.py prices its terms with this module's kernel passes,
    so it is imported when first walked, not at this module's import."""
    if not _WALK:
        from memkit.estimate.step_terms import STEP_TECHNIQUES, StepContext, StepTechnique, StepTerms

        def own(phase: str, techniques) -> tuple:
            return tuple(getattr(t, phase) for t in techniques
                         if getattr(type(t), phase) is not getattr(StepTechnique, phase))
        _WALK.append(_Walk(StepContext, StepTerms, own("setup", STEP_TECHNIQUES), own("compute", STEP_TECHNIQUES),
                           own("exposed", STEP_TECHNIQUES),
                           own("exposed", [t for t in STEP_TECHNIQUES if not t.boundary_only])))
    return _WALK[0]


def _compute_terms(c: "StepContext", t: "StepTerms", **switches) -> None:
    """One micro-batch's compute on `t` (estimate/step_terms.py StepTerms): the techniques' switches
    (`switches` -- early_stop, fp32_adapters -- replace theirs), the layer passes, then what each
    technique adds to the compute and the recompute."""
    walk = _walk()
    for setup in walk.setups:
        setup(c, t)
    for name, value in switches.items():
        setattr(t, name, value)
    t.compute, t.fwd_only_s = _layer_passes(c.gpu, c.plan, c.model, c.tokens, early_stop=t.early_stop,
                                            compiled=c.compiled, fp32_adapters=t.fp32_adapters,
                                            eager_fp32_rope=c.eager_fp32_rope)
    for compute in walk.computes:
        compute(c, t)


def _micro_compute(gpu: GPU, plan: TrainingPlan, model: ModelSpec, tokens: int, *,
                   early_stop: bool = False, compiled: bool = False, fp32_adapters: bool = False
                   ) -> tuple[_Pass, float]:
    """(fwd+bwd of the layers this GPU holds, recompute time) for one micro-batch, with the plan's
    techniques' terms (_compute_terms). early_stop: the checkpoint recompute stops after the
    block's last saved tensor (_output_unsaved); compiled: the run uses torch.compile
    (_elementwise_pass); fp32_adapters: LoRA adapters in fp32 (peft_fp32_adapters)."""
    walk = _walk()
    c = walk.context(model=model, plan=plan, hardware=Hardware(gpu=gpu), gpu=gpu, how=behaviour(None),
                     tokens=tokens, compiled=compiled)
    t = walk.terms()
    _compute_terms(c, t, early_stop=early_stop, fp32_adapters=fp32_adapters)
    return t.compute, t.recompute_s


# ---- communication ----------------------------------------------------------------------------

NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_HOP_LATENCY_S = {"nvlink": 5.7e-6, "pci": 5.7e-6, "net": 6.6e-6}
"""NCCL's own cost model for ring collectives with the Simple protocol (large messages): a base
latency plus one per ring step (n-1 steps for all-gather / reduce-scatter, 2(n-1) for all-reduce);
NVIDIA/nccl src/graph/tuning.cc, baseLat and hwLat tables (Ring / Simple)."""

OVERLAP_COMPUTE_COST = 1 - 1.18 / 2.08
"""Share of an overlapped collective's duration the concurrent compute still loses (0.43): kernels
that run while an NCCL collective runs run slower, measured in a GPT training profile on
A100-SXM4-80GB overlapping an AllGather: a GEMM 1.18 -> 2.08 ms, attention 0.18 -> 0.33 ms,
elementwise 0.02 -> 0.05 ms (NVIDIA/nccl issue #1428, 2024). The mechanism (sjeaugey, NCCL, same
thread and issue #1433): they compete for HBM bandwidth -- a collective at busbw B stores and reads
back 2-3 B of HBM traffic -- on top of the SMs NCCL's one block per channel occupies (src/device/).
The GEMM's figure is used: compute-bound kernels dominate the compute window."""


@dataclass(frozen=True, slots=True)
class _Link:
    gbps: float
    kind: str
    """nvlink | pci | net: which NCCL hop latency applies."""


def _ring_time_s(num_bytes: float, num_ranks: int, link: _Link, *, allreduce: bool, count: float = 1) -> float:
    """`count` ring collectives moving `num_bytes` in all: bandwidth term (all-reduce moves 2(n-1)/n
    of the buffer per rank, reduce-scatter and all-gather (n-1)/n: Patarasuk & Yuan 2009; nccl-tests
    'busbw') plus NCCL's latency per collective."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = (2 if allreduce else 1) * (num_ranks - 1)
    latency = NCCL_BASE_LATENCY_S + steps * NCCL_HOP_LATENCY_S[link.kind]
    return num_bytes * steps / num_ranks / (link.gbps * GB) + max(1.0, count) * latency


def _intra_link(gpu: GPU) -> _Link:
    # PCIe-only cards: the catalog's intra-node bandwidth is a PCIe figure (presets/gpus.json _about).
    return _Link(gpu.intra_node_gbps, "pci" if gpu.intra_node_gbps <= 25 else "nvlink")


def _dp_link(plan: TrainingPlan, hardware: Hardware) -> _Link:
    """DP ranks sit on one node when tp*dp fits in it (ranks ordered tp, dp, pp as in Megatron);
    otherwise the ring crosses the network. NCCL spreads a collective's channels over the NICs of
    the node (all-reduce / all-gather / reduce-scatter aggregate them, all-to-all cannot: sjeaugey,
    NVIDIA/nccl-tests issue #267), so the bus bandwidth is the NICs of the group's ranks on one
    node together, capped by NVLink: 2 A100 nodes with 8 x 100 Gb/s NICs measure 600 Gb/s busbw,
    "roughly matching our expectation" (kwen2501, NVIDIA/nccl issue #495), not one NIC's 100."""
    if hardware.num_nodes == 1 or plan.tp * plan.dp <= hardware.num_gpus_per_node:
        return _intra_link(hardware.gpu)
    ranks_per_node = max(1, min(plan.dp, hardware.num_gpus_per_node // plan.tp))
    return _Link(min(hardware.gpu.intra_node_gbps, hardware.inter_node_gbps * ranks_per_node), "net")


@dataclass(frozen=True, slots=True)
class _Comm:
    micro_s: float = 0.0
    """Exposed every micro-step."""
    boundary_s: float = 0.0
    """Exposed once per optimizer step (accumulation boundary, after the step)."""


def _dp_comm(plan: TrainingPlan, model: ModelSpec, hardware: Hardware, fwd_s: float, bwd_s: float, *,
             reduce_itemsize: int | None = None, backward_prefetch: str = "pre", no_sync: bool = False) -> _Comm:
    """Exposed data-parallel communication. fwd_s/bwd_s: the compute windows it can hide under;
    reduce_itemsize: bytes per gradient element as reduced, where the framework reduces in another
    dtype than the gradient's; backward_prefetch: torch FSDP's BackwardPrefetch (see
    estimate_step_time); no_sync: a micro-step inside torch's no_sync() (estimate_step_time
    no_sync_step), which reduces nothing: DDP skips its all-reduce, FSDP1's _post_backward_hook
    returns before the reduce-scatter and keeps the unsharded gradient, and SHARD_GRAD_OP keeps the
    unsharded parameters between such micro-steps (torch/distributed/fsdp/_runtime_utils.py
    _post_backward_hook, _should_free_in_backward); FULL_SHARD still gathers forward and backward."""
    dp = plan.dp
    if dp <= 1 or (no_sync and plan.zero_stage < 3):
        return _Comm()
    link = _dp_link(plan, hardware)
    shard = plan.tp * plan.pp
    layers = model.total_layers / plan.pp
    n_local = model.num_params / shard
    trainable = _trainable_per_gpu(model, plan)
    e = _grad_bytes(plan)
    grads, params = trainable * (reduce_itemsize or e), n_local * e
    stage, torch_engine = plan.zero_stage, plan.engine == "torch"
    # ZeRO-3 / FSDP gather and reduce one block at a time; ZeRO-1/2 and DDP in buckets
    # (reduce_bucket_size / allgather_bucket_size elements, DDP bucket_cap_mb). Each branch below
    # prices only the collectives its engine and stage run.
    if stage >= 2 and (stage == 3 or torch_engine):   # ZeRO-3 / FSDP FULL_SHARD, FSDP SHARD_GRAD_OP
        ag = _ring_time_s(params, dp, link, allreduce=False, count=layers)
        rs3 = 0.0 if no_sync else _ring_time_s(grads, dp, link, allreduce=False, count=layers)
        one_layer = ag / max(1.0, layers)   # the first gather of a pass cannot be prefetched
    elif stage >= 1:                                   # torch ZeRO-1, DeepSpeed ZeRO-1/2: buckets
        rs = _ring_time_s(grads, dp, link, allreduce=False, count=trainable / plan.reduce_bucket_size)
        ag_after_step = _ring_time_s(trainable * e, dp, link, allreduce=False,
                                     count=trainable / plan.allgather_bucket_size)
    if stage == 3:
        # Params gathered for forward and again for backward, grads reduce-scattered, every micro-step
        # (ZeRO paper Sec. 7.2.2: 3 Psi); FSDP prefetches the next block's gather (forward_prefetch /
        # BACKWARD_PRE) and DeepSpeed its prefetch bucket (stage3.py), so they overlap compute.
        # DeepSpeed reduces on a side stream only with overlap_comm (its default for stage 3,
        # runtime/zero/config.py overlap_comm_valid).
        overlap_rs = torch_engine or plan.overlap_comm
        if torch_engine and backward_prefetch == "post":
            # BACKWARD_POST issues the next block's gather after the current block's gradient
            # computation, which the next gradient computation then waits for: only the current
            # reduce-scatter overlaps compute (torch/distributed/fsdp/api.py, BackwardPrefetch).
            exposed = _overlapped(ag, fwd_s) + ag + _overlapped(rs3, bwd_s) + one_layer
            return _Comm(micro_s=exposed)
        bwd_comm = ag + (rs3 if overlap_rs else 0.0)
        exposed = (_overlapped(ag, fwd_s) + _overlapped(bwd_comm, bwd_s) + 2 * one_layer
                   + (0.0 if overlap_rs else rs3))
        return _Comm(micro_s=exposed)
    if torch_engine:
        if stage == 2:
            # FSDP SHARD_GRAD_OP: params gathered once per micro-step forward and kept for backward;
            # grads reduce-scattered during backward.
            return _Comm(micro_s=_overlapped(ag, fwd_s) + one_layer + _overlapped(rs3, bwd_s))
        # DDP: bucketed all-reduce overlapped with the last micro-step's backward (no_sync before
        # it); the last bucket is always exposed (Li et al. 2020, Sec. 3.2.3).
        last_bucket = _ring_time_s(min(grads, DDP_BUCKET_BYTES), dp, link, allreduce=True)
        if stage == 1:
            return _Comm(boundary_s=_overlapped(rs, bwd_s) + last_bucket + ag_after_step)
        ddp_ar = _ring_time_s(grads, dp, link, allreduce=True, count=grads / DDP_BUCKET_BYTES)
        return _Comm(boundary_s=_overlapped(ddp_ar, bwd_s) + last_bucket)
    # DeepSpeed engine (runtime/zero/stage_1_and_2.py).
    if stage == 0:
        # engine.allreduce_gradients() runs after backward at the boundary: nothing hides it.
        return _Comm(boundary_s=_ring_time_s(grads, dp, link, allreduce=True,
                                             count=trainable / plan.reduce_bucket_size))
    if stage == 1:
        # reduce_gradients() at the accumulation boundary only (is_gradient_accumulation_boundary),
        # on the reduction stream with overlap_comm (default off for stages 1-2), then the updated
        # 16-bit partitions are all-gathered (Sec. 7.2.1: 2 Psi per step).
        exposed_rs = _overlapped(rs, bwd_s) if plan.overlap_comm else rs
        return _Comm(boundary_s=exposed_rs + ag_after_step)
    # Stage 2: partition_gradients -> every micro-step's backward hooks reduce the ipg buckets; on
    # the compute stream (exposed) unless overlap_comm puts them on the reduction stream.
    micro = _overlapped(rs, bwd_s) if plan.overlap_comm else rs
    return _Comm(micro_s=micro, boundary_s=ag_after_step)


def _overlapped(comm_s: float, window_s: float) -> float:
    """Time an overlapped collective adds: what sticks out of the compute window, plus what the
    compute loses to it while both run (OVERLAP_COMPUTE_COST)."""
    return max(0.0, comm_s - window_s) + OVERLAP_COMPUTE_COST * min(comm_s, window_s)


def activation_offload_exposed_s(moved_s: float, *, fwd_s: float, bwd_s: float) -> float:
    """PCIe time of activation offload that a side stream does not hide. torchtune's
    OffloadActivations(use_streams=True) (torchtune/training/_activation_offloading.py) copies each
    saved tensor device->host on its own stream as forward goes on (the compute stream waits only
    for the copy of a tensor it is about to free, one layer behind), and in backward prefetches the
    next layer's tensors host->device on that stream while the current layer's backward runs. Half
    of moved_s (activation_offload_transfer_s: out and back) goes each way; each half costs what
    sticks out of its pass's compute (the copies run on the copy engines, not the SMs)."""
    half = moved_s / 2
    return max(0.0, half - fwd_s) + max(0.0, half - bwd_s)


def _trainable_per_gpu(model: ModelSpec, plan: TrainingPlan) -> float:
    """Trainable parameters one GPU of a tp x pp model shard holds (the adapters alone under LoRA)."""
    return (model.lora_params(plan.lora_rank, plan.lora_targets) if plan.is_lora
            else model.num_params) / (plan.tp * plan.pp)


def zero12_grad_handling(plan: TrainingPlan, model: ModelSpec, gpu: GPU) -> tuple[float, int]:
    """(GPU seconds, dispatched ops) of one pass of DeepSpeed ZeRO-1/2's gradient handling over
    this GPU's trainable tensors (ZERO12_OPS_PER_GRAD): with contiguous_gradients (its default,
    runtime/zero/config.py) each 16-bit gradient is copied into the ipg bucket (read + write) and
    the rank's 1/dp part copied again into grads_in_partition (stage_1_and_2.py
    copy_grads_in_partition). Stage 2 pays it every micro-step, stage 1 once per optimizer step;
    (0, 0) for other engines and stages or with contiguous_gradients off."""
    if plan.engine != "deepspeed" or plan.zero_stage not in (1, 2) or not plan.contiguous_gradients:
        return 0.0, 0
    trainable = _trainable_per_gpu(model, plan)
    e = _grad_bytes(plan)
    copy_s = kernels.memory_time_s(gpu, 2 * e * trainable + 2 * e * trainable / plan.dp)
    return copy_s, _param_tensors(model, plan) * ZERO12_OPS_PER_GRAD


def _param_tensors(model: ModelSpec, plan: TrainingPlan) -> int:
    """Trainable parameter tensors this GPU steps: weights (+ biases) of each block's linears, the
    norms' weights (+ biases), embeddings and head; two per adapted linear under LoRA. Memoised
    on the model and the three plan values it reads, passed as the memo's own arguments."""
    return _memo_param_tensors(model, plan.is_lora, plan.lora_targets, plan.pp)


@lru_cache(maxsize=1024)
def _memo_param_tensors(model: ModelSpec, is_lora: bool, lora_targets: tuple[str, ...], pp: int) -> int:
    total = 0
    for linears, layers in ((model.layer_linears, model.num_layers),
                            (model.encoder_layer_linears, model.num_encoder_layers)):
        if is_lora:
            per_block = 2 * sum(lin.name in lora_targets for lin in linears)
        else:
            norms = max(1, sum(lin.role in ("o", "attn_out") for lin in linears)) + 1
            per_block = (sum(1 + lin.bias for lin in linears)
                         + norms * (2 if model.norm_type == "layernorm" else 1))
        total += layers * per_block
    return total // pp + (0 if is_lora else 3)


# ---- the step -----------------------------------------------------------------------------------

def estimate_step_time(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *,
                       stack: Stack | None = None, reduce_itemsize: int | None = None,
                       backward_prefetch: str = "pre", compiled: bool = False,
                       lora_adapter_dtype: str | None = None, offload_streams: bool = False,
                       hf_checkpointing: bool = False, fused_optimizer: bool = False,
                       chunked_loss_saves_logits: bool = False, eager_fp32_rope: bool = False,
                       no_sync_step: bool = False) -> StepTimeEstimate:
    """`stack`: the versions the run uses (spec/stack.py); None = current behaviour.
    `reduce_itemsize`: bytes per gradient element as data parallelism reduces it, for runs whose
    framework reduces in another dtype than the gradient's (FSDP MixedPrecision reduce_dtype=float32
    under 16-bit params: Composer's 'DEFAULT', torchtitan's default); None = the gradient's dtype,
    which is what memkit's own runs do (Accelerate sets reduce_dtype to the training dtype,
    accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision).
    `backward_prefetch`: torch FSDP's BackwardPrefetch for a fully sharded torch-engine run, "pre"
    (BACKWARD_PRE: torch's and Accelerate's default, and what FSDP2 always does) or "post"
    (BACKWARD_POST: Composer's default, composer/trainer/dist_strategy.py).
    `compiled`: the run wraps the model in torch.compile (fused norms, _elementwise_pass); memkit's
    own runs and the Trainer files it writes are eager.
    `lora_adapter_dtype`: the dtype a LoRA run's adapters are in, where the framework is not peft's
    default (peft_fp32_adapters); None = what memkit's own runs get.
    `offload_streams`: activation offload copies on a side stream that overlaps compute
    (activation_offload_exposed_s: torchtune's); memkit's runner copies on the compute stream.
    `hf_checkpointing`: the run checkpoints through transformers' gradient_checkpointing_enable()
    with its default kwargs, reentrant before transformers 5.0 (spec/stack.py): no early stop.
    memkit's runs and Trainer files pass use_reentrant=False (train/techniques.py, emit/trainer.py).
    `fused_optimizer`: the run builds torch.optim.AdamW(fused=True) (ADAMW_FUSED_PASSES); memkit's
    runner builds the default, foreach one (train/loop.py).
    `chunked_loss_saves_logits`: autograd keeps each chunk's logits, no head recompute (torchtune's
    CEWithChunkedOutputLoss, torchtune/modules/transformer.py @ 1814feb17; step_terms.Loss).
    `eager_fp32_rope`: rotary upcasts q, k to fp32 op by op unless `compiled` (torchtune's
    RotaryPositionalEmbeddings, eager_fp32_rope_bytes); memkit's runs use transformers' in 16 bits.
    `no_sync_step`: the step timed is one micro-batch inside torch's no_sync() and its gradient
    clipping, nothing else (_check_switches): no reduction, no optimizer step."""
    _check_switches(plan, backward_prefetch, no_sync_step)
    walk = _walk()
    gpu = hardware.gpu
    m = plan.grad_accum
    tokens = plan.micro_batch_size * plan.seq_len   # per data-parallel rank and micro-step
    c = walk.context(model=model, plan=plan, hardware=hardware, gpu=gpu, how=behaviour(stack), tokens=tokens,
                     compiled=compiled, offload_streams=offload_streams, hf_checkpointing=hf_checkpointing,
                     lora_adapter_dtype=lora_adapter_dtype, fused_optimizer=fused_optimizer,
                     chunked_loss_saves_logits=chunked_loss_saves_logits, eager_fp32_rope=eager_fp32_rope,
                     no_sync_step=no_sync_step)
    t = walk.terms()
    _compute_terms(c, t)   # the layers' kernels and each technique's compute (estimate/step_terms.py)
    t_fwd, t_bwd, t_recompute = t.compute.fwd_s, t.compute.bwd_s, t.recompute_s
    t_gpu = t_fwd + t_bwd + t_recompute
    ops = int(t.compute.num_ops * (3 + t.recompute_share) / 3)
    micro_copy_s, copy_ops, boundary_copy_s = _zero12_copies(plan, model, gpu)
    t_gpu, ops = t_gpu + micro_copy_s, ops + copy_ops
    t_host = ops * OP_DISPATCH_S

    dp = _dp_comm(plan, model, hardware, t_fwd, t_bwd + t_recompute, reduce_itemsize=reduce_itemsize,
                  backward_prefetch=backward_prefetch, no_sync=no_sync_step)
    _exposed_terms(c, t)
    t_tp = _tp_comm_s(plan, model, hardware, tokens)
    t_zero3 = _zero3_overhead_s(plan, model, stack)
    host_excess = max(0.0, t_host - t_gpu)
    micro = t_gpu + host_excess + t_zero3 + dp.micro_s + t.offload_micro_s + t_tp + t.pp_comm_s

    step = (micro * m * t.bubble + dp.boundary_s + t.offload_boundary_s + boundary_copy_s + t.optimizer_s
            + STEP_OVERHEAD_S)
    components = {
        "compute": (t_fwd + t_bwd) * m,
        "recompute": t_recompute * m,
        "pipeline_bubble": micro * m * (t.bubble - 1.0),
        "dp_comm": dp.micro_s * m + dp.boundary_s,
        "zero_grad_copies": micro_copy_s * m + boundary_copy_s,
        "tp_comm": t_tp * m,
        "pp_comm": t.pp_comm_s * m,
        "offload_transfer": t.offload_micro_s * m + t.offload_boundary_s,
        "optimizer_step": t.optimizer_s,
        "host_overhead": (host_excess + t_zero3) * m + STEP_OVERHEAD_S,
    }
    return _with_flops(model, plan, gpu, step=step, t_gpu=t_gpu, tokens=tokens, components=components)


def _check_switches(plan: TrainingPlan, backward_prefetch: str, no_sync_step: bool) -> None:
    """estimate_step_time's run switches that only some plans can have. no_sync_step: torch's
    no_sync() is DDP's / FSDP1's (torch/nn/parallel/distributed.py, torch/distributed/fsdp/
    fully_sharded_data_parallel.py), and a step with no optimizer step has none to offload or to
    run in backward."""
    if backward_prefetch not in ("pre", "post"):
        raise ValueError(f"backward_prefetch {backward_prefetch!r}: expected 'pre' or 'post'")
    if no_sync_step and (plan.engine != "torch" or plan.optimizer_in_backward or plan.pp > 1
                         or plan.offload_optimizer != "none" or plan.offload_params != "none"):
        raise ValueError("no_sync_step: a torch-engine (DDP / FSDP) plan without pipeline, offload or "
                         "optimizer in backward")


def _zero12_copies(plan: TrainingPlan, model: ModelSpec, gpu: GPU) -> tuple[float, int, float]:
    """(GPU seconds per micro-step, ops per micro-step, seconds at the boundary) of ZeRO-1/2's
    gradient copies (zero12_grad_handling): ZeRO-2 handles every gradient in each micro-step's
    backward, ZeRO-1 once at the boundary; on the compute stream, and its ops are host work like
    any other."""
    grad_copy_s, grad_ops = zero12_grad_handling(plan, model, gpu)
    if plan.zero_stage == 2:
        return grad_copy_s, grad_ops, 0.0
    return 0.0, 0, max(grad_copy_s, grad_ops * OP_DISPATCH_S)


def _exposed_terms(c: "StepContext", t: "StepTerms") -> None:
    """Each technique's time outside the compute (offload traffic, the optimizer step, the
    pipeline), in STEP_TECHNIQUES' order; a no_sync micro-step (StepContext.no_sync_step) skips the
    techniques that run only at an optimizer step (StepTechnique.boundary_only)."""
    walk = _walk()
    for exposed in walk.exposeds_no_sync if c.no_sync_step else walk.exposeds:
        exposed(c, t)


def _tp_comm_s(plan: TrainingPlan, model: ModelSpec, hardware: Hardware, tokens: int) -> float:
    """Seconds per micro-step of tensor-parallel communication."""
    # Tensor parallel (Megatron, Shoeybi et al. 2019, Sec. 3): two all-reduces of the b*s*h
    # activations forward and two backward per block (sequence parallel swaps each for an
    # all-gather + reduce-scatter of the same volume, Korthikanti et al. 2022, Sec. 4.2.2); the
    # recompute forward repeats the forward two. Synchronous.
    if plan.tp <= 1:
        return 0.0
    act = tokens * model.hidden_size * _elt(plan)
    per_block = 4 + 2 * recompute_share(plan, model.total_layers)
    tp_link = _intra_link(hardware.gpu) if plan.tp <= hardware.num_gpus_per_node else _Link(hardware.inter_node_gbps, "net")
    return model.total_layers / plan.pp * per_block * _ring_time_s(act, plan.tp, tp_link, allreduce=True)


def _zero3_overhead_s(plan: TrainingPlan, model: ModelSpec, stack: Stack | None) -> float:
    """Host seconds per micro-step DeepSpeed ZeRO-3 spends fetching and releasing parameters."""
    t_zero3 = 0.0
    if plan.zero_stage == 3 and plan.engine == "deepspeed":
        t_zero3 = model.total_layers / plan.pp * ZERO3_OVERHEAD_S_PER_LAYER
        if behaviour(stack).zero3_debug_strings:   # DeepSpeed < 0.9.4 (ZERO3_DEBUG_CALLS_PER_PARAM)
            per_pass = _param_tensors(model, replace(plan, lora_rank=0))   # every param is fetched, frozen too
            t_zero3 += 2 * per_pass * ZERO3_DEBUG_CALLS_PER_PARAM * OP_DISPATCH_S
    return t_zero3


def _with_flops(model: ModelSpec, plan: TrainingPlan, gpu, *, step: float, t_gpu: float, tokens: int,
                components: dict[str, float]) -> StepTimeEstimate:
    """The step's estimate with its FLOP figures: MFU counts the model's FLOPs, HFU the recompute's
    too (flops.py), both against every GPU's peak."""
    model_fpt, recompute_fpt = flops_per_token(model, plan)
    tokens_step = plan.tokens_per_step
    model_flops_step = model_fpt * tokens_step
    peak = gpu.peak_tflops(plan.precision) * 1e12
    peak_all = peak * plan.num_gpus
    per_gpu_flops = (model_fpt + recompute_fpt) * tokens / (plan.tp * plan.pp)
    return StepTimeEstimate(
        step_time_s=step,
        tokens_per_s=tokens_step / step,
        mfu=model_flops_step / (step * peak_all),
        hfu=(model_fpt + recompute_fpt) * tokens_step / (step * peak_all),
        model_flops_per_step=model_flops_step,
        compute_efficiency=per_gpu_flops / (t_gpu * peak) if t_gpu > 0 else 0.0,
        components_s=components,
    )
