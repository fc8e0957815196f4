"""Model splits, stated once: which split runs with which engine and ZeRO stage, the degree
checks, the rank layout and the pipeline stage split. Torch-free (validation stays instant);
the planner (what it offers), the estimator (what it prices), the runner and launch/ (what they
run) all import this module and restate none of it.

Two sets of rules, on purpose:
  * `split_knob_error` - what a TrainingPlan may describe at all (what memkit can *price*),
    including splits run by other programs (torchtitan's FSDP inside pipeline stages, priced as
    the torch engine with ZeRO-1; DeepSpeed's PipelineEngine, which allows ZeRO 0-1:
    deepspeed/runtime/pipe/engine.py asserts zero_optimization_stage() < 2).
  * `validate_parallel` - what memkit's own runner (launch/finetune.py) *runs*; the planner offers
    only these. Tensor parallel = DeepSpeed AutoTP training (engine deepspeed, ZeRO 0-2: DeepSpeed
    0.19 deepspeed/runtime/engine.py, _configure_tensor_parallel, refuses ZeRO-3), pipeline
    parallel = torch.distributed.pipelining (engine torch, ZeRO 0: the runner keeps whole optimizer
    states per stage), never both in one plan, decoder-only families listed below.

Rank layout: world = dp x pp x tp, tp innermost (DeepSpeed's AutoTP mesh is (data_parallel,
tensor_parallel), deepspeed/utils/groups.py, _init_tp_mesh_device), so a TP group is tp
consecutive ranks on one node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memkit.errors import MemkitError

if TYPE_CHECKING:  # no runtime import: memkit.plan imports this module
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware
    from memkit.spec.model import ModelSpec

# Families whose ForCausalLM is `<base>.embed_tokens -> <base>.layers -> <base>.norm -> lm_head`
# with per-layer masks picked by config.layer_types (transformers 5: models/<family>/modeling_*.py);
# tests/unit/test_parallel_validation.py chains the stages of each and compares with the whole model.
PP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
# Families with separate q/k/v/o and gate/up/down linears that AutoTP shards by name
# (deepspeed/module_inject/auto_tp.py; their configs carry base_model_tp_plan). Fused qkv/gate_up
# (phi3) and MoE experts are left out until a run proves them.
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")

TP_DEGREES = (2, 4, 8, 16)
PP_DEGREES = (2, 4, 8, 16, 32)
"""Degrees the planner tries when the user leaves tp/pp unpinned."""

PRICED_PP_ZERO = (0, 1)
"""ZeRO stages a pipeline plan may be priced with: pipeline schedules keep gradients across
micro-batches, so ZeRO-2/3 gradient partitioning does not apply (DeepSpeed PipelineEngine:
zero_optimization_stage() < 2)."""
PRICED_AUTOTP_ZERO = (0, 1, 2)
"""DeepSpeed AutoTP training supports ZeRO 0-2 (deepspeed/runtime/engine.py)."""

RUN_TP = {"engine": "deepspeed", "tp_engine": "autotp", "zero_stages": (0, 1, 2)}
"""How memkit's runner runs tensor parallel: DeepSpeed AutoTP inside the DeepSpeed engine."""
RUN_PP = {"engine": "torch", "pp_engine": "torch", "pp_schedule": "1f1b", "zero_stages": (0,)}
RUN_TP_PP = {**RUN_PP, "tp_engine": "tp_plan"}
"""How memkit's runner runs tp x pp: the pipeline above with torch tensor parallel (DTensor,
ColwiseParallel/RowwiseParallel: memkit.train.parallel.STAGE_TP_PLAN) inside each stage, as
torchtitan combines them; AutoTP lives inside the DeepSpeed engine, which the pipeline replaces."""
"""How memkit's runner runs pipeline parallel: torch.distributed.pipelining with 1F1B (the
planner's choice; GPipe is accepted when pinned), whole optimizer states per stage (ZeRO-0)."""

SPLIT_LIMITS = ("a tensor-parallel checkpoint resumes on the same tp x dp layout only "
                "(DeepSpeed AutoTP shards are not resharded; pipeline checkpoints are)")
"""What a split run cannot do: tp checkpoints are DeepSpeed engine checkpoints cut by the TP
layout (memkit.train.split_checkpoint); pipeline checkpoints are DCP under the unsplit FQNs and
reshard. `memkit suggest` prints it for tp plans (`split_limits`), the runner refuses a tp resume
on another layout with it."""


