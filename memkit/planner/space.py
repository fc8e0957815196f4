"""What the planner may choose from: the user's request, its pins, and the plans it spans.

A *structure* is a plan with everything fixed except the micro-batch (and hence gradient
accumulation); search.py finds the largest micro-batch that fits for each structure, because
memory only grows with the micro-batch. Batch arithmetic is exact: micro * accum * dp equals
the requested global batch or the layout is not offered.

Model splits are offered only as the runner (launch/finetune.py) runs them; memkit/plan/parallel.py
states those rules (engines, ZeRO stages, degrees, families) and this module only enumerates
what they allow; tp * pp * dp = GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass, make_dataclass

from memkit.errors import MemkitError
from memkit.planner import backward
from memkit.plan.parallel import (bf16_unsupported, pp_choices, run_zero_stages, split_families, split_plan, tp_choices,
                                  tp_spans_nodes, validate_parallel)
from memkit.plan.plan import (EIGHT_BIT_OPTIMIZERS, MAX_MICRO_BATCH, TrainingPlan, bf16_pure_needs_zero, knob_fields, pin_flags,
                              request_knob_fields)
from memkit.spec.hardware import Hardware
from memkit.spec.model import ModelSpec

DEFAULT_HEADROOM = 0.10
"""Share of device memory the planner leaves unused. The estimate is for the steady state of the
batch shape asked for; real runs exceed it: the caching allocator fragments more after hours
than in the first steps (PyTorch 'CUDA semantics' notes on memory management and
expandable_segments exist for this), variable-length batches change activation sizes step to
step, and evaluation / checkpoint saving add short spikes. 10% of an 80 GB card is 8 GB, of a
24 GB card 2.4 GB - about what those effects take in practice. --headroom overrides it."""

OBJECTIVES = ("throughput", "memory")
SPLIT_MODES = ("if-needed", "auto")
"""When unpinned tp/pp > 1 are chosen: 'if-needed' only when no data-parallel plan of the tier
fits; 'auto' also when faster than the best data-parallel plan by more than the step-time
model's uncertainty (estimate.throughput.step_time_uncertainty). Never to meet the batch arithmetic."""

ALLOWS = ("qlora", "8bit-optimizer")
"""--allow: techniques that change what is trained, which the planner tries only when pinned
(--quantize-base nf4, --optimizer adamw-8bit) or allowed: a 4-bit base (QLoRA; frozen weights
stored in 4 bits, memkit/plan/quantize.py) and an 8-bit optimizer (bitsandbytes AdamW8bit, its states
quantised blockwise: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", Sec. 2).
LoRA is never added: it is trained only when --lora-rank asks for it."""

REFERENCE_OPTIMIZERS = ("adamw",)
LEAN_OPTIMIZERS = ("adamw-8bit", "adafactor")
"""Tried only when no AdamW plan fits (they change the training numerics); sgd only when pinned."""


