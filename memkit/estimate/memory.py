"""Per-GPU peak memory of one TrainingPlan: the maximum over phases, not one sum.

Phases (steady state, i.e. the second optimizer step, once optimizer states exist):
- init: weights and engine buffers after the engine wraps the model (ZeRO-3 assumes zero.Init,
  which Accelerate enables with `zero3_init_flag`);
- forward: resident states + every block's saved activations + the loss's fp32 logits;
- backward: walked block by block from the last: activations shrink while gradients grow
  (PyTorch frees a node's saved tensors when its backward has run);
- optimizer_step: resident states + gradients + the step's temporaries;
- checkpoint_save: resident states + one gathered block (ZeRO-3 16-bit consolidation).

The moments of two steps (the second reuses the first's cached blocks) are replayed as tensor
allocations and frees through a model of PyTorch's caching allocator (allocator.py, replay.py):
allocated = the replay's max_memory_allocated (the phase walk's peak plus 512-byte rounding and
unsplit remainders), reserved = its max_memory_reserved. On CPU the allocator does not cache, so
both equal the phase walk's peak. nvidia-smi adds what lives outside the allocator (cuda_extras.py:
CUDA context, NCCL communicator buffers).
"""
from __future__ import annotations

import hashlib
import marshal
import math
from dataclasses import replace
from functools import lru_cache

from memkit.errors import MemkitError
from memkit.estimate.activations import block_activations, head_logits, loss_path_bytes, numerics
from memkit.estimate.allocator import AllocatorConfig, capacity_binds, replay, replay_on_device
from memkit.estimate.backward_techniques import offloaded_activation_bytes
from memkit.estimate.bounds import QUANTILE_LABEL, margin, uncovered_kinds
from memkit.estimate.cuda_extras import cublas_workspace_bytes, outside_allocator_bytes
from memkit.estimate.replay import moment_events
from memkit.estimate.result import MemoryEstimate
from memkit.estimate.stage_terms import StageContext, Terms, in_flight, stage_terms
from memkit.estimate.states import BNB_PAGED_MIN_NUMEL, RankParams, model_states
from memkit.estimate.techniques import head_grad_lands_early, loss_component
from memkit.plan.parallel import check_degrees, stage_layers
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware
from memkit.spec.generic import task_spec
from memkit.spec.model import ModelSpec
from memkit.spec.stack import EAGER_KERNEL_IMAGES_BYTES, Stack, behaviour
from memkit.plan.techniques import partial_blocks_error
from memkit.units import GIB

# Host RAM a training process takes besides tensors (Python, torch/CUDA libraries, DeepSpeed,
# the tokenizer and data loader): ~3 GiB RSS per CUDA process.
HOST_BYTES_PER_PROCESS = 3 * GIB
DS_SUB_GROUP_SIZE = 1_000_000_000
PHASES = ("init", "forward", "backward", "optimizer_step", "checkpoint_save")


def check_parallel(spec: ModelSpec, plan: TrainingPlan, hardware: Hardware) -> None:
    """What the estimator needs before pricing: the degree checks (memkit.plan.parallel, their one
    home), a GPU that has the precision, and positions for the sequence."""
    check_degrees(spec, plan, hardware)
    partial = partial_blocks_error(plan.checkpointing, spec.total_layers)
    if partial:
        raise MemkitError(partial)
    if plan.precision in ("bf16", "bf16-pure") and not hardware.gpu.bf16:
        raise MemkitError(f"{hardware.gpu.name} has no bf16 support; use --precision fp16 or fp32")
    if plan.seq_len > spec.max_position_embeddings and spec.position_embedding == "learned":
        raise MemkitError(
            f"--seq-len {plan.seq_len} exceeds {spec.name}'s learned positions "
            f"(max_position_embeddings={spec.max_position_embeddings}); use --seq-len <= "
            f"{spec.max_position_embeddings}")


def estimate_memory(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *,
                    device: str = "cuda", stack: Stack | None = None,
                    margins: dict[str, float] | None = None, capacity_bytes: int | None = None) -> MemoryEstimate:
    """Peak memory per GPU for `plan` (the worst pipeline stage). `device='cpu'` prices the CPU
    test runs: no foreach optimizer temporaries, no CUDA context, no caching allocator.
    `stack`: the versions the run uses (spec/stack.py); None = current behaviour. `margins`: the
    upper-bound margins per kind of plan (default: the published-runs table). `capacity_bytes`:
    the device memory the allocator may use (default: all of it; the planner passes its budget,
    so that "fits" means the caching allocator never runs out inside the budget)."""
    stages = estimate_stages(model, plan, hardware, device=device, stack=stack, capacity_bytes=capacity_bytes)
    worst = max(stages, key=lambda s: s.allocated_peak_bytes)
    if plan.pp > 1:
        notes = worst.notes + (f"pipeline stage {stages.index(worst)} of {plan.pp} has the largest peak",)
        worst = replace(worst, notes=notes)
    return with_upper_bounds(worst, plan, device=device, table=margins, model=model)