def split_limits(plan: "TrainingPlan") -> str:
    """'' or what `plan`'s split run cannot do (SPLIT_LIMITS for AutoTP plans: tp without pp)."""
    return SPLIT_LIMITS if plan.tp > 1 and plan.pp == 1 else ""


# ---- what a plan may describe (priced) ------------------------------------------------------------

def split_knob_error(plan: "TrainingPlan") -> str:
    """'' or why `plan`'s split knobs contradict each other (TrainingPlan.validate raises it)."""
    if plan.sequence_parallel and plan.tp == 1:
        return "sequence parallel shards activations over tensor-parallel ranks; use --tp >= 2"
    if plan.sequence_parallel and plan.tp_engine == "autotp":
        return "DeepSpeed AutoTP has no sequence parallelism; use tp engine tp_plan"
    if plan.tp > 1 and plan.engine == "deepspeed" and plan.tp_engine == "autotp" \
            and plan.zero_stage not in PRICED_AUTOTP_ZERO:
        return "DeepSpeed AutoTP training supports ZeRO 0-2, not 3; use --zero 2 or lower"
    if plan.pp > 1 and plan.zero_stage not in PRICED_PP_ZERO:
        return (f"pipeline parallel with --zero {plan.zero_stage}: pipeline schedules keep "
                "gradients across micro-batches, so only ZeRO 0-1 apply; use --zero 1 or lower")
    return ""


def split_plan(plan: "TrainingPlan") -> "TrainingPlan":
    """`plan` with the engines its split runs on in memkit's runner (RUN_TP / RUN_PP)."""
    if plan.pp > 1 and plan.tp > 1:
        return plan.with_(engine=RUN_TP_PP["engine"], pp_engine=RUN_TP_PP["pp_engine"],
                          pp_schedule=RUN_TP_PP["pp_schedule"], tp_engine=RUN_TP_PP["tp_engine"])
    if plan.pp > 1:
        return plan.with_(engine=RUN_PP["engine"], pp_engine=RUN_PP["pp_engine"], pp_schedule=RUN_PP["pp_schedule"])
    if plan.tp > 1:
        return plan.with_(engine=RUN_TP["engine"], tp_engine=RUN_TP["tp_engine"])
    return plan


def run_zero_stages(tp: int, pp: int) -> tuple[int, ...]:
    """ZeRO stages memkit's runner runs with this split."""
    if pp > 1:
        return RUN_PP["zero_stages"]
    if tp > 1:
        return RUN_TP["zero_stages"]
    return (0, 1, 2, 3)


# ---- degrees ------------------------------------------------------------------------------------

def tp_divides(spec: "ModelSpec", tp: int) -> list[str]:
    """The head / MLP counts tp does not divide ('' list when it divides them all)."""
    return [f"{name}={value}" for name, value in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_key_value_heads),
        ("intermediate_size", spec.intermediate_size)) if value % tp]


def tp_spans_nodes(tp: int, per_node: int) -> bool:
    """The "a TP group stays in one node" rule, stated once (the planner, the degree checks, the
    runner's launched world and launch-script use it): TP all-reduces every layer, so it needs
    NVLink-class links (Shoeybi et al. 2019, Sec. 3), and the rank layout puts tp innermost
    (RankLayout: a TP group is tp consecutive ranks), so the group stays in one node exactly when
    tp divides the processes per node."""
    return tp > 1 and per_node % tp != 0


def tp_choices(spec: "ModelSpec", num_gpus_per_node: int | None = None) -> list[int]:
    """Tensor-parallel degrees (1 included) that divide the heads, the KV heads and the MLP width
    (Megatron-LM column/row splits, Shoeybi et al. 2019, Sec. 3) and, when given, the GPUs of a
    node (TP needs NVLink-class links)."""
    return [1] + [t for t in TP_DEGREES if not tp_divides(spec, t)
                  and (num_gpus_per_node is None or not tp_spans_nodes(t, num_gpus_per_node))]


def pp_choices(spec: "ModelSpec") -> list[int]:
    """Pipeline degrees (1 included) with at least one block per stage."""
    return [1] + [p for p in PP_DEGREES if p <= spec.num_layers]


