"""Per-GPU peak memory of one TrainingPlan: the maximum over phases, not one sum.

Phases (steady state, i.e. the second optimizer step, once optimizer states exist):
- init: weights and engine buffers after the engine wraps the model (ZeRO-3 assumes zero.Init,
  which Accelerate enables with `zero3_init_flag`);
- forward: resident states + every block's saved activations + the loss's fp32 logits;
- backward: walked block by block from the last: activations shrink while gradients grow
  (PyTorch frees a node's saved tensors when its backward has run);
- optimizer_step: resident states + gradients + the step's temporaries;
- checkpoint_save: resident states + one gathered block (ZeRO-3 16-bit consolidation).

allocated = what torch.cuda.max_memory_allocated reports. reserved adds the caching allocator's
rounding and fragmentation (c10/cuda/CUDACachingAllocator.cpp: 2 MiB blocks for requests under
10 MiB, 20 MiB segments; the slack factor is fitted on the published runs in
../shared/calibration, see benchmarks/memory_accuracy.py). nvidia-smi adds the CUDA context.
"""
from __future__ import annotations

from dataclasses import replace

from memkit.errors import MemkitError
from memkit.estimate.activations import block_activations, numerics
from memkit.estimate.result import MemoryEstimate
from memkit.estimate.states import RankParams, model_states
from memkit.estimate.techniques import (head_grad_lands_early, loss_activations, loss_component,
                                       selective_kept_bytes)
from memkit.parallel import check_degrees, stage_layers
from memkit.plan import TrainingPlan
from memkit.spec.hardware import Hardware
from memkit.spec.model import ModelSpec
from memkit.techniques import checkpointed_blocks, partial_blocks_error
from memkit.units import GIB, MIB

# Caching-allocator slack over the allocated peak: reserved ~= allocated * (1 + f) + rounding.
# Fitted on the calibration set's reserved and nvidia-smi rows (torchtitan max_reserved, HF docs
# and PEFT nvidia-smi): the median |error| of those rows is lowest for f in 0.15-0.20 (HF docs
# 24% -> 15%, PEFT 14% -> 5%, torchtitan 50% -> 42.5% going from f=0 to 0.15). The allocated
# rows do not depend on it.
ALLOCATOR_SLACK = 0.15
# Host RAM a training process takes besides tensors (Python, torch/CUDA libraries, DeepSpeed,
# the tokenizer and data loader): ~3 GiB RSS per CUDA process.
HOST_BYTES_PER_PROCESS = 3 * GIB
PHASES = ("init", "forward", "backward", "optimizer_step", "checkpoint_save")


def check_parallel(spec: ModelSpec, plan: TrainingPlan, hardware: Hardware) -> None:
    """What the estimator needs before pricing: the degree checks (memkit.parallel, their one
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
                    device: str = "cuda") -> MemoryEstimate:
    """Peak memory per GPU for `plan` (the worst pipeline stage). `device='cpu'` prices the CPU
    test runs: no foreach optimizer temporaries, no CUDA context or allocator slack."""
    stages = estimate_stages(model, plan, hardware, device=device)
    worst = max(stages, key=lambda s: s.allocated_peak_bytes)
    if plan.pp > 1:
        notes = worst.notes + (f"pipeline stage {stages.index(worst)} of {plan.pp} has the largest peak",)
        worst = replace(worst, notes=notes)
    return worst


def estimate_stages(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *,
                    device: str = "cuda") -> list[MemoryEstimate]:
    """One estimate per pipeline stage (a single one without pipeline parallelism). Stages that
    differ only in index share a computation: what matters is (blocks, in-flight micro-batches,
    first, last)."""
    plan.validate()
    hardware.validate()
    check_parallel(model, plan, hardware)
    counts = stage_layers(model.total_layers, plan.pp)
    cache: dict[tuple, MemoryEstimate] = {}
    out = []
    for k in range(plan.pp):
        key = (counts[k], _in_flight(plan, k), k == 0, k == plan.pp - 1)
        if key not in cache:
            cache[key] = _stage(model, plan, hardware, k, device)
        out.append(cache[key])
    return out


def _in_flight(plan: TrainingPlan, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: 1F1B stage k holds pp-k, GPipe
    all of them (Narayanan et al. 2021, Sec. 2.2; Huang et al. 2019, Sec. 2.3)."""
    if plan.pp == 1:
        return 1
    if plan.pp_schedule == "gpipe":
        return plan.grad_accum
    return min(plan.pp - stage, plan.grad_accum)


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
        trainable = lora_layer * n_layers
        params += trainable
        layer_trainable, head_trainable = lora_layer, 0
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
    return RankParams(num_params=params, num_trainable=trainable,
                      largest_module=max(avg_layer, embed, head), largest_tensor=largest_tensor,
                      num_persistent=persistent, layer_trainable=layer_trainable,
                      head_trainable=head_trainable)