def with_upper_bounds(est: MemoryEstimate, plan: TrainingPlan, *, device: str = "cuda",
                      table: dict[str, float] | None = None, basis: str = "",
                      model: ModelSpec | None = None, variable_length: bool = False) -> MemoryEstimate:
    """`est` with its upper bounds: + the QUANTILE margin for each figure (estimate/bounds.py;
    `table` overrides the published one, e.g. with a local profile's). A plan of a kind no
    calibration framework covers (bounds.uncovered_kinds of `model` and `plan`) gets the wider
    UNCOVERED_MARGIN from the published table, and the basis says why. On CPU the allocator does
    not cache and memkit is exact to a few %: the bounds equal the prediction."""
    priced = device == "cuda" or table is not None
    uncovered = uncovered_kinds(model, plan, variable_length=variable_length) if priced and table is None else ()
    m = margin(plan, table, figure="nvidia_smi", uncovered=uncovered) if priced else 0.0  # reserved and nvidia-smi
    m_alloc = margin(plan, table, figure="allocated", uncovered=uncovered) if priced else 0.0
    if not basis and table is None:
        from memkit.estimate.residuals_table import LOFO_COVERAGE, LOFO_WORST_FOLD, NUM_ROWS
        basis = (f"{QUANTILE_LABEL} of under-prediction on {NUM_ROWS} published GPU runs, pooled by "
                 f"figure: allocated +{m_alloc:.0%}, reserved/nvidia-smi +{m:.0%}; covers "
                 f"{LOFO_COVERAGE:.0%} of a left-out framework's runs (worst fold {LOFO_WORST_FOLD[0]} "
                 f"{LOFO_WORST_FOLD[1]:.0%})") if device == "cuda" else "CPU: exact replay"
        if uncovered:
            basis = (f"the largest under-prediction on {NUM_ROWS} published GPU runs: allocated +{m_alloc:.0%}, "
                     f"reserved/nvidia-smi +{m:.0%}, because no calibration framework covers "
                     + "; ".join(uncovered))
    notes = tuple(n for n in est.notes if not n.startswith("near the edge"))
    if device == "cuda" and est.nvidia_smi_peak_bytes * (1 + m) > est.device_total_bytes >= est.nvidia_smi_peak_bytes:
        notes = notes + (f"near the edge: the upper bound ({est.nvidia_smi_peak_bytes * (1 + m) / GIB:.1f} GiB) "
                         f"exceeds the device ({est.device_total_bytes / GIB:.1f} GiB)",)
    reserved_upper = int(est.reserved_peak_bytes * (1 + m))
    # allocated never exceeds reserved (the allocator's blocks lie in its segments), so neither do their bounds
    # (the allocated residuals' largest, UNCOVERED_MARGIN, can exceed the cached one)
    allocated_upper = int(est.allocated_peak_bytes * (1 + m_alloc))
    if device == "cuda":
        allocated_upper = min(allocated_upper, max(reserved_upper, est.allocated_peak_bytes))
    return replace(est, allocated_peak_upper_bytes=allocated_upper,
                   reserved_peak_upper_bytes=reserved_upper,
                   nvidia_smi_peak_upper_bytes=int(est.nvidia_smi_peak_bytes * (1 + m)),
                   upper_margin=round(m, 4), upper_basis=basis, notes=notes)


def estimate_stages(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *,
                    device: str = "cuda", stack: Stack | None = None,
                    capacity_bytes: int | None = None) -> list[MemoryEstimate]:
    """One estimate per pipeline stage (a single one without pipeline parallelism). Stages that
    differ only in index share a computation: what matters is (blocks, in-flight micro-batches,
    first, last)."""
    return _per_stage(model, plan, hardware,
                      lambda m, k: _stage(m, plan, hardware, k, device, stack, capacity_bytes))


def _per_stage(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, price) -> list:
    """`price(model, stage)` of every pipeline stage, after the checks every estimate makes; stages
    with the same (blocks, in-flight micro-batches, first, last) share one call."""
    plan.validate()
    hardware.validate()
    model = task_spec(model, plan)  # the task's head and lengths (spec/generic.py)
    check_parallel(model, plan, hardware)
    counts = stage_layers(model.total_layers, plan.pp)
    cache: dict[tuple, object] = {}
    out = []
    for k in range(plan.pp):
        key = (counts[k], in_flight(plan, k), k == 0, k == plan.pp - 1)
        if key not in cache:
            cache[key] = price(model, k)
        out.append(cache[key])
    return out


def peak_floor_bytes(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *, device: str = "cuda",
                     stack: Stack | None = None) -> int:
    """A lower bound of estimate_memory(...).nvidia_smi_peak_bytes without the allocator replay:
    the largest phase-walk peak of any stage plus the bytes outside the allocator. It holds by
    construction (_stage): a stage's allocated peak is max(replayed, phase-walk peak), reserved is
    at least allocated, nvidia-smi is reserved + the outside bytes (the same for every stage), and
    the estimate reports the stage with the largest allocated peak. The planner rejects a plan
    whose floor is over its budget without replaying it (planner/search.py _Evaluator.fails);
    tests/unit/test_memory_floor.py checks floor <= exact on a grid of plans. MemkitError as the
    estimate raises it."""
    return peak_floor_and_host(model, plan, hardware, device=device, stack=stack)[0]