def bf16_unsupported(precision: str, hardware: "Hardware") -> str | None:
    """What a bf16 precision cannot run on (a GPU without bf16 units: pre-Ampere), or None. The
    hardware-dependent precision rule (estimate and the planner's request ask it before the plan's
    own rules)."""
    if precision in ("bf16", "bf16-pure") and not hardware.gpu.bf16:
        return f"{hardware.gpu.name} has no bf16 support; use --precision fp16 or fp32"
    return None


def check_degrees(spec: "ModelSpec", plan: "TrainingPlan", hardware: "Hardware") -> None:
    """The degree checks: dp*tp*pp against the GPUs, tp against the heads and the node, pp
    against the layers. The estimator prices only plans that pass them."""
    if plan.num_gpus != hardware.num_gpus:
        raise MemkitError(
            f"dp*tp*pp = {plan.dp}*{plan.tp}*{plan.pp} = {plan.num_gpus} but the hardware has "
            f"{hardware.num_gpus} GPUs; choose degrees whose product is {hardware.num_gpus}")
    if plan.tp > 1:
        bad = tp_divides(spec, plan.tp)
        if bad:
            raise MemkitError(f"tp={plan.tp} does not divide {', '.join(bad)}; "
                              f"try tp in {{{','.join(map(str, tp_choices(spec)))}}}")
        if tp_spans_nodes(plan.tp, hardware.num_gpus_per_node) and plan.tp > hardware.num_gpus_per_node:
            raise MemkitError(
                f"tp={plan.tp} spans nodes ({hardware.num_gpus_per_node} GPUs per node); tensor "
                f"parallelism needs NVLink-class links: use tp <= {hardware.num_gpus_per_node}")
    if plan.pp > spec.num_layers:
        raise MemkitError(f"pp={plan.pp} exceeds the model's {spec.num_layers} layers; "
                          f"use pp <= {spec.num_layers}")


def split_families(spec: "ModelSpec", *, lora: bool) -> tuple[bool, bool]:
    """(runner can tensor-split it, runner can pipeline-split it)."""
    splittable = spec.kind == "decoder" and not lora
    return splittable and spec.model_type in TP_MODEL_TYPES, splittable and spec.model_type in PP_MODEL_TYPES


# ---- what memkit's runner runs ------------------------------------------------------------------

def validate_parallel(spec: "ModelSpec", plan: "TrainingPlan", hardware: "Hardware") -> None:
    """Raise MemkitError when the runner cannot run `plan`'s tp/pp on `spec` and `hardware`:
    the degree checks plus a splittable architecture, an engine it drives, TP groups inside a
    node, and a schedule the micro-batches can fill."""
    plan.validate()
    check_degrees(spec, plan, hardware)
    if plan.tp == 1 and plan.pp == 1:
        return
    what = "tp" if plan.tp > 1 else "pp"
    if spec.kind != "decoder":
        raise MemkitError(
            f"{what}={plan.tp if what == 'tp' else plan.pp} on {spec.name} ({spec.kind}, {spec.model_type}): "
            f"memkit splits decoder-only causal LMs only; use tp=1 pp=1 (ZeRO-3 shards any model)")
    if plan.tp > 1 and plan.pp > 1:
        _check_tp_pp(spec, plan, hardware)
    elif plan.tp > 1:
        _check_tp(spec, plan, hardware)
    if plan.pp > 1:
        _check_pp(spec, plan)


def _check_tp_within_node(plan: "TrainingPlan", hardware: "Hardware") -> None:
    """A TP group's all-reduces run every layer: it stays inside one node."""
    if tp_spans_nodes(plan.tp, hardware.num_gpus_per_node):
        raise MemkitError(
            f"tp={plan.tp} does not divide {hardware.num_gpus_per_node} GPUs per node, so some TP groups "
            f"would span nodes; use a tp that divides {hardware.num_gpus_per_node}")