def _small_params(model: ModelSpec) -> int:
    """Per block, parameters outside the linears' weights (norms, biases): below ZeRO-3's
    default persistence threshold of 1e5 elements for most models."""
    weights = sum(lin.count * lin.in_features * lin.out_features for lin in model.layer_linears)
    return max(0, model.layer_params - weights)


def _stage(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str
           ) -> MemoryEstimate:
    rp = rank_params(model, plan, stage)
    st = model_states(plan, rp, device=device)
    num = numerics(plan)
    first, last = stage == 0, stage == plan.pp - 1
    n_layers = stage_layers(model.total_layers, plan.pp)[stage]

    # -- activations of one micro-batch -------------------------------------------------------
    blk = block_activations(model, plan, device=device)
    head = loss_activations(model, plan, device=device)  # estimate/techniques.py: the plan's loss
    per_layer = blk.saved_bytes
    autocast_copy = head_copy = 0
    if num.autocast:
        # torch.autocast caches the bf16 copy of every linear weight for the whole forward
        # (torch/csrc/autograd/autocast_mode.cpp, cached_cast); the matmuls save them for backward.
        autocast_copy = num.autocast * sum(
            lin.count * lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
            for lin in model.layer_linears)
        head_copy = num.autocast * model.vocab_size * model.hidden_size if last and plan.loss == "standard" else 0
    in_flight = _in_flight(plan, stage)
    # The first k blocks keep only their inputs (memkit/techniques.py: which blocks and why), plus
    # under selective checkpointing their matmul / attention outputs (estimate/techniques.py).
    k_ckpt = checkpointed_blocks(plan.checkpointing, n_layers)
    ckpt = k_ckpt > 0
    full_block = per_layer + autocast_copy
    ckpt_kept = blk.input_bytes + (selective_kept_bytes(model, plan) if plan.checkpointing == "selective" else 0)

    def kept_below(j: int) -> int:  # bytes kept by blocks 0..j-1
        return (min(j, k_ckpt) * ckpt_kept + max(0, j - k_ckpt) * full_block) * in_flight

    layers_act = kept_below(n_layers)

    # -- gradients as they land ----------------------------------------------------------------
    # From the 2nd micro-batch on, all gradients are held -- except in a pipeline, where GPipe
    # runs every forward before any backward and 1F1B does so while m <= pp.
    if plan.pp > 1:
        accum_full = plan.pp_schedule == "1f1b" and plan.grad_accum > plan.pp
    else:
        accum_full = plan.grad_accum > 1
    grads_end = st.gradients
    gather = st.gather_transient

    def grads_after(num_layers_done: int) -> int:
        if not st.gradients_grow or accum_full or grads_end == 0:
            return grads_end
        share = grads_end / rp.num_trainable if rp.num_trainable else 0
        landed = rp.head_trainable * last + num_layers_done * rp.layer_trainable
        return int(min(rp.num_trainable, landed) * share)

    # -- moments: each is a breakdown of what is live; a phase's peak is its largest moment ------
    base = {"weights": st.weights, "master_weights": st.master_weights,
            "optimizer_states": st.optimizer_states}
    prefix = "deepspeed_" if plan.engine == "deepspeed" else ""
    base.update({prefix + name: value for name, value in st.buffers.items()})
    # A pipeline's last stage computes each in-flight micro-batch's loss in its forward.
    head_saved = (head.saved_bytes + head_copy) * in_flight if last else 0
    # Non-last stages keep each in-flight micro-batch's output for its backward, plus a receive
    # buffer for the gradient coming back (torch/distributed/pipelining/stage.py).
    boundary = (in_flight + 1) * blk.input_bytes if (plan.pp > 1 and not last) else 0
    base["pipeline_buffers"] = boundary
    if device == "cpu":  # a CPU run "offloads" into the same memory the tracker measures
        base.update({f"offloaded_{name}": value for name, value in st.host.items()})
    in_backward = {prefix + name: value for name, value in st.backward_buffers.items()}
    # ZeRO-2 allocates its gradient partition at the first reduction and frees it after the step.
    grads_outside_backward = grads_end if not st.backward_buffers else 0
    fwd_grads = grads_end if accum_full else (0 if st.gradients_grow else grads_outside_backward)
    embed_saved = head.embedding_bytes * in_flight if first else 0
    # Autocast caches only leaves that require grad: frozen LoRA bases are cast per call instead.
    amp_cache = autocast_copy * k_ckpt if (num.autocast and ckpt and not plan.is_lora) else 0
    landing = _landing(rp, st, plan)

    phases: dict[str, dict[str, int]] = {}
    phases["init"] = {"weights": st.weights, "master_weights": st.master_weights,
                      "zero3_gathered_params": gather}
    phases["forward"] = {**base, "gradients": fwd_grads, "activations": layers_act + embed_saved,
                         "autocast_weight_copies": amp_cache,
                         loss_component(plan): head_saved + (head.forward_peak_bytes if last else 0),
                         "zero3_gathered_params": gather}
    moments = []
    if last:  # the loss backward, with every block's activations still saved
        moments.append({**base, "gradients": grads_after(0) if head_grad_lands_early(plan) else fwd_grads,
                        "activations": layers_act + embed_saved,
                        loss_component(plan): head_saved + head.backward_peak_bytes,
                        "zero3_gathered_params": gather})
    for j in range(n_layers - 1, -1, -1):  # block j's backward, blocks above it done
        remaining = kept_below(j) + embed_saved
        if j < k_ckpt:  # recompute block j: its activations (and autocast copies) come back
            current = per_layer + autocast_copy + blk.input_bytes
        else:
            current = full_block
        moments.append({**base, **in_backward, "gradients": grads_after(n_layers - 1 - j),
                        "activations": remaining + current,
                        "backward_temporaries": blk.backward_transient_bytes + landing,
                        "zero3_gathered_params": gather})
    phases["backward"] = max(moments, key=lambda m: sum(m.values())) if moments else {}
    phases["optimizer_step"] = {**base, **in_backward, "gradients": grads_end,
                                "optimizer_step_temporaries": st.step_transient}
    phases["checkpoint_save"] = {**base, "zero3_gathered_params":
                                 rp.largest_module * (4 if plan.precision == "fp32" else 2)
                                 if plan.zero_stage == 3 else 0}
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(PHASES, key=lambda p: totals[p])
    allocated = totals[peak_phase]
    components = {k: int(v) for k, v in phases[peak_phase].items() if v}

    cuda = device == "cuda"
    # + 64 MiB: small-block pools and segment rounding of the caching allocator.
    reserved = int(allocated * (1 + ALLOCATOR_SLACK)) + 64 * MIB if cuda else allocated
    context = hardware.gpu.cuda_context_bytes if cuda else 0

    host = _host_bytes(model, plan, hardware, st)
    notes = []
    if plan.zero_stage == 3 and plan.engine == "deepspeed":
        notes.append("ZeRO-3 init assumes zero.Init (accelerate zero3_init_flag: true)")
    if num.autocast:
        notes.append("torch autocast: fp32 weights, bf16 weight copies cached for the forward")
    return MemoryEstimate(
        allocated_peak_bytes=int(allocated), reserved_peak_bytes=int(reserved),
        nvidia_smi_peak_bytes=int(reserved + context),
        device_total_bytes=hardware.gpu.memory_bytes,
        num_params=model.num_params + (model.lora_params(plan.lora_rank, plan.lora_targets) if plan.is_lora else 0),
        num_trainable_params=(model.lora_params(plan.lora_rank, plan.lora_targets) if plan.is_lora
                              else model.num_params),
        peak_phase=peak_phase, components=components, phases={k: int(v) for k, v in totals.items()},
        host_bytes_per_node=int(host), nvme_bytes_per_node=int(st.nvme * hardware.num_gpus_per_node),
        notes=tuple(notes))


def _landing(rp: RankParams, st, plan: TrainingPlan) -> int:
    """A block's fresh gradients before the engine files them away (AccumulateGrad output, or
    param.grad awaiting the ZeRO bucket copy)."""
    if st.gradients_grow and plan.grad_accum == 1:
        return 0  # they are the stored gradients themselves
    wb = 2 if (plan.engine == "deepspeed" and plan.precision != "fp32") or plan.precision == "bf16-pure" else 4
    return rp.layer_trainable * wb


def _host_bytes(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, st) -> int:
    """Host RAM per node: offloaded states of every local rank, plus each process's own
    footprint, or the checkpoint-loading peak (each rank materialises the 16-bit weights on
    the CPU before moving them; transformers modeling_utils.py) if that is larger."""
    local = hardware.num_gpus_per_node
    offloaded = sum(st.host.values()) * local
    processes = HOST_BYTES_PER_PROCESS * local
    loading = model.num_params * 2 * (1 if plan.zero_stage == 3 else local)
    return max(offloaded, loading) + processes