def peak_floor_and_host(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *, device: str = "cuda",
                        stack: Stack | None = None) -> tuple[int, int | None, int | None]:
    """(peak_floor_bytes, host_bytes_per_node, nvme_bytes_per_node): the floor, and for a plan of one
    stage (pp = 1) the estimate's own host and NVMe bytes, which come from the same terms (_stage,
    _host_nvme), not from the replay; None for both with pp > 1, where the estimate reports the stage
    with the largest replayed peak."""
    def walked_peak(m: ModelSpec, k: int) -> tuple[int, _PhaseWalk, ModelSpec]:
        *_, walk, totals = _walk(m, plan, hardware, k, device, stack)
        return max(totals.values()), walk, m

    stages = _per_stage(model, plan, hardware, walked_peak)
    peak, walk, m = max(stages, key=lambda s: s[0])
    floor = int(peak + _outside_bytes(walk.c))
    if plan.pp > 1:
        return floor, None, None
    return (floor, *_host_nvme(m, plan, hardware, walk.t.st, device))


def _host_nvme(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, st, device: str) -> tuple[int, int]:
    """(host RAM, NVMe) bytes per node of one stage's estimate, from its model states `st`."""
    host = _host_bytes(model, plan, hardware, st) + (
        offloaded_activation_bytes(model, plan, device=device) * hardware.num_gpus_per_node)
    # managed (paged) optimizer states can all migrate to the host under pressure (states.py BNB_PAGED_MIN_NUMEL)
    host += st.managed_optimizer_states * hardware.num_gpus_per_node
    return int(host), int(st.nvme * hardware.num_gpus_per_node)


def rank_params(model: ModelSpec, plan: TrainingPlan, stage: int = 0) -> RankParams:
    """Parameters held by one rank of pipeline stage `stage` after the tensor split."""
    tp = plan.tp
    counts = stage_layers(model.total_layers, plan.pp)
    n_layers = counts[stage]
    first, last = stage == 0, stage == plan.pp - 1
    # Megatron splits attention/MLP weights (column/row); norms and routers stay whole
    # (Shoeybi et al. 2019, Sec. 3).
    split = sum(lin.num_params for lin in model.layer_linears if lin.tp_style != "replicate")
    layer = model.layer_params - split + split // tp
    if model.num_encoder_layers:
        enc_split = sum(lin.num_params for lin in model.encoder_layer_linears if lin.tp_style != "replicate")
        enc_layer = model.encoder_layer_params - enc_split + enc_split // tp
        avg_layer = (layer * model.num_layers + enc_layer * model.num_encoder_layers) // model.total_layers
    else:
        avg_layer = layer
    params = n_layers * avg_layer
    head_params = model.head_params
    if tp > 1 and not model.tie_word_embeddings and model.kind == "decoder":
        # AutoTP training column-splits an untied LM head and gathers the logits
        # (deepspeed/module_inject/auto_tp.py, training LM-head replacement).
        lm_head = model.vocab_size * model.hidden_size
        head_params = head_params - lm_head + lm_head // tp
    if first:
        params += model.embedding_params
    if last:
        params += head_params
        if plan.pp > 1 and model.tie_word_embeddings:
            params += model.vocab_size * model.hidden_size  # the last stage keeps its own copy
    if plan.is_lora:
        lora_layer = model.lora_params(plan.lora_rank, plan.lora_targets) // model.total_layers
        # a classifier's head: peft trains a full copy of it beside the frozen original (spec/model.py)
        saved_head = model.lora_saved_params if last else 0
        trainable = lora_layer * n_layers + saved_head
        params += trainable
        layer_trainable, head_trainable = lora_layer, saved_head
    else:
        trainable = params
        layer_trainable = avg_layer
        head_trainable = (head_params if last else 0) + (model.embedding_params if first else 0)
    largest_tensor = max([model.vocab_size * model.hidden_size if (first or last) else 0]
                         + [lin.in_features * lin.out_features // (tp if lin.tp_style != "replicate" else 1)
                            for lin in model.layer_linears])
    embed = model.embedding_params if first else 0
    head = head_params if last else 0
    persistent = n_layers * _small_params(model) if not plan.is_lora else 0
    return RankParams(num_params=params, num_trainable=trainable, block_params=n_layers * avg_layer,
                      largest_module=max(avg_layer, embed, head), largest_tensor=largest_tensor,
                      num_persistent=persistent, layer_trainable=layer_trainable,
                      head_trainable=head_trainable,
                      paged_trainable=_paged_trainable(model, plan, n_layers, trainable))


def _paged_trainable(model: ModelSpec, plan: TrainingPlan, n_layers: int, trainable: int) -> int:
    """Trainable parameters in tensors of >= BNB_PAGED_MIN_NUMEL elements (states.py), per tensor:
    a LoRA adapter's A (r x in) and B (out x r) of each hand-modelled targeted linear; for full
    fine-tuning every trainable parameter but the blocks' norms and biases (_small_params). A traced
    model's adapters (linear_in_out gives only sums) count as small: priced inside the allocator."""
    if not plan.is_lora:
        return max(0, trainable - n_layers * _small_params(model))
    r, targets = plan.lora_rank, set(plan.lora_targets)
    per_layer = 0
    for lin in model.layer_linears:
        if lin.name in targets:
            per_layer += lin.count * sum(n for n in (r * lin.in_features, r * lin.out_features)
                                         if n >= BNB_PAGED_MIN_NUMEL)
    return per_layer * n_layers