def _check_tp(spec: "ModelSpec", plan: "TrainingPlan", hardware: "Hardware") -> None:
    if spec.model_type not in TP_MODEL_TYPES:
        raise MemkitError(
            f"tp={plan.tp} on model_type {spec.model_type!r}: the runner's tensor parallel (DeepSpeed "
            f"AutoTP) is proven on {', '.join(TP_MODEL_TYPES)}; use tp=1 (ZeRO-3) or pp")
    if plan.tp_engine != RUN_TP["tp_engine"]:
        raise MemkitError(f"tp engine {plan.tp_engine!r} is not run by memkit; use tp_engine 'autotp' "
                          "(DeepSpeed AutoTP training)")
    if plan.engine != RUN_TP["engine"]:
        raise MemkitError(f"tp={plan.tp} with engine {plan.engine!r}: AutoTP runs inside DeepSpeed; "
                          "use engine 'deepspeed'")
    if plan.zero_stage not in RUN_TP["zero_stages"]:
        raise MemkitError(f"tp={plan.tp} with --zero {plan.zero_stage}: DeepSpeed AutoTP training "
                          "supports ZeRO 0-2; use --zero 2 or lower")
    _check_tp_within_node(plan, hardware)
    if plan.offload_optimizer != "none" or plan.offload_params != "none":
        raise MemkitError(f"tp={plan.tp} with offload: memkit runs DeepSpeed AutoTP without ZeRO offload; "
                          "use --offload-optimizer none / --offload-params none or tp=1")
    if plan.is_lora:
        raise MemkitError(f"tp={plan.tp} with LoRA: the runner does not shard peft adapters; "
                          "use tp=1 with --lora-rank, or full fine-tuning with tp")


def _check_tp_pp(spec: "ModelSpec", plan: "TrainingPlan", hardware: "Hardware") -> None:
    if spec.model_type not in TP_MODEL_TYPES:
        raise MemkitError(
            f"tp={plan.tp} x pp={plan.pp} on model_type {spec.model_type!r}: the runner tensor-splits "
            f"{', '.join(TP_MODEL_TYPES)}; use tp=1 with pp, or ZeRO-3")
    if plan.tp_engine != RUN_TP_PP["tp_engine"]:
        raise MemkitError(f"tp={plan.tp} x pp={plan.pp} with tp engine {plan.tp_engine!r}: inside pipeline "
                          "stages memkit runs torch tensor parallel; use tp_engine 'tp_plan'")
    _check_tp_within_node(plan, hardware)
    if plan.sequence_parallel:
        raise MemkitError(f"tp={plan.tp} x pp={plan.pp} with sequence parallel: the runner keeps activations "
                          "replicated inside a TP group; drop sequence_parallel")


def _check_pp(spec: "ModelSpec", plan: "TrainingPlan") -> None:
    if spec.model_type not in PP_MODEL_TYPES:
        raise MemkitError(
            f"pp={plan.pp} on model_type {spec.model_type!r}: the runner splits "
            f"{', '.join(PP_MODEL_TYPES)} into stages; use pp=1 (ZeRO-3) for this model")
    if plan.pp_engine != RUN_PP["pp_engine"]:
        raise MemkitError(f"pp engine {plan.pp_engine!r} is not run by memkit; use pp_engine 'torch' "
                          "(torch.distributed.pipelining)")
    if plan.engine != RUN_PP["engine"]:
        raise MemkitError(f"pp={plan.pp} with engine {plan.engine!r}: the pipeline runs through "
                          "torch.distributed.pipelining, not DeepSpeed; use engine 'torch'")
    if plan.zero_stage not in RUN_PP["zero_stages"]:
        raise MemkitError(f"pp={plan.pp} with --zero {plan.zero_stage}: the runner's pipeline path "
                          "keeps whole optimizer states per stage; use --zero 0")
    if plan.precision == "fp16":
        raise MemkitError(f"pp={plan.pp} with --precision fp16: the pipeline path has no loss scaler; "
                          "use bf16 or fp32")
    if plan.is_lora:
        raise MemkitError(f"pp={plan.pp} with LoRA: the runner does not pipeline peft models; use pp=1")
    if plan.pp_schedule == "1f1b" and plan.grad_accum < plan.pp:
        raise MemkitError(
            f"pp={plan.pp} with 1F1B and --grad-accum {plan.grad_accum}: 1F1B needs at least pp "
            f"micro-batches (torch Schedule1F1B); use --grad-accum >= {plan.pp} or pp_schedule gpipe")


# ---- engines and batch accounting ------------------------------------------------------------------

def deepspeed_data_ranks(plan: "TrainingPlan") -> int:
    """Ranks DeepSpeed counts as data ranks in its batch check. Without an `mpu` (Accelerate
    passes none, nor does memkit's runner), DeepSpeed takes dist.get_world_size() as the
    data-parallel size (deepspeed/runtime/config.py, DeepSpeedConfig.__init__ and
    _batch_assertion), so under AutoTP the tp ranks of a group count too although they see the
    same batch. Accelerate fills the value the same way (accelerate/accelerator.py,
    _prepare_deepspeed: micro x accum x num_processes)."""
    if plan.tp > 1 and plan.tp_engine == "autotp":
        return plan.dp * plan.tp
    return plan.dp


