"""What the planner may choose from: the user's request, its pins, and the plans it spans.

A *structure* is a plan with everything fixed except the micro-batch (and hence gradient
accumulation); search.py finds the largest micro-batch that fits for each structure, because
memory only grows with the micro-batch. Batch arithmetic is exact: micro * accum * dp equals
the requested global batch or the layout is not offered.
"""
from __future__ import annotations

from dataclasses import dataclass

from memkit.errors import MemkitError
from memkit.plan import CHECKPOINTING, OFFLOADS, OPTIMIZERS, PRECISIONS, TrainingPlan
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

REFERENCE_OPTIMIZERS = ("adamw",)
LEAN_OPTIMIZERS = ("adamw-8bit", "adafactor")
"""Tried only when no AdamW plan fits (they change the training numerics); sgd only when pinned."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What the user asked for. None means 'let the planner choose'."""

    model: ModelSpec
    hardware: Hardware
    global_batch_size: int
    """Sequences per optimizer step, across all data-parallel ranks: micro * accum * dp, exactly."""
    seq_len: int
    headroom: float = DEFAULT_HEADROOM
    objective: str = "throughput"
    """'throughput': fastest plan that fits; 'memory': the plan with the lowest per-GPU peak."""
    precision: str | None = None
    optimizer: str | None = None
    zero_stage: int | None = None
    offload_optimizer: str | None = None
    offload_params: str | None = None
    allow_offload: bool = True
    nvme_path: str | None = None
    """NVMe offload is searched only when the user names a path to put it on."""
    checkpointing: str | None = None
    attention: str = "sdpa"
    max_micro_batch: int | None = None
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    tp: int | None = 1
    """Tensor-parallel degree; None searches the degrees that divide the heads and the node."""
    pp: int | None = 1
    """Pipeline-parallel degree; None searches powers of two up to the number of layers."""

    @property
    def budget_bytes(self) -> int:
        return int((1.0 - self.headroom) * self.hardware.gpu.memory_bytes)

    def validate(self) -> "Request":
        self.hardware.validate()
        gpu = self.hardware.gpu
        if self.global_batch_size < 1:
            raise MemkitError(f"--global-batch-size {self.global_batch_size} must be a positive integer")
        if self.seq_len < 1:
            raise MemkitError(f"--seq-len {self.seq_len} must be a positive integer")
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
        if self.precision is not None and self.precision not in PRECISIONS:
            raise MemkitError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.precision in ("bf16", "bf16-pure") and not gpu.bf16:
            raise MemkitError(f"--precision {self.precision}: {gpu.name} has no bf16 support; "
                              "use --precision fp16 or fp32")
        if self.precision == "bf16-pure" and self.zero_stage == 0:
            raise MemkitError("--precision bf16-pure with --zero 0: DeepSpeed keeps bf16 master weights "
                              "only under ZeRO 1-3 (bf16_master_weights_and_grads); use --zero 1 or higher")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise MemkitError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.checkpointing is not None and self.checkpointing not in CHECKPOINTING:
            raise MemkitError(f"--checkpointing {self.checkpointing!r} is not one of {', '.join(CHECKPOINTING)}")
        for flag, value in (("--offload-optimizer", self.offload_optimizer), ("--offload-params", self.offload_params)):
            if value is not None and value not in OFFLOADS:
                raise MemkitError(f"{flag} {value!r} is not one of {', '.join(OFFLOADS)}")
            if value not in (None, "none") and not self.allow_offload:
                raise MemkitError(f"{flag} {value} contradicts --no-offload; drop one of them")
            if value == "nvme" and not self.nvme_path:
                raise MemkitError(f"{flag} nvme needs --nvme-path DIR (a local NVMe mount on every node)")
        if self.lora_rank < 0:
            raise MemkitError(f"--lora-rank {self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        if self.lora_rank and not set(self.lora_targets) & set(model.linear_names()):
            raise MemkitError(f"--lora-targets {','.join(self.lora_targets)} match no linear of {model.name}; "
                              f"its linears: {', '.join(model.linear_names())}")
        num_gpus = self.hardware.num_gpus
        if self.tp is not None:
            if self.tp < 1 or self.hardware.num_gpus_per_node % self.tp:
                raise MemkitError(f"--tp {self.tp} must divide the {self.hardware.num_gpus_per_node} GPUs per node "
                                  "(tensor parallelism stays inside a node)")
            if model.num_attention_heads % self.tp or model.num_key_value_heads % self.tp:
                ok = [t for t in (1, 2, 4, 8, 16) if model.num_attention_heads % t == 0
                      and model.num_key_value_heads % t == 0]
                raise MemkitError(f"--tp {self.tp} does not divide num_attention_heads="
                                  f"{model.num_attention_heads} / num_key_value_heads={model.num_key_value_heads}; "
                                  f"try --tp in {{{','.join(map(str, ok))}}}")
            if self.tp > 1 and self.lora_rank:
                raise MemkitError("--tp > 1 with --lora-rank: LoRA plans are data-parallel only; use --tp 1")
        if self.pp is not None:
            if self.pp < 1 or num_gpus % (self.pp * (self.tp or 1)):
                raise MemkitError(f"--pp {self.pp} (x --tp {self.tp or 1}) must divide the {num_gpus} GPUs")
            if self.pp > model.total_layers:
                raise MemkitError(f"--pp {self.pp} exceeds the {model.total_layers} layers of {model.name}")
            if self.pp > 1 and self.lora_rank:
                raise MemkitError("--pp > 1 with --lora-rank: LoRA plans are data-parallel only; use --pp 1")
        # Contradictory pins: let TrainingPlan.validate() say it in its own words. Unpinned ZeRO
        # takes the first stage the other pins allow.
        error = None
        for zero in ([self.zero_stage] if self.zero_stage is not None else [0, 1, 2, 3]):
            probe = TrainingPlan(
                precision=self.precision or ("bf16" if gpu.bf16 else "fp16"),
                optimizer=self.optimizer or "adamw", zero_stage=zero,
                offload_optimizer=self.offload_optimizer or "none",
                offload_params=self.offload_params or "none",
                checkpointing=self.checkpointing or "none", attention=self.attention,
                seq_len=self.seq_len, lora_rank=self.lora_rank, lora_targets=self.lora_targets,
                tp=self.tp or 1, pp=self.pp or 1, dp=1)
            try:
                probe.validate()
                break
            except MemkitError as exc:
                error = exc
        else:
            raise error
        return self

    def hardware_dict(self) -> dict:
        """The hardware part of the request, as plan.json records it."""
        hw = self.hardware
        return {"gpu": hw.gpu.name, "gpu_memory_bytes": hw.gpu.memory_bytes,
                "num_gpus_per_node": hw.num_gpus_per_node, "num_nodes": hw.num_nodes,
                "host_ram_bytes_per_node": hw.host_ram_bytes_per_node,
                "nvme_bytes_per_node": hw.nvme_bytes_per_node, "inter_node_gbps": hw.inter_node_gbps}


@dataclass(frozen=True, slots=True)
class Tier:
    """Plans of one numerical fidelity. The planner moves to the next tier only if nothing fits."""

    name: str
    precisions: tuple[str, ...]
    optimizers: tuple[str, ...]


def tiers(request: Request) -> list[Tier]:
    """Reference tier: AdamW with mixed precision or fp32 (what a model is normally fine-tuned
    with). Lean tier: pure bf16 and the memory-lean optimizers, tried only if nothing else fits."""
    gpu = request.hardware.gpu
    ref_prec = ("bf16", "fp32") if gpu.bf16 else ("fp16", "fp32")
    lean_prec = ("bf16-pure",) if gpu.bf16 else ()
    precs = (request.precision,) if request.precision else None
    opts = (request.optimizer,) if request.optimizer else None
    reference = Tier("reference", precs or ref_prec, opts or REFERENCE_OPTIMIZERS)
    lean = Tier("memory-lean", precs or ref_prec + lean_prec, opts or REFERENCE_OPTIMIZERS + LEAN_OPTIMIZERS)
    if precs and opts:
        return [reference]
    return [reference, lean]


def layouts(request: Request) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) with dp dividing the global batch; MemkitError when none does."""
    model, hw = request.model, request.hardware
    num_gpus = hw.num_gpus
    if request.tp is not None:
        tps = [request.tp]
    elif request.lora_rank:
        tps = [1]
    else:
        tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.num_gpus_per_node and hw.num_gpus_per_node % t == 0
               and model.num_attention_heads % t == 0 and model.num_key_value_heads % t == 0]
    if request.pp is not None:
        pps = [request.pp]
    elif request.lora_rank or model.kind != "decoder":
        pps = [1]
    else:
        pps = [p for p in (1, 2, 4, 8, 16, 32) if p <= model.num_layers]
    every = [(t, p, num_gpus // (t * p)) for t in tps for p in pps if num_gpus % (t * p) == 0]
    good = [(t, p, dp) for t, p, dp in every if request.global_batch_size % dp == 0]
    if not good:
        raise MemkitError(_batch_message(request.global_batch_size, sorted({dp for _, _, dp in every})))
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


def micro_batch_options(request: Request, dp: int) -> tuple[int, ...]:
    """Micro-batch sizes that divide the per-rank batch exactly (no silent flooring)."""
    per_rank = request.global_batch_size // dp
    cap = request.max_micro_batch or per_rank
    return tuple(m for m in range(1, min(per_rank, cap) + 1) if per_rank % m == 0)


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
    ckpts = [request.checkpointing] if request.checkpointing else ["none", "full"]
    accum = request.global_batch_size // dp
    out: list[TrainingPlan] = []
    for precision in tier.precisions:
        for optimizer in tier.optimizers:
            for zero in zeros:
                if precision == "bf16-pure" and zero == 0:
                    continue  # DeepSpeed keeps bf16 master weights only under ZeRO 1-3
                for off_opt, off_par in _offload_combos(request, zero):
                    for overlap in ((True, False) if zero in (1, 2) else (zero == 3,)):
                        for ckpt in ckpts:
                            plan = TrainingPlan(
                                precision=precision, optimizer=optimizer, zero_stage=zero,
                                offload_optimizer=off_opt, offload_params=off_par, checkpointing=ckpt,
                                attention=request.attention, micro_batch_size=1, grad_accum=accum,
                                seq_len=request.seq_len, dp=dp, tp=tp, pp=pp,
                                lora_rank=request.lora_rank, lora_targets=request.lora_targets,
                                overlap_comm=overlap, **buckets)
                            try:
                                plan.validate()
                            except MemkitError:
                                continue
                            out.append(plan)
    return out


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
    if plan.checkpointing != "none":
        parts.append("ckpt")
    if plan.tp > 1:
        parts.append(f"tp{plan.tp}")
    if plan.pp > 1:
        parts.append(f"pp{plan.pp}")
    if plan.zero_stage in (1, 2) and not plan.overlap_comm:
        parts.append("no-overlap")
    parts.append(f"micro {plan.micro_batch_size} x accum {plan.grad_accum}")
    return " ".join(parts)