def _small_params(model: ModelSpec) -> int:
    """Per block, parameters outside the linears' weights (norms, biases): below ZeRO-3's
    default persistence threshold of 1e5 elements for most models."""
    weights = sum(lin.count * lin.in_features * lin.out_features for lin in model.layer_linears)
    return max(0, model.layer_params - weights)


def _stage(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str,
           stack: Stack | None = None, capacity_bytes: int | None = None,
           trace: dict | None = None) -> MemoryEstimate:
    """One stage's estimate: each technique sets its terms (estimate/stage_terms.py), the phase
    walk adds them up, the replay prices the allocator. `trace`, when given, receives the replay's
    inputs (timeline, chunks, streams, the bytes outside the allocator, and the slice of the
    timeline that is one steady-state step) for estimate/varlen.py, which strings steps of several
    shapes together."""
    c, t, technique_notes, phases, moments, first_grads, walk, totals = _walk(model, plan, hardware, stage, device,
                                                                             stack, fresh=trace is not None)
    peak_phase = max(PHASES, key=lambda p: totals[p])
    components = {k: int(v) for k, v in phases[peak_phase].items() if v}
    stats, outside = _replayed(walk, phases, moments, first_grads, capacity_bytes, trace)
    allocated = max(stats.allocated_peak_bytes, totals[peak_phase])
    reserved = max(stats.reserved_peak_bytes, allocated)
    if allocated > totals[peak_phase]:  # 512-byte rounding and unsplit remainders (allocator.py)
        components["allocator_rounding"] = allocated - totals[peak_phase]
    host, nvme = _host_nvme(model, plan, hardware, t.st, device)
    # A paged optimizer's managed states (states.py BNB_PAGED_MIN_NUMEL) stay on the device as far as
    # it has room beside the allocator's pool and the context; the driver migrates the rest to the host.
    managed = t.st.managed_optimizer_states
    resident = min(managed, max(0, hardware.gpu.memory_bytes - reserved - outside))
    lora = model.lora_params(plan.lora_rank, plan.lora_targets) + model.lora_saved_params if plan.is_lora else 0
    return MemoryEstimate(
        allocated_peak_bytes=int(allocated), reserved_peak_bytes=int(reserved),
        nvidia_smi_peak_bytes=int(reserved + outside + resident),
        device_total_bytes=hardware.gpu.memory_bytes,
        num_params=model.num_params + lora, num_trainable_params=lora if plan.is_lora else model.num_params,
        peak_phase=peak_phase, components=components, phases={k: int(v) for k, v in totals.items()},
        host_bytes_per_node=host, nvme_bytes_per_node=nvme,
        notes=tuple([*c.habits.notes, *technique_notes]))


def _walk(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str,
          stack: Stack | None, *, fresh: bool = False):
    """_walked, through _recent_walk unless `fresh` (a trace hands the walk's dicts on) or the spec
    is traced (its activations read spec.extra, which ModelSpec's hash and == leave out)."""
    if fresh or model.traced:
        return _walked(model, plan, hardware, stage, device, stack)
    return _recent_walk(model, plan, hardware, stage, device, stack)


@lru_cache(maxsize=16)
def _recent_walk(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str,
                 stack: Stack | None):
    """_walked, remembered for the last few stages: the planner takes a plan's peak floor
    (peak_floor_and_host) and, where the floor does not decide, its estimate right after, and both
    walk the same stage. On these paths the walk's dicts are only read."""
    return _walked(model, plan, hardware, stage, device, stack)


def _walked(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str,
            stack: Stack | None):
    """One stage's terms and phase walk, before the replay: (context, terms, the techniques' notes,
    each phase's breakdown, the backward's moments, their first-micro-batch gradients, the walk,
    each phase's total)."""
    habits = behaviour(stack)
    rp = rank_params(model, plan, stage)
    c = StageContext(model=model, plan=plan, hardware=hardware, stage=stage, device=device, habits=habits,
                     rp=rp, num=numerics(plan), first=stage == 0, last=stage == plan.pp - 1,
                     n_layers=stage_layers(model.total_layers, plan.pp)[stage],
                     blk=block_activations(model, plan, device=device))
    t, technique_notes = stage_terms(c, model_states(plan, rp, device=device,
                                                     fp32_adapters=habits.fp32_lora_adapters))
    walk = _PhaseWalk(c, t)
    phases, moments, first_grads = walk.phases()
    workspace = cublas_workspace_bytes(hardware.gpu) if device == "cuda" else 0
    if workspace:  # allocated through the caching allocator at the first matmul, kept for the run
        for parts in [*phases.values(), *moments]:
            if parts:
                parts["cublas_workspace"] = workspace
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    return c, t, technique_notes, phases, moments, first_grads, walk, totals


def _outside_bytes(c: StageContext) -> int:
    """What the process holds on the device outside the caching allocator (cuda_extras.py); 0 on CPU."""
    if c.device != "cuda":
        return 0
    eager = EAGER_KERNEL_IMAGES_BYTES if c.habits.eager_module_loading else 0
    return outside_allocator_bytes(c.plan, c.hardware, context_bytes=c.hardware.gpu.cuda_context_bytes + eager,
                                   eager_nvls=c.habits.eager_nvls)