def split_name(plan: "TrainingPlan") -> str:
    """'tensor parallel 2 (DeepSpeed AutoTP)' / 'pipeline parallel 2 (torch.distributed.pipelining, 1F1B)'."""
    if plan.tp > 1 and plan.pp > 1:
        return (f"tensor parallel {plan.tp} x pipeline parallel {plan.pp} (torch DTensor inside "
                f"torch.distributed.pipelining stages, {plan.pp_schedule.upper()})")
    if plan.tp > 1:
        return f"tensor parallel {plan.tp} (DeepSpeed AutoTP)"
    return f"pipeline parallel {plan.pp} (torch.distributed.pipelining, {plan.pp_schedule.upper()})"


def engines(plan: "TrainingPlan") -> dict:
    """Which engine runs each split of `plan` (plan.json's "engines"; None: no such split)."""
    ds = plan.engine == "deepspeed"
    if ds:
        dp = f"DeepSpeed ZeRO-{plan.zero_stage}" + (" (AutoTP data-parallel groups)" if plan.tp > 1 else "")
    elif plan.pp > 1:
        dp = "gradient all-reduce over the pipeline replicas (memkit.train.parallel)"
    else:
        dp = "PyTorch DDP (Accelerate)"
    return {
        "launcher": "accelerate launch, DeepSpeed (ds_config.json)" if ds
        else "accelerate launch, torchrun processes (no DeepSpeed)",
        "data_parallel": dp if plan.dp > 1 else None,
        "tensor_parallel": (f"DeepSpeed AutoTP training, autotp_size {plan.tp} (ds_config.json tensor_parallel)"
                            if plan.tp_engine == "autotp" else
                            f"torch DTensor tensor parallel (column/row-parallel linears), tp {plan.tp}"
                            + (" inside each pipeline stage" if plan.pp > 1 else ""))
        if plan.tp > 1 else None,
        "pipeline_parallel": (f"torch.distributed.pipelining, {plan.pp} stages, "
                              f"{'Schedule1F1B' if plan.pp_schedule == '1f1b' else 'ScheduleGPipe'} over "
                              f"{plan.grad_accum} micro-batches" if plan.pp_engine == "torch"
                              else f"DeepSpeed PipelineModule, {plan.pp} stages") if plan.pp > 1 else None,
    }


# ---- stage split and rank layout --------------------------------------------------------------------

def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Blocks per stage: as even as possible, the remainder on the middle stages so the first
    (embedding, most in-flight micro-batches) and the last (LM head, logits) stay light. The
    estimator prices and the runner cuts the model with these counts."""
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    order = sorted(range(pp), key=lambda k: (k in (0, pp - 1), k))
    for k in order[:extra]:
        counts[k] += 1
    return counts


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    """Where one rank sits in the dp x pp x tp grid (tp innermost)."""

    rank: int
    world_size: int
    dp: int
    pp: int
    tp: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_stage(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def dp_rank(self) -> int:
        """The data shard this rank reads: every rank of a TP group and of a pipeline reads the same."""
        return self.rank // (self.tp * self.pp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_stage == self.pp - 1

    def rank_of(self, *, dp_rank: int, pp_stage: int, tp_rank: int = 0) -> int:
        return (dp_rank * self.pp + pp_stage) * self.tp + tp_rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.dp_rank, "pp_stage": self.pp_stage, "tp_rank": self.tp_rank}


def rank_layout(plan: "TrainingPlan", *, rank: int, world_size: int) -> RankLayout:
    """The layout of `rank`; the one place the degrees are checked against the launched world."""
    if plan.dp * plan.pp * plan.tp != world_size:
        raise MemkitError(
            f"dp*pp*tp = {plan.dp}*{plan.pp}*{plan.tp} = {plan.num_gpus} but {world_size} processes were "
            f"launched; launch {plan.num_gpus} processes or choose degrees whose product is {world_size}")
    return RankLayout(rank=rank, world_size=world_size, dp=plan.dp, pp=plan.pp, tp=plan.tp)