_RequestKnobs = make_dataclass("_RequestKnobs", request_knob_fields(), frozen=True, slots=True, kw_only=True)
"""The plan knobs a request carries, derived from TrainingPlan's declarations (memkit/plan/plan.py): a
pin per searched knob (None: the planner chooses; checkpointing None: none, then the smallest
number of checkpointed blocks K that fits, then full; loss None: standard and chunked;
offload_activations None: none and cpu where offloading is allowed, planner/backward.py;
quantize_base None: with LoRA and --allow qlora a 4-bit NF4 base only when no 16-bit-base plan fits
without offloading, search.py QUANTIZED_TIER; tp None: among the degrees that divide the heads,
the KV heads, the MLP width and the GPUs per node; pp None: powers of two up to the layers;
optimizer_in_backward True: only plain-PyTorch one-GPU plans that step in backward) and the
workload knobs the planner does not search (seq_len, attention, the LoRA adapters)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(_RequestKnobs):
    """What the user asked for: the workload, the pins (None means 'let the planner choose') and
    what only a request has."""

    model: ModelSpec
    hardware: Hardware
    global_batch_size: int
    """Sequences per optimizer step, across all data-parallel ranks: micro * accum * dp, exactly."""
    headroom: float = DEFAULT_HEADROOM
    objective: str = "throughput"
    """'throughput': fastest plan that fits; 'memory': the plan with the lowest per-GPU peak."""
    allow_offload: bool = True
    nvme_path: str | None = None
    """NVMe offload is searched only when the user names a path to put it on."""
    max_micro_batch: int | None = None
    split: str = "auto"
    """How unpinned tp/pp are chosen: 'if-needed' (data parallel unless nothing else fits) or
    'auto' (also when the step-time model says a split is clearly faster). SPLIT_MODES."""
    allow: tuple[str, ...] = ()
    """--allow: of ALLOWS, the model-changing techniques the planner may choose unpinned."""

    @property
    def budget_bytes(self) -> int:
        return int((1.0 - self.headroom) * self.hardware.gpu.memory_bytes)

    def validate(self) -> "Request":
        """The request-only checks (the hardware, batch arithmetic, headroom, objective, offload
        permission, --allow, the split's fit to the GPUs); every plan rule is TrainingPlan.validate's
        (and, for a pinned split, memkit.plan.parallel.validate_parallel's), asked of a probe plan."""
        self.hardware.validate()
        gpu = self.hardware.gpu
        if self.global_batch_size < 1:
            raise MemkitError(f"--global-batch-size {self.global_batch_size} must be a positive integer")
        model = self.model
        if model.position_embedding == "learned" and self.seq_len > model.max_position_embeddings:
            raise MemkitError(
                f"--seq-len {self.seq_len} exceeds {model.name}'s {model.max_position_embeddings} learned "
                f"positions; use --seq-len {model.max_position_embeddings} or less")
        if not 0.0 <= self.headroom < 0.9:
            raise MemkitError(f"--headroom {self.headroom:.0%} must be between 0% and 90%")
        if self.objective not in OBJECTIVES:
            raise MemkitError(f"--objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if self.max_micro_batch is not None and self.max_micro_batch < 1:
            raise MemkitError(f"--max-micro-batch {self.max_micro_batch} must be >= 1")
        if self.precision is not None and (error := bf16_unsupported(self.precision, self.hardware)):
            raise MemkitError(f"--precision {self.precision}: {error}")
        for flag, value in (("--offload-optimizer", self.offload_optimizer), ("--offload-params", self.offload_params)):
            if value not in (None, "none") and not self.allow_offload:
                raise MemkitError(f"{flag} {value} contradicts --no-offload; drop one of them")
            if value == "nvme" and not self.nvme_path:
                raise MemkitError(f"{flag} nvme needs --nvme-path DIR (a local NVMe mount on every node)")
        for name in self.allow:
            if name not in ALLOWS:
                raise MemkitError(f"--allow {name!r} is not one of {', '.join(ALLOWS)}")
        if self.lora_rank > 0 and not set(self.lora_targets) & set(model.linear_names()):
            raise MemkitError(f"--lora-targets {','.join(self.lora_targets)} match no linear of {model.name}; "
                              f"its linears: {', '.join(model.linear_names())}")
        backward_error = backward.request_error(self)
        if backward_error:
            raise MemkitError(backward_error)
        num_gpus = self.hardware.num_gpus
        if self.split not in SPLIT_MODES:
            raise MemkitError(f"split mode {self.split!r} is not one of {', '.join(SPLIT_MODES)}")
        if self.tp is not None and (self.tp < 1 or tp_spans_nodes(self.tp, self.hardware.num_gpus_per_node)):
            raise MemkitError(f"--tp {self.tp} must divide the {self.hardware.num_gpus_per_node} GPUs per node "
                              "(tensor parallelism stays inside a node)")
        if self.pp is not None and (self.pp < 1 or num_gpus % (self.pp * (self.tp or 1))):
            raise MemkitError(f"--pp {self.pp} (x --tp {self.tp or 1}) must divide the {num_gpus} GPUs")
        if (self.pp or 1) > 1:
            per_rank_max = self.global_batch_size // (num_gpus // (self.pp * (self.tp or 1)))
            if per_rank_max < self.pp:
                raise MemkitError(
                    f"--pp {self.pp} with --global-batch-size {self.global_batch_size}: the 1F1B pipeline "
                    f"needs at least {self.pp} micro-batches per step on each of the "
                    f"{num_gpus // (self.pp * (self.tp or 1))} pipelines; use --global-batch-size >= "
                    f"{self.pp * (num_gpus // (self.pp * (self.tp or 1)))}")
        # The plan rules: TrainingPlan.validate() (and, for a pinned split, memkit.plan.parallel.validate_parallel)
        # say them in their own words, of a plan with the pins and the workload. Unpinned ZeRO takes the
        # first stage the other pins allow.
        tp, pp = self.tp or 1, self.pp or 1
        error = None
        for zero in ([self.zero_stage] if self.zero_stage is not None else list(run_zero_stages(tp, pp))):
            probe = split_plan(TrainingPlan(
                **workload_knobs(self), **_probe_pins(self), zero_stage=zero,
                precision=self.precision or ("bf16" if gpu.bf16 else "fp16"),
                tp=tp, pp=pp, dp=max(1, num_gpus // (tp * pp)), grad_accum=pp,
                **quantized_knobs(self.quantize_base or "none", self.double_quant)))
            try:
                probe.validate(num_blocks=model.total_layers)
                break
            except MemkitError as exc:
                error = exc
        else:
            raise error
        if tp > 1 or pp > 1:
            validate_parallel(model, probe, self.hardware)
        return self


_NOT_PROBED = ("precision", "zero_stage", "tp", "pp", "quantize_base", "double_quant", "offload_activations",
               "optimizer_in_backward")
"""Pins the probe plan sets itself (or, for the backward techniques, planner/backward.py checks)."""


def _probe_pins(request: Request) -> dict:
    """The request's given pins that the probe plan takes as they are."""
    return {f.name: getattr(request, f.name) for f in knob_fields("pin")
            if f.name not in _NOT_PROBED and getattr(request, f.name) is not None}


def workload_knobs(request: Request) -> dict:
    """The plan knobs the request fixes and the planner does not search (seq_len, attention, the
    LoRA adapters): every plan it offers has them (memkit/plan/plan.py, the "workload" knobs)."""
    return {f.name: getattr(request, f.name) for f in knob_fields("workload")}


def default_lora_targets(model: ModelSpec) -> tuple[str, ...]:
    """The q/v attention projections under the model's own names (peft's defaults,
    peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), else its first
    nn.Linear of a block: not a bare parameter ('conv1d.weight', 'experts.gate_up_proj', which peft's
    LoRA cannot wrap) nor the LM head -- Mamba's in_proj."""
    names = model.linear_names()
    for pair in (("q_proj", "v_proj"), ("q", "v"), ("query", "value"), ("c_attn",),
                 ("query_key_value",), ("qkv_proj",), ("Wqkv",)):
        if all(n in names for n in pair):
            return pair
    linears = [n for n in names if "." not in n and n != "lm_head"]
    return tuple((linears or names)[:1])


@dataclass(frozen=True, slots=True)
class Tier:
    """Plans of one numerical fidelity. The planner moves to the next tier only if nothing fits."""

    name: str
    precisions: tuple[str, ...]
    optimizers: tuple[str, ...]
    quantize_base: str = "none"
    """'nf4' / 'fp4': every plan of the tier has a 4-bit base (memkit/plan/quantize.py)."""


def tiers(request: Request) -> list[Tier]:
    """Reference tier: AdamW with mixed precision or fp32 (what a model is normally fine-tuned
    with). Lean tier: pure bf16 and the memory-lean optimizers, tried only if nothing else fits."""
    gpu = request.hardware.gpu
    ref_prec = ("bf16", "fp32") if gpu.bf16 else ("fp16", "fp32")
    lean_prec = ("bf16-pure",) if gpu.bf16 else ()
    precs = (request.precision,) if request.precision else None
    opts = (request.optimizer,) if request.optimizer else None
    pinned_q = request.quantize_base if request.quantize_base not in (None, "none") else "none"

    reference = Tier("reference", precs or ref_prec, opts or REFERENCE_OPTIMIZERS, pinned_q)
    lean = Tier("memory-lean", precs or ref_prec + lean_prec, opts or REFERENCE_OPTIMIZERS + LEAN_OPTIMIZERS, pinned_q)
    out = [reference] if precs and opts else [reference, lean]
    if request.quantize_base is None and request.lora_rank > 0 and "qlora" in request.allow:
        # search.py: only if 16-bit bases need offload
        # AdamW only: LoRA's optimizer states are too small for a lean optimizer to matter
        out.append(Tier(QUANTIZED_TIER, precs or ref_prec, opts or REFERENCE_OPTIMIZERS, "nf4"))
    return out


def _split_degrees(request: Request) -> tuple[list[int], list[int]]:
    """Degrees the runner can split this model into (memkit.plan.parallel)."""
    can_tp, can_pp = split_families(request.model, lora=bool(request.lora_rank))
    tps = tp_choices(request.model, request.hardware.num_gpus_per_node) if can_tp else [1]
    pps = pp_choices(request.model) if can_pp else [1]
    return tps, pps


def layouts(request: Request) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) with dp dividing the global batch and, under a pipeline, at least pp
    micro-batches per step (1F1B); tp > 1 with pp > 1 only when both are pinned.
    MemkitError when none meets the batch, or (tp/pp unpinned) when data parallelism over every
    GPU does not: batch arithmetic alone is no reason to split the model."""
    num_gpus = request.hardware.num_gpus
    tps, pps = _split_degrees(request)
    tps = [request.tp] if request.tp is not None else tps
    pps = [request.pp] if request.pp is not None else pps
    both_pinned = request.tp is not None and request.pp is not None  # tp x pp only on purpose
    every = [(t, p, num_gpus // (t * p)) for t in tps for p in pps
             if num_gpus % (t * p) == 0 and (t == 1 or p == 1 or both_pinned)]
    good = [(t, p, dp) for t, p, dp in every
            if request.global_batch_size % dp == 0 and request.global_batch_size // dp >= p]
    if not good:
        raise MemkitError(_batch_message(request.global_batch_size, sorted({dp for _, _, dp in every})))
    unpinned = request.tp is None and request.pp is None
    if unpinned and (1, 1, num_gpus) not in good:
        # A model split is for memory or speed, not to make the batch arithmetic work behind the
        # user's back: say which global batches data parallelism meets, and how to split on purpose.
        others = sorted({dp for _, _, dp in good})
        raise MemkitError(_batch_message(request.global_batch_size, [num_gpus])
                          + (f"; or split the model on purpose with --tp N / --pp N (data-parallel "
                             f"degrees {', '.join(map(str, others))})" if others else ""))
    return good


def _batch_message(global_batch: int, dps: list[int]) -> str:
    near = set()
    for dp in dps:
        below = (global_batch // dp) * dp
        near.update(x for x in (below, below + dp) if x >= dp)
    nearby = sorted(near, key=lambda x: (abs(x - global_batch), x))[:4]
    ranks = " or ".join(str(d) for d in dps)
    return (f"--global-batch-size {global_batch} cannot be met exactly: micro x accum x data-parallel "
            f"ranks ({ranks}) never equals it; nearby achievable global batches: "
            f"{', '.join(map(str, sorted(nearby)))}")


def micro_batch_options(request: Request, dp: int, pp: int = 1) -> tuple[int, ...]:
    """Micro-batch sizes that divide the per-rank batch exactly (no silent flooring); under a
    pipeline, only those leaving at least pp micro-batches (torch Schedule1F1B needs them)."""
    per_rank = request.global_batch_size // dp
    cap = min(request.max_micro_batch or MAX_MICRO_BATCH, MAX_MICRO_BATCH, per_rank)
    return tuple(m for m in divisors_up_to(per_rank, cap) if per_rank // m >= pp)


def divisors_up_to(n: int, cap: int) -> list[int]:
    """The divisors of n that are <= cap, ascending, in time independent of n: trial division
    by p <= min(cap, sqrt(rest)) (a prime factor above cap is in no divisor <= cap; a rest with no
    factor <= its square root is prime), then every product of the prime powers that stays <= cap."""
    primes: list[tuple[int, int]] = []
    rest, p = n, 2
    while p <= cap and p * p <= rest:
        if rest % p == 0:
            count = 0
            while rest % p == 0:
                rest //= p
                count += 1
            primes.append((p, count))
        p += 1 if p == 2 else 2
    if 1 < rest <= cap:
        primes.append((rest, 1))
    divisors = [1]
    for prime, count in primes:
        divisors = [d * prime**k for d in divisors for k in range(count + 1) if d * prime**k <= cap]
    return sorted(divisors)


def _offload_combos(request: Request, zero: int) -> list[tuple[str, str]]:
    if zero == 0:
        combos = [("none", "none")]
    elif zero in (1, 2):
        combos = [("none", "none"), ("cpu", "none")]
    else:
        combos = [("none", "none"), ("cpu", "none"), ("cpu", "cpu")]
        if request.nvme_path:
            combos += [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")]
    if not request.allow_offload:
        combos = [("none", "none")]
    if request.offload_optimizer is not None:
        combos = [c for c in combos if c[0] == request.offload_optimizer]
    if request.offload_params is not None:
        if zero == 3 and request.offload_params != "none" and request.offload_optimizer in (None, "none"):
            combos.append(("none", request.offload_params))  # parameter offload alone, if pinned so
        combos = [c for c in combos if c[1] == request.offload_params]
    return combos


def bucket_sizes(model: ModelSpec, hardware: Hardware) -> dict:
    """ZeRO buffer sizes (elements), chosen for the memory they cost on this GPU.

    transformers' auto-fill (integrations/deepspeed.py, trainer_config_finalize) sets
    reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 * hidden^2 and
    stage3_param_persistence_threshold = 10 * hidden; we use those, capped so that the buffers
    overlap_comm keeps (4.5x the bucket sizes, DeepSpeed config docs, 'overlap_comm') cost at most
    2% of the device, and DeepSpeed's own 5e8 ceiling. stage3_max_live_parameters /
    max_reuse_distance default to 1e9 (2 GB of 16-bit params); on small cards that is capped at 5%
    of the device, but never below the largest module, which ZeRO-3 must gather whole.
    """
    hidden = model.hidden_size
    device = hardware.gpu.memory_bytes
    cap = int(0.02 * device / (2 * 4.5))
    bucket = int(max(1_000_000, min(hidden * hidden, cap, 500_000_000)))
    live = int(max(model.largest_module_params, min(1_000_000_000, 0.05 * device / 2)))
    return {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(max(1_000_000, min(0.9 * hidden * hidden, cap))),
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_max_live_parameters": live,
        "stage3_max_reuse_distance": live,
    }


def structures(request: Request, tier: Tier, layout: tuple[int, int, int]) -> list[TrainingPlan]:
    """Every valid plan of this tier and layout, at micro-batch 1 (search.py varies it)."""
    tp, pp, dp = layout
    buckets = bucket_sizes(request.model, request.hardware)
    zeros = [request.zero_stage] if request.zero_stage is not None else [0, 1, 2, 3]
    zeros = [z for z in zeros if z in run_zero_stages(tp, pp)]  # memkit.plan.parallel: what the runner runs
    quantized = quantized_knobs(tier.quantize_base, request.double_quant)
    if quantized:  # memkit/plan/quantize.py: plain PyTorch / DDP, nothing offloaded
        zeros = [z for z in zeros if z == 0]
    # Partial checkpointing (K blocks) is searched from each 'full' plan that fits (search.py
    # finds the smallest K); the chunked loss is a structure of its own (memkit/plan/techniques.py).
    # Selective checkpointing only when pinned: its recompute (elementwise, memory-bound ops) is
    # not priced by the step-time model, which would take it for free.
    ckpts = [request.checkpointing] if request.checkpointing else ["none", "full"]
    losses = [request.loss] if request.loss else (["standard", "chunked"] if tp * pp == 1 else ["standard"])
    accum = request.global_batch_size // dp
    out: list[TrainingPlan] = []
    for precision in tier.precisions:
        for optimizer in tier.optimizers:
            for zero in zeros:
                if bf16_pure_needs_zero(TrainingPlan(precision=precision, zero_stage=zero, **quantized)):
                    continue  # memkit/plan/plan.py states the rule
                combos = _offload_combos(request, zero) if not quantized else [("none", "none")]
                for off_opt, off_par in combos:
                    for overlap in ((True, False) if zero in (1, 2) else (zero == 3,)):
                        for ckpt, loss in ((c, lo) for c in ckpts for lo in losses):
                            plan = TrainingPlan(
                                precision=precision, optimizer=optimizer, zero_stage=zero,
                                offload_optimizer=off_opt, offload_params=off_par, checkpointing=ckpt,
                                loss=loss, micro_batch_size=1, grad_accum=accum, dp=dp, tp=tp, pp=pp,
                                **workload_knobs(request), overlap_comm=overlap, **buckets, **quantized)
                            for plan in backward.variants(request, split_plan(plan)):
                                if pin_conflict(request, plan) is not None:
                                    continue  # pins are law: a plan differing from one is never offered
                                try:
                                    plan.validate()
                                    if tp * pp > 1:
                                        validate_parallel(request.model, plan, request.hardware)
                                except MemkitError:
                                    continue
                                out.append(plan)
    return out


PIN_FLAGS = pin_flags()
"""Request field -> the suggest flag that pins the plan field of the same name (memkit/plan/plan.py
declares the pins and their order)."""


def pins(request: Request) -> list[tuple[str, str, object]]:
    """(flag as typed, plan field, value) of every pin of `request`: the flags a user gave that fix
    a plan field (suggest's "pins" group; --lora-rank fixes lora_rank, --max-micro-batch bounds
    the micro-batch, --no-offload fixes both offloads to none)."""
    out = []
    for field_name, flag in PIN_FLAGS.items():
        value = getattr(request, field_name)
        if value is not None:
            out.append((f"{flag} {value}", field_name, value))
    if request.attention != "sdpa":
        out.append((f"--attention {request.attention}", "attention", request.attention))
    if request.optimizer_in_backward:
        out.append(("--optimizer-in-backward", "optimizer_in_backward", True))
    if not request.allow_offload:
        out += [("--no-offload", "offload_optimizer", "none"), ("--no-offload", "offload_params", "none")]
    if request.max_micro_batch is not None:
        out.append((f"--max-micro-batch {request.max_micro_batch}", "micro_batch_size", request.max_micro_batch))
    if request.lora_rank:
        out.append((f"--lora-rank {request.lora_rank}", "lora_rank", request.lora_rank))
    return out


def pin_conflict(request: Request, plan: TrainingPlan) -> str | None:
    """The first pin `plan` does not honour, as the user typed it; None: it honours all."""
    for flag, field_name, value in pins(request):
        got = getattr(plan, field_name)
        if (got > value) if field_name == "micro_batch_size" else (got != value):
            return flag
    return None


def unasked(request: Request, plan: TrainingPlan) -> str | None:
    """The --allow value `plan` would need (ALLOWS): a model-changing technique neither pinned nor
    allowed. Such a plan is estimated (its miss still explains what fits) but never chosen or
    offered (search.py); None: nothing unasked."""
    if plan.is_quantized and request.quantize_base is None and "qlora" not in request.allow:
        return "qlora"
    if plan.optimizer in EIGHT_BIT_OPTIMIZERS and request.optimizer is None and "8bit-optimizer" not in request.allow:
        return "8bit-optimizer"
    return None


QUANTIZED_TIER = "quantized-base"
"""The tier of 4-bit-base LoRA plans the planner adds for an unpinned LoRA request (search.py)."""


def quantized_knobs(quantize_base: str, double_quant: bool) -> dict:
    """Plan fields of a 4-bit base ({} for none): memkit/plan/quantize.py runs them on plain PyTorch."""
    if quantize_base == "none":
        return {}
    return {"quantize_base": quantize_base, "double_quant": double_quant, "engine": "torch"}


def with_micro(plan: TrainingPlan, micro: int) -> TrainingPlan:
    per_rank = plan.micro_batch_size * plan.grad_accum
    return plan.with_(micro_batch_size=micro, grad_accum=per_rank // micro)


def describe(plan: TrainingPlan) -> str:
    """One-line label: 'ZeRO-3 opt->cpu bf16 ckpt micro 2 x accum 8'."""
    parts = [f"ZeRO-{plan.zero_stage}"]
    if plan.offload_optimizer != "none":
        parts.append(f"opt->{plan.offload_optimizer}")
    if plan.offload_params != "none":
        parts.append(f"params->{plan.offload_params}")
    parts.append(plan.precision)
    if plan.optimizer != "adamw":
        parts.append(plan.optimizer)
    if plan.is_lora:
        parts.append(f"LoRA r{plan.lora_rank}")
    if plan.is_quantized:
        parts.append(f"{plan.quantize_base} base")
    if plan.checkpointing == "full":
        parts.append("ckpt")
    elif plan.checkpointing == "selective":
        parts.append("selective ckpt")
    elif plan.checkpointing != "none":
        parts.append(f"ckpt {plan.checkpointing} blocks")
    if plan.loss != "standard":
        parts.append(f"{plan.loss} loss")
    if plan.offload_activations != "none":
        parts.append(f"acts->{plan.offload_activations}")
    if plan.optimizer_in_backward:
        parts.append("torch opt-in-backward")
    if plan.tp > 1:
        parts.append(f"tp{plan.tp}")
    if plan.pp > 1:
        parts.append(f"pp{plan.pp}")
    if plan.zero_stage in (1, 2) and not plan.overlap_comm:
        parts.append("no-overlap")
    parts.append(f"micro {plan.micro_batch_size} x accum {plan.grad_accum}")
    return " ".join(parts)