class _PhaseWalk:
    """The moments of one stage's step, each a breakdown of what is live, from the techniques'
    terms; a phase's peak is its largest moment."""

    def __init__(self, c: StageContext, t: Terms):
        self.c, self.t = c, t
        blk, n_layers = c.blk, c.n_layers
        # Hybrid stacks (Jamba: Mamba and attention blocks) give each block's own saved bytes and
        # backward temporaries (estimate/activations.py BlockActivations.layers); others, the mean.
        self.layers = blk.layers if len(blk.layers) == n_layers else ()
        self.full_block = blk.saved_bytes + t.autocast_copy
        st = t.st
        self.base = {"weights": st.weights, "master_weights": st.master_weights,
                     "optimizer_states": st.optimizer_states}
        prefix = "deepspeed_" if c.plan.engine == "deepspeed" else ""
        self.base.update({prefix + name: value for name, value in st.buffers.items()})
        self.base["pipeline_buffers"] = t.pipe.held_bytes
        self.base.update(t.quantized)  # weights_4bit, quant_state
        if c.device == "cpu":  # a CPU run "offloads" into the same memory the tracker measures
            self.base.update({f"offloaded_{name}": value for name, value in st.host.items()})
        self.in_backward = {prefix + name: value for name, value in st.backward_buffers.items()}
        self.in_reduction = {prefix + name: value for name, value in st.reduction_buffers.items()}
        # what every backward moment starts from (_block_backward), merged once: the same keys in
        # the same order as merging them at each moment
        self.recompute_base = {**self.base, **self.in_backward}
        self.backward_base = {**self.base, **self.in_backward, **self.in_reduction}

    def kept_one(self, j: int) -> int:
        """Bytes kept by blocks 0..j-1 of one micro-batch: the first k_ckpt keep only their inputs
        (plus, under selective checkpointing, their matmul / attention outputs)."""
        t, layers = self.t, self.layers
        if layers and j <= self.c.n_layers:
            return min(j, t.k_ckpt) * t.ckpt_kept + sum(saved + t.autocast_copy for saved, _t in layers[t.k_ckpt:j])
        return min(j, t.k_ckpt) * t.ckpt_kept + max(0, j - t.k_ckpt) * self.full_block

    def on_gpu_below(self, j: int) -> int:
        """... of every in-flight micro-batch, on the GPU."""
        return self.kept_one(j) * self.t.in_flight if self.t.kept_on_gpu else 0

    def grads_after(self, num_layers_done: int, held: bool | None = None) -> int:
        """Gradients live once the loss and `num_layers_done` blocks have run their backward."""
        t, rp = self.t, self.c.rp
        grads_end = t.st.gradients
        if not t.st.gradients_grow or (t.accum_full if held is None else held) or grads_end == 0:
            return grads_end
        share = grads_end / rp.num_trainable if rp.num_trainable else 0
        landed = rp.head_trainable * self.c.last + num_layers_done * rp.layer_trainable
        return int(min(rp.num_trainable, landed) * share)

    def phases(self) -> tuple[dict[str, dict[str, int]], list[dict[str, int]], list[int]]:
        """(each phase's peak breakdown, the backward's moments, their gradients in the run's first
        micro-batch, which holds none yet)."""
        c, t, base = self.c, self.t, self.base
        st, gather, head, pipe = t.st, t.st.gather_transient, t.head, t.pipe
        phases: dict[str, dict[str, int]] = {}
        phases["init"] = {"weights": st.weights, "master_weights": st.master_weights,
                          "zero3_gathered_params": gather, **t.quantized}
        phases["forward"] = {**base, "gradients": t.fwd_grads,
                             "activations": self.on_gpu_below(c.n_layers) + t.embed_saved,
                             "autocast_weight_copies": t.amp_cache,
                             t.loss_key: t.head_saved + (head.forward_peak_bytes + t.shift_copy if c.last else 0),
                             "pipeline_logits": pipe.forward_logits_bytes, "zero3_gathered_params": gather}
        moments, first_grads = [], []
        if c.last:  # the loss backward, with every block's activations still saved
            early = head_grad_lands_early(c.plan)
            first_grads.append(self.grads_after(0, held=False) if early else t.first_fwd_grads)
            moments.append({**base, "gradients": self.grads_after(0) if early else t.fwd_grads,
                            "activations": self.on_gpu_below(c.n_layers) + t.embed_saved,
                            t.loss_key: t.loss_bwd_saved + head.backward_peak_bytes,
                            "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})
        for j in range(c.n_layers - 1, -1, -1):  # block j's backward, blocks above it done
            self._block_backward(j, moments, first_grads)
        phases["backward"] = max(moments, key=lambda m: sum(m.values())) if moments else {}
        phases["optimizer_step"] = {**base, **self.in_backward, "gradients": st.gradients,
                                    "optimizer_step_temporaries": st.step_transient}
        phases["checkpoint_save"] = {**base, "zero3_gathered_params":
                                     c.rp.largest_module * (4 if c.plan.precision == "fp32" else 2)
                                     if c.plan.zero_stage == 3 else 0}
        return phases, moments, first_grads

    def _block_backward(self, j: int, moments: list, first_grads: list) -> None:
        """Block j's backward moments (its recompute's, when checkpointed, then its own)."""
        c, t, blk, layers = self.c, self.t, self.c.blk, self.layers
        n_layers, gather, pipe = c.n_layers, t.st.gather_transient, t.pipe
        # the other in-flight micro-batches keep all their blocks (a pipeline stage's later forwards);
        # with activation offload the blocks below live on the host
        remaining = (self.kept_one(j) + (t.in_flight - 1) * self.kept_one(n_layers) if t.kept_on_gpu else 0) \
            + t.embed_saved
        transient = layers[j][1] if layers else blk.backward_transient_bytes
        if j < t.k_ckpt:  # recompute block j: its activations (and autocast copies) come back
            current = (layers[j][0] if layers else blk.saved_bytes) + t.autocast_copy + blk.input_bytes
        elif t.offloaded_block is not None:
            current, transient = 0, t.offloaded_block
        else:
            current = layers[j][0] + t.autocast_copy if layers else self.full_block
        grads = self.grads_after(n_layers - 1 - j)
        if j < t.k_ckpt and blk.recompute_transient_bytes:
            # The recompute's last moments, before block j's backward starts: its whole tape, the
            # grad of its output, and the unsaved tensors at its widest LoRA'd linear
            # (torch/utils/checkpoint.py reruns the forward when backward first unpacks a saved tensor).
            first_grads.append(self.grads_after(n_layers - 1 - j, held=False))
            moments.append({**self.recompute_base, "gradients": grads,
                            "activations": remaining + current,
                            "recompute_temporaries": blk.recompute_transient_bytes + blk.input_bytes,
                            "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})
        first_grads.append(self.grads_after(n_layers - 1 - j, held=False))
        moments.append({**self.backward_base, "gradients": grads,
                        "activations": remaining + current,
                        "backward_temporaries": transient + t.landing
                        - (pipe.output_grad_in_buffer_bytes if j == n_layers - 1 else 0),
                        "dequantized_weight": t.dequant,
                        "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})


EXPANDABLE_REPLAY_IN_ESTIMATES = False
"""Whether an estimate replays a plan that runs expandable segments (TrainingPlan.alloc_conf, what
memkit's runner sets) through allocator.py's expandable-segments rules. Not yet: such a plan is priced
by the default-segment replay. The one measured source that ran expandable_segments:True,
torchtitan's 20 dev rows (its run_llama_train.sh at 9dec370 exports it; pytorch/torchtitan a5e57e4),
reads 12.8 % median |err| and -7.2 % signed (under) through the expandable replay, against 5.0 % and
+2.8 % through the default one; with them priced expandable the dev set falls from 4.5 % / +1.4 % /
2.6 % beyond the headroom to 5.6 % / -1.3 % / 15.8 % (benchmarks/memory_accuracy.py, 2026-12-03).
A plan sized by the expandable replay would run out where the default replay's would not, so that
replay serves `estimate --lengths/--data` (which prints both settings) until measured expandable runs
on a GPU calibrate it."""


def _replayed(walk: _PhaseWalk, phases: dict, moments: list, first_grads: list, capacity_bytes: int | None,
              trace: dict | None):
    """(the replay's stats, the bytes outside the allocator) for the steady-state step: the run's
    first step, then a second one, through the caching allocator (allocator.py, replay.py)."""
    c, t = walk.c, walk.t
    plan, n_layers, hardware = c.plan, c.n_layers, c.hardware
    after_step = {**phases["optimizer_step"], "gradients": t.fwd_grads, "optimizer_step_temporaries": 0}
    fwd_walk = [{**phases["forward"], t.loss_key: 0,
                 "activations": walk.on_gpu_below(k) + t.embed_saved
                 + (c.blk.saved_bytes if not t.kept_on_gpu and k < n_layers else 0),
                 "autocast_weight_copies": t.amp_cache * k // max(1, n_layers)}
                for k in range(n_layers + 1)]
    step = [*fwd_walk, phases["forward"], *moments, phases["optimizer_step"], after_step]
    # torch.optim creates its states at the first step() (Optimizer._init_group), into whatever
    # the first forward/backward left cached; DeepSpeed allocates its partitions at init.
    # The run's first micro-batch holds no gradients yet: they land block by block in its backward,
    # into the blocks its activations free, and stay there when accumulation or zero_grad keeps them
    # (what fragments the cache for the steady-state steps).
    first_step = [{**m, "gradients": g} for m, g in
                  zip(step[:-2], [t.first_fwd_grads] * (len(fwd_walk) + 1) + first_grads)] + step[-2:]
    if plan.engine == "torch":
        first_step = [{**m, "optimizer_states": 0} for m in first_step[:-2]] + first_step[-2:]
    if t.loss_work:
        first_step, step = (_loss_work_moments(seq, len(fwd_walk), t.loss_key,
                                               t.head.forward_peak_bytes + t.shift_copy, t.head.backward_peak_bytes)
                            for seq in (first_step, step))
    timeline = [phases["init"], *first_step, *step, phases["checkpoint_save"]]
    cuda = c.device == "cuda"
    outside = _outside_bytes(c)
    # Side streams: FSDP2 / ZeRO-3 all-gather their parameters on their own stream
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py all_gather_stream;
    # deepspeed/runtime/zero/partitioned_param_coordinator.py), ZeRO-1/2 reduce gradient buckets
    # on a reduction stream (deepspeed/runtime/zero/stage_1_and_2.py, reduction_stream).
    streams = {"zero3_gathered_params": 1, **{name: 2 for name in walk.in_backward}}
    chunks = {**_shard_chunks(_chunks(c.model, plan, c.rp, c.blk, t.head, t.k_ckpt > 0, n_layers, c.first, c.last),
                              timeline),
              "pipeline_buffers": (c.blk.input_bytes,), "pipeline_logits": (max(1, t.logits_bytes),)}
    if trace is not None:
        trace.update(timeline=timeline, chunks=chunks, streams=streams, outside=outside,
                     steady=(1 + len(first_step), 1 + len(first_step) + len(step)))
    # the allocator the plan states (TrainingPlan.alloc_conf), replayed as EXPANDABLE_REPLAY_IN_ESTIMATES says
    expandable = cuda and plan.alloc_conf == "expandable" and EXPANDABLE_REPLAY_IN_ESTIMATES
    stats = _replay(timeline, chunks, streams, caching=cuda, expandable_segments=expandable,
                    capacity=(capacity_bytes or hardware.gpu.memory_bytes) - outside)
    return stats, outside


REPLAY_MEMO_SIZE = 4096
"""Uncapped replays remembered (a ReplayStats and a 20-byte key each): plans of one structure on
cards of one cuBLAS workspace, or at GPU counts where the rank holds the same bytes, replay the
same events."""


def _replay(timeline: list[dict[str, int]], chunks: dict[str, tuple[int, ...]], streams: dict[str, int], *,
            caching: bool, expandable_segments: bool, capacity: int):
    """replay_on_device(moment_events(timeline, chunks, streams), ...), with the replay that does
    not depend on the capacity memoised on a digest of its inputs (_replay_key): the replay is a
    deterministic function of them. Where the capacity binds (allocator.capacity_binds, rare) the
    capped replay runs as replay_on_device runs it."""
    key = _replay_key(timeline, chunks, streams, caching, expandable_segments)
    stats = _UNCAPPED.get(key)
    if stats is None:
        stats = replay(moment_events(timeline, chunks, streams),
                       AllocatorConfig(caching=caching, expandable_segments=expandable_segments))
        if len(_UNCAPPED) >= REPLAY_MEMO_SIZE:
            del _UNCAPPED[next(iter(_UNCAPPED))]  # the oldest entry
        _UNCAPPED[key] = stats
    if not capacity_binds(stats, caching=caching, capacity=capacity):
        return stats
    return replay_on_device(moment_events(timeline, chunks, streams), caching=caching,
                            expandable_segments=expandable_segments, capacity=capacity)


_UNCAPPED: dict = {}
"""_replay_key -> the uncapped replay's ReplayStats (frozen), at most REPLAY_MEMO_SIZE, oldest dropped first."""


def _replay_key(timeline, chunks, streams, caching: bool, expandable_segments: bool) -> bytes:
    """A BLAKE2b-160 digest of everything the uncapped replay reads: the moments in order, each
    component in its dict's order (moment_events' order), the chunk sizes and streams, the two
    allocator settings. marshal version 2 writes values only (no shared references), so equal
    inputs give equal bytes; a digest rather than the inputs keeps an entry small (a 70B timeline
    is ~100 KB)."""
    blob = marshal.dumps((timeline, chunks, streams, caching, expandable_segments), 2)
    return hashlib.blake2b(blob, digest_size=20).digest()


def _loss_work_moments(seq: list[dict[str, int]], i: int, key: str, forward_work: int,
                       backward_work: int) -> list[dict[str, int]]:
    """`seq` with the loss's work tensors apart from what it saves, for the replay: at the forward
    moment `seq[i]` the logits and their fp32 copy (loss_forward_work) are live beside the saved
    log-probs; both are freed before backward (the loop drops the model output, the loss function
    its fp32 copy: log_softmax saves only its result), and the loss backward moment `seq[i + 1]`
    allocates its fp32 gradients (loss_backward_work) anew. The sums of the moments are unchanged;
    the order of sizes is what the caching allocator sees (a freed bf16-logits segment too small
    for an fp32 gradient stays cached)."""
    fwd, bwd = seq[i], seq[i + 1]
    f = {**fwd, key: fwd[key] - forward_work, "loss_forward_work": forward_work}
    post = {**f, "loss_forward_work": 0}
    b = {**bwd, key: bwd[key] - backward_work, "loss_forward_work": 0, "loss_backward_work": backward_work}
    return [*seq[:i], f, post, b, *seq[i + 2:]]


SHARDED_COMPONENTS = ("weights", "master_weights", "optimizer_states", "optimizer_step_temporaries", "gradients")


def _shard_chunks(chunks: dict[str, tuple[int, ...]], timeline: list[dict[str, int]]) -> dict[str, tuple[int, ...]]:
    """Per-block tensors of a component that a rank holds only a share of (ZeRO / FSDP sharding,
    LoRA's adapters) scaled to that share, so the replay allocates one tensor per block of the
    size the rank really holds: FSDP's FlatParameter keeps each unit's 1/dp shard
    (torch/distributed/fsdp/_flat_param.py), FSDP2 each parameter's DTensor local shard
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), and torch.optim creates a parameter's
    states with its shape (torch/optim/adamw.py _init_group, zeros_like). Block-sized tensors in
    place of shards would fill cached segments (freed logits, say) that the real shards, smaller
    than the freed activations, never reach. The share is the component's most bytes live over
    the step against one tensor per block."""
    out = dict(chunks)
    for name in SHARDED_COMPONENTS:
        sizes = chunks.get(name)
        if not sizes:
            continue
        most = max([m.get(name, 0) for m in timeline], default=0)
        if most <= 0 or most >= sum(sizes):
            continue
        share = most / sum(sizes)
        out[name] = tuple(max(1, int(size * share)) for size in sizes)
    return out


def _chunks(model: ModelSpec, plan: TrainingPlan, rp: RankParams, blk, head, ckpt: bool, n_layers: int,
            first: bool, last: bool) -> dict[str, tuple[int, ...]]:
    """The bytes of the tensors each component is made of, in the order they are allocated
    (replay.py cycles through them); a component without an entry is one tensor."""
    tp = plan.tp
    layer = [lin.count * lin.in_features * lin.out_features // (tp if lin.tp_style != "replicate" else 1)
             for lin in model.layer_linears]
    # One tensor per block and component: FSDP1 and ZeRO-3 hold a block's parameters as one flat
    # tensor; per-parameter tensors (DDP, FSDP2) of >= 10 MiB are each rounded to 2 MiB, which a
    # block-sized tensor under-counts by at most 2 MiB per parameter (a few per mille); it keeps
    # the replay fast enough for the planner's thousands of calls.
    params = ([model.vocab_size * model.hidden_size] if (first or last) else []) + [sum(layer)] * max(1, n_layers)
    tokens = plan.micro_batch_size * plan.seq_len

    def per_param(itemsize: float) -> tuple[int, ...]:
        return tuple(max(1, int(p * itemsize)) for p in params)

    out: dict[str, tuple[int, ...]] = {}
    bpp = 2 if plan.precision != "fp32" else 4
    flat = plan.engine == "deepspeed" and plan.zero_stage >= 1  # one flat partition per group
    out["weights"] = per_param(bpp if not (plan.precision in ("fp16", "bf16") and plan.engine == "torch"
                                           and plan.zero_stage < 3) else 4)
    if not flat:
        out["master_weights"] = per_param(4)
        out["optimizer_states"] = per_param(4)
        out["optimizer_step_temporaries"] = per_param(4)
        out["gradients"] = per_param(4 if plan.precision != "bf16-pure" else 2)
    if flat and plan.zero_stage == 3:
        # stage3.py _optimizer_step: the fp32 gradient is built per sub-group (sub_group_size,
        # default 1e9 elements: deepspeed/runtime/zero/config.py) and freed after its step.
        out["optimizer_step_temporaries"] = (DS_SUB_GROUP_SIZE * 4,)
    out["zero3_gathered_params"] = tuple(max(1, p * bpp) for p in layer if p)
    out["autocast_weight_copies"] = tuple(max(1, p * 2) for p in layer if p)
    if ckpt:
        out["activations"] = (blk.input_bytes,)
    else:
        out["activations"] = tuple(v for v in blk.by_label.values() if v) or (blk.saved_bytes,)
    # the loss's tensors in the order they come: the logits, their fp32 copy, the fp32 log-probs
    logits = math.prod(head_logits(model, plan)) // max(1, tp)
    if plan.loss == "standard":
        # saved: the log-probs (+ an upcast loop's fp32 logits); work (_loss_work_moments): the logits,
        # then their fp32 copy (loss_parallel's shifted logits, transformers < 4.46's shifted copy);
        # backward: the loss's gradients (estimate/activations.py loss_path_bytes).
        path = loss_path_bytes(plan)
        out["logits_and_loss"] = tuple(max(1, logits * b) for b in path.saved)
        out["loss_forward_work"] = tuple(max(1, logits * b) for b in path.forward_work) or (1,)
        out["loss_backward_work"] = (max(1, logits * max(path.backward_work)),)
    else:  # chunked / fused: the saved hidden states, then one chunk's buffers (estimate/techniques.py)
        out[loss_component(plan)] = (max(1, head.saved_bytes), max(1, head.forward_peak_bytes))
    out["backward_temporaries"] = (max(1, tokens * model.hidden_size * 2),)
    return out


def _host_bytes(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, st) -> int:
    """Host RAM per node: offloaded states of every local rank, plus each process's own
    footprint, or the checkpoint-loading peak (each rank materialises the 16-bit weights on
    the CPU before moving them; transformers modeling_utils.py) if that is larger."""
    local = hardware.num_gpus_per_node
    offloaded = sum(st.host.values()) * local
    processes = HOST_BYTES_PER_PROCESS * local
    loading = model.num_params * 2 * (1 if plan.zero_stage == 3 else local)
    return max(offloaded, loading) + processes
