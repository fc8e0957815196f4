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

import math
from dataclasses import replace

from memkit.errors import MemkitError
from memkit.estimate.activations import block_activations, head_logits, head_weight_elements, numerics
from memkit.estimate.allocator import AllocatorConfig, replay
from memkit.estimate.pipeline import stage_buffers, stage_logits_bytes
from memkit.estimate.backward_techniques import (autocast_copy_bytes, offloaded_activation_bytes, offloads_activations,
                                                 largest_autocast_copy_bytes, offloaded_loss_backward_saved,
                                                 one_gradient_states)
from memkit.estimate.bounds import QUANTILE_LABEL, margin
from memkit.estimate.cuda_extras import cublas_workspace_bytes, outside_allocator_bytes
from memkit.estimate.replay import moment_events
from memkit.estimate.quantized import base_bytes, dequantized_weight_bytes
from memkit.estimate.result import MemoryEstimate
from memkit.estimate.states import RankParams, model_states
from memkit.estimate.techniques import (head_grad_lands_early, loss_activations, loss_component,
                                       selective_kept_bytes)
from memkit.parallel import check_degrees, stage_layers
from memkit.plan import TrainingPlan
from memkit.spec.hardware import Hardware
from memkit.spec.generic import task_spec
from memkit.spec.model import ModelSpec
from memkit.spec.stack import EAGER_KERNEL_IMAGES_BYTES, Stack, behaviour
from memkit.techniques import checkpointed_blocks, partial_blocks_error
from memkit.units import GIB

# Host RAM a training process takes besides tensors (Python, torch/CUDA libraries, DeepSpeed,
# the tokenizer and data loader): ~3 GiB RSS per CUDA process.
HOST_BYTES_PER_PROCESS = 3 * GIB
DS_SUB_GROUP_SIZE = 1_000_000_000
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
    return with_upper_bounds(worst, plan, device=device, table=margins)


def with_upper_bounds(est: MemoryEstimate, plan: TrainingPlan, *, device: str = "cuda",
                      table: dict[str, float] | None = None, basis: str = "") -> MemoryEstimate:
    """`est` with its upper bounds: + the QUANTILE margin for each figure (estimate/bounds.py;
    `table` overrides the published one, e.g. with a local profile's). On CPU the allocator does
    not cache and memkit is exact to a few %: the bounds equal the prediction."""
    priced = device == "cuda" or table is not None
    m = margin(plan, table, figure="nvidia_smi") if priced else 0.0  # reserved and nvidia-smi
    m_alloc = margin(plan, table, figure="allocated") if priced else 0.0
    if not basis and table is None:
        from memkit.estimate.residuals_table import LOSO_COVERAGE, NUM_ROWS
        basis = (f"{QUANTILE_LABEL} of under-prediction on {NUM_ROWS} published GPU runs, pooled by "
                 f"figure: allocated +{m_alloc:.0%}, reserved/nvidia-smi +{m:.0%}; covers "
                 f"{LOSO_COVERAGE:.0%} of a held-out source's runs") if device == "cuda" \
            else "CPU: exact replay"
    notes = tuple(n for n in est.notes if not n.startswith("near the edge"))
    if device == "cuda" and est.nvidia_smi_peak_bytes * (1 + m) > est.device_total_bytes >= est.nvidia_smi_peak_bytes:
        notes = notes + (f"near the edge: the upper bound ({est.nvidia_smi_peak_bytes * (1 + m) / GIB:.1f} GiB) "
                         f"exceeds the device ({est.device_total_bytes / GIB:.1f} GiB)",)
    return replace(est, allocated_peak_upper_bytes=int(est.allocated_peak_bytes * (1 + m_alloc)),
                   reserved_peak_upper_bytes=int(est.reserved_peak_bytes * (1 + m)),
                   nvidia_smi_peak_upper_bytes=int(est.nvidia_smi_peak_bytes * (1 + m)),
                   upper_margin=round(m, 4), upper_basis=basis, notes=notes)


def estimate_stages(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, *,
                    device: str = "cuda", stack: Stack | None = None,
                    capacity_bytes: int | None = None) -> list[MemoryEstimate]:
    """One estimate per pipeline stage (a single one without pipeline parallelism). Stages that
    differ only in index share a computation: what matters is (blocks, in-flight micro-batches,
    first, last)."""
    plan.validate()
    hardware.validate()
    model = task_spec(model, plan)  # the task's head and lengths (spec/generic.py)
    check_parallel(model, plan, hardware)
    counts = stage_layers(model.total_layers, plan.pp)
    cache: dict[tuple, MemoryEstimate] = {}
    out = []
    for k in range(plan.pp):
        key = (counts[k], _in_flight(plan, k), k == 0, k == plan.pp - 1)
        if key not in cache:
            cache[key] = _stage(model, plan, hardware, k, device, stack, capacity_bytes)
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
    return RankParams(num_params=params, num_trainable=trainable, block_params=n_layers * avg_layer,
                      largest_module=max(avg_layer, embed, head), largest_tensor=largest_tensor,
                      num_persistent=persistent, layer_trainable=layer_trainable,
                      head_trainable=head_trainable)


def _small_params(model: ModelSpec) -> int:
    """Per block, parameters outside the linears' weights (norms, biases): below ZeRO-3's
    default persistence threshold of 1e5 elements for most models."""
    weights = sum(lin.count * lin.in_features * lin.out_features for lin in model.layer_linears)
    return max(0, model.layer_params - weights)


def _stage(model: ModelSpec, plan: TrainingPlan, hardware: Hardware, stage: int, device: str,
           stack: Stack | None = None, capacity_bytes: int | None = None,
           trace: dict | None = None) -> MemoryEstimate:
    """One stage's estimate. `trace`, when given, receives the replay's inputs (timeline, chunks,
    streams, the bytes outside the allocator, and the slice of the timeline that is one
    steady-state step) for estimate/varlen.py, which strings steps of several shapes together."""
    habits = behaviour(stack)
    rp = rank_params(model, plan, stage)
    st = model_states(plan, rp, device=device)
    quantized = base_bytes(model, plan, rp.num_params) if plan.is_quantized else {}  # estimate/quantized.py
    if quantized:
        st.weights = quantized.pop("weights")
    st = one_gradient_states(st, model, plan)  # --optimizer-in-backward
    if not habits.foreach_optimizer and plan.engine == "torch" and plan.optimizer == "adamw":
        # torch < 2.0 loops over parameters: one parameter's sqrt temporary at a time (spec/stack.py)
        st.step_transient = min(st.step_transient, rp.largest_tensor * (2 if plan.precision == "bf16-pure" else 4))
    num = numerics(plan)
    first, last = stage == 0, stage == plan.pp - 1
    n_layers = stage_layers(model.total_layers, plan.pp)[stage]

    # -- activations of one micro-batch -------------------------------------------------------
    blk = block_activations(model, plan, device=device)
    head = loss_activations(model, plan, device=device)  # estimate/techniques.py: the plan's loss
    per_layer = blk.saved_bytes
    autocast_copy = head_copy = 0
    if num.autocast:
        autocast_copy = autocast_copy_bytes(model, plan)  # the cached 16-bit weight copies
        head_copy = num.autocast * head_weight_elements(model, plan) if last and plan.loss == "standard" else 0
    if plan.is_quantized:  # 4-bit bases run bitsandbytes' matmul, which autocast does not cast (tape.py)
        autocast_copy = 0
    # LoRA adapters are fp32 leaves that require grad (peft autocast_adapter_dtype=True), so autocast
    # caches their low-dtype copies (aten/src/ATen/autocast_mode.cpp, cached_cast: leaf with
    # requires_grad) and the adapter matmuls save them for the input's grad, like the bases' copies.
    adapter_copy = (num.autocast * model.lora_params(plan.lora_rank, plan.lora_targets) // model.total_layers
                    if num.autocast and plan.is_lora else 0)
    autocast_copy += adapter_copy
    in_flight = _in_flight(plan, stage)
    # The first k blocks keep only their inputs (memkit/techniques.py: which blocks and why), plus
    # under selective checkpointing their matmul / attention outputs (estimate/techniques.py).
    k_ckpt = checkpointed_blocks(plan.checkpointing, n_layers)
    ckpt = k_ckpt > 0
    full_block = per_layer + autocast_copy
    ckpt_kept = blk.input_bytes + (selective_kept_bytes(model, plan) if plan.checkpointing == "selective" else 0)

    # Hybrid stacks (Jamba: Mamba and attention blocks) give each block's own saved bytes and
    # backward temporaries (estimate/activations.py BlockActivations.layers); others, the mean.
    layers = blk.layers if len(blk.layers) == n_layers else ()

    def kept_one(j: int) -> int:  # bytes kept by blocks 0..j-1 of one micro-batch
        if layers and j <= n_layers:
            return min(j, k_ckpt) * ckpt_kept + sum(saved + autocast_copy for saved, _t in layers[k_ckpt:j])
        return min(j, k_ckpt) * ckpt_kept + max(0, j - k_ckpt) * full_block

    def kept_below(j: int) -> int:  # ... of every in-flight micro-batch
        return kept_one(j) * in_flight

    # --offload-activations cpu (estimate/backward_techniques.py): saved activations live on the
    # host; the GPU holds the block being run (forward) or differentiated (backward) only.
    offload = offloads_activations(plan)
    on_gpu_below = (lambda j: 0) if offload else kept_below

    # -- gradients as they land ----------------------------------------------------------------
    # From the 2nd micro-batch on, all gradients are held -- except in a pipeline, where GPipe
    # runs every forward before any backward and 1F1B does so while m <= pp.
    if plan.pp > 1:
        accum_full = plan.pp_schedule == "1f1b" and plan.grad_accum > plan.pp
    else:
        accum_full = plan.grad_accum > 1
    if habits.grads_kept_between_steps and plan.engine == "torch":
        # zero_grad() zero-fills instead of freeing (spec/stack.py): the previous step's gradients
        # are live from the forward on. DeepSpeed's optimizers free theirs (deepspeed/runtime/fp16/
        # fused_optimizer.py, unfused_optimizer.py, zero/stage_1_and_2.py: zero_grad(set_to_none=True)).
        accum_full = True
    grads_end = st.gradients
    gather = st.gather_transient

    def grads_after(num_layers_done: int, held: bool = accum_full) -> int:
        if not st.gradients_grow or held or grads_end == 0:
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
    offloaded_loss = offloaded_loss_backward_saved(model, plan)  # log-probs only, under offload
    loss_bwd_saved = head_saved if offloaded_loss is None else (offloaded_loss * in_flight if last else 0)
    # Receive buffers, stage outputs and pending sends of torch.distributed.pipelining (pipeline.py).
    logits_bytes = stage_logits_bytes(plan, vocab_size=model.vocab_size, itemsize=num.autocast or num.weight_itemsize)
    pipe = stage_buffers(plan, stage, in_flight=in_flight, boundary_bytes=blk.input_bytes, logits_bytes=logits_bytes)
    base["pipeline_buffers"] = pipe.held_bytes
    base.update(quantized)  # weights_4bit, quant_state
    if device == "cpu":  # a CPU run "offloads" into the same memory the tracker measures
        base.update({f"offloaded_{name}": value for name, value in st.host.items()})
    in_backward = {prefix + name: value for name, value in st.backward_buffers.items()}
    in_reduction = {prefix + name: value for name, value in st.reduction_buffers.items()}
    # ZeRO-2 allocates its gradient partition at the first reduction and frees it after the step.
    grads_outside_backward = grads_end if not st.backward_buffers else 0
    first_fwd_grads = 0 if st.gradients_grow else grads_outside_backward  # a micro-batch with none held
    fwd_grads = grads_end if accum_full else first_fwd_grads
    embed_saved = head.embedding_bytes * in_flight if first else 0
    # Autocast caches only leaves that require grad: frozen LoRA bases are cast per call instead.
    amp_cache = (adapter_copy if plan.is_lora else autocast_copy) * k_ckpt if (num.autocast and ckpt) else 0
    landing = _landing(rp, st, plan, model)
    dequant = dequantized_weight_bytes(model, plan) if plan.is_quantized else 0  # one linear's, in backward
    if offload and num.autocast and not plan.is_lora:  # the cache stays on the GPU for the forward
        amp_cache = autocast_copy * n_layers
    if plan.optimizer_in_backward:  # the hook steps and frees each gradient as it lands
        fwd_grads, landing = 0, st.step_transient  # + one parameter's step temporaries

    phases: dict[str, dict[str, int]] = {}
    phases["init"] = {"weights": st.weights, "master_weights": st.master_weights,
                      "zero3_gathered_params": gather, **quantized}
    # transformers < 4.46: logits[..., :-1, :].contiguous() before the loss (spec/stack.py).
    shift_copy = (plan.micro_batch_size * (plan.seq_len - 1) * model.vocab_size * 4 // plan.tp
                  if (habits.shifted_logits_copy and last and model.kind == "decoder"
                      and plan.loss == "standard") else 0)
    phases["forward"] = {**base, "gradients": fwd_grads, "activations": on_gpu_below(n_layers) + embed_saved,
                         "autocast_weight_copies": amp_cache,
                         loss_component(plan): head_saved + (head.forward_peak_bytes + shift_copy if last else 0),
                         "pipeline_logits": pipe.forward_logits_bytes, "zero3_gathered_params": gather}
    moments = []
    first_grads = []  # the same moments' gradients in the run's first micro-batch (none held yet)
    if last:  # the loss backward, with every block's activations still saved
        first_grads.append(grads_after(0, held=False) if head_grad_lands_early(plan) else first_fwd_grads)
        moments.append({**base, "gradients": grads_after(0) if head_grad_lands_early(plan) else fwd_grads,
                        "activations": on_gpu_below(n_layers) + embed_saved,
                        loss_component(plan): loss_bwd_saved + head.backward_peak_bytes,
                        "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})
    for j in range(n_layers - 1, -1, -1):  # block j's backward, blocks above it done
        # the other in-flight micro-batches keep all their blocks (a pipeline stage's later forwards);
        # with activation offload the blocks below live on the host
        remaining = (0 if offload else kept_one(j) + (in_flight - 1) * kept_one(n_layers)) + embed_saved
        transient = layers[j][1] if layers else blk.backward_transient_bytes
        if j < k_ckpt:  # recompute block j: its activations (and autocast copies) come back
            current = (layers[j][0] if layers else per_layer) + autocast_copy + blk.input_bytes
        elif offload and blk.offloaded_backward_bytes is not None:
            # each node's saved tensors come back when it runs and go when it returns: the widest
            # node's, with the gradients in flight (estimate/activations.py), and one weight copy
            current, transient = 0, blk.offloaded_backward_bytes + largest_autocast_copy_bytes(model, plan)
        else:
            current = layers[j][0] + autocast_copy if layers else full_block
        if j < k_ckpt and blk.recompute_transient_bytes:
            # The recompute's last moments, before block j's backward starts: its whole tape, the
            # grad of its output, and the unsaved tensors at its widest LoRA'd linear
            # (torch/utils/checkpoint.py reruns the forward when backward first unpacks a saved tensor).
            first_grads.append(grads_after(n_layers - 1 - j, held=False))
            moments.append({**base, **in_backward, "gradients": grads_after(n_layers - 1 - j),
                            "activations": remaining + current,
                            "recompute_temporaries": blk.recompute_transient_bytes + blk.input_bytes,
                            "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})
        first_grads.append(grads_after(n_layers - 1 - j, held=False))
        moments.append({**base, **in_backward, **in_reduction, "gradients": grads_after(n_layers - 1 - j),
                        "activations": remaining + current,
                        "backward_temporaries": transient + landing
                        - (pipe.output_grad_in_buffer_bytes if j == n_layers - 1 else 0),
                        "dequantized_weight": dequant,
                        "pipeline_logits": pipe.backward_logits_bytes, "zero3_gathered_params": gather})
    phases["backward"] = max(moments, key=lambda m: sum(m.values())) if moments else {}
    phases["optimizer_step"] = {**base, **in_backward, "gradients": grads_end,
                                "optimizer_step_temporaries": st.step_transient}
    phases["checkpoint_save"] = {**base, "zero3_gathered_params":
                                 rp.largest_module * (4 if plan.precision == "fp32" else 2)
                                 if plan.zero_stage == 3 else 0}
    cuda = device == "cuda"
    workspace = cublas_workspace_bytes(hardware.gpu) if cuda else 0
    if workspace:  # allocated through the caching allocator at the first matmul, kept for the run
        for parts in [*phases.values(), *moments]:
            if parts:
                parts["cublas_workspace"] = workspace
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_phase = max(PHASES, key=lambda p: totals[p])
    components = {k: int(v) for k, v in phases[peak_phase].items() if v}

    # -- the steady-state step replayed through the allocator ------------------------------------
    after_step = {**phases["optimizer_step"], "gradients": fwd_grads, "optimizer_step_temporaries": 0}
    fwd_walk = [{**phases["forward"], loss_component(plan): 0,
                 "activations": on_gpu_below(k) + embed_saved + (per_layer if offload and k < n_layers else 0),
                 "autocast_weight_copies": amp_cache * k // max(1, n_layers)}
                for k in range(n_layers + 1)]
    step = [*fwd_walk, phases["forward"], *moments, phases["optimizer_step"], after_step]
    # torch.optim creates its states at the first step() (Optimizer._init_group), into whatever
    # the first forward/backward left cached; DeepSpeed allocates its partitions at init.
    # The run's first micro-batch holds no gradients yet: they land block by block in its backward,
    # into the blocks its activations free, and stay there when accumulation or zero_grad keeps them
    # (what fragments the cache for the steady-state steps).
    first_step = [{**m, "gradients": g} for m, g in
                  zip(step[:-2], [first_fwd_grads] * (len(fwd_walk) + 1) + first_grads)] + step[-2:]
    if plan.engine == "torch":
        first_step = [{**m, "optimizer_states": 0} for m in first_step[:-2]] + first_step[-2:]
    if last and plan.loss == "standard" and head.backward_peak_bytes:
        first_step, step = (_loss_work_moments(seq, len(fwd_walk), loss_component(plan),
                                               head.forward_peak_bytes + shift_copy, head.backward_peak_bytes)
                            for seq in (first_step, step))
    timeline = [phases["init"], *first_step, *step, phases["checkpoint_save"]]
    eager = EAGER_KERNEL_IMAGES_BYTES if habits.eager_module_loading else 0
    outside = outside_allocator_bytes(plan, hardware, context_bytes=hardware.gpu.cuda_context_bytes + eager,
                                      eager_nvls=habits.eager_nvls) if cuda else 0
    # Side streams: FSDP2 / ZeRO-3 all-gather their parameters on their own stream
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py all_gather_stream;
    # deepspeed/runtime/zero/partitioned_param_coordinator.py), ZeRO-1/2 reduce gradient buckets
    # on a reduction stream (deepspeed/runtime/zero/stage_1_and_2.py, reduction_stream).
    streams = {"zero3_gathered_params": 1, **{name: 2 for name in in_backward}}
    chunks = {**_shard_chunks(_chunks(model, plan, rp, blk, head, ckpt, n_layers, first, last), timeline),
              "pipeline_buffers": (blk.input_bytes,), "pipeline_logits": (max(1, logits_bytes),)}
    if trace is not None:
        trace.update(timeline=timeline, chunks=chunks, streams=streams, outside=outside,
                     steady=(1 + len(first_step), 1 + len(first_step) + len(step)))
    events = moment_events(timeline, chunks, streams)
    stats = replay(events, AllocatorConfig(caching=cuda))
    capacity = (capacity_bytes or hardware.gpu.memory_bytes) - outside
    if cuda and stats.allocated_peak_bytes <= capacity < stats.reserved_peak_bytes:
        # Over the capacity only through the cache: torch frees its cached segments and retries a
        # failing cudaMalloc; if that rescues the run, reserved is what it holds then, else report
        # what it needed (allocated > capacity runs out whatever the cache does).
        capped = replay(events, AllocatorConfig(caching=True, capacity=capacity))
        if not capped.ran_out:
            stats = capped
    allocated = max(stats.allocated_peak_bytes, totals[peak_phase])
    reserved = max(stats.reserved_peak_bytes, allocated)
    if allocated > totals[peak_phase]:  # 512-byte rounding and unsplit remainders (allocator.py)
        components["allocator_rounding"] = allocated - totals[peak_phase]
    context = outside

    host = _host_bytes(model, plan, hardware, st) + (
        offloaded_activation_bytes(model, plan, device=device) * hardware.num_gpus_per_node)
    notes = list(habits.notes)
    if plan.zero_stage == 3 and plan.engine == "deepspeed":
        notes.append("ZeRO-3 init assumes zero.Init (accelerate zero3_init_flag: true)")
    if num.autocast and not plan.is_quantized:
        notes.append("torch autocast: fp32 weights, bf16 weight copies cached for the forward")
    if plan.engine == "torch" and plan.zero_stage == 3 and plan.pp == 1 and plan.grad_accum > 1:
        notes.append("FSDP with accumulation: gradients held unsharded between syncs (FSDP.no_sync, as "
                     "Accelerate and Lightning run it)")
    if plan.is_quantized:
        notes.append(f"{plan.quantize_base} base (bitsandbytes 4-bit, double quant {'on' if plan.double_quant else 'off'}): "
                     "each linear dequantised into the compute dtype per matmul; the rest fp32")
    if offload:
        notes.append(f"activation offload: {offloaded_activation_bytes(model, plan, device=device) / GIB:.2f} GiB of "
                     "saved activations per micro-batch in pinned host RAM per GPU (estimate/backward_techniques.py)")
    if plan.optimizer_in_backward:
        notes.append("optimizer in backward: each parameter steps in its gradient hook; one gradient alive at a time")
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
        most = max((m.get(name, 0) for m in timeline), default=0)
        if not sizes or most <= 0 or most >= sum(sizes):
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
        # saved: the fp32 log-probs; work (_loss_work_moments): the logits, then fp32 tensors (their
        # copy, loss_parallel's shifted logits, transformers < 4.46's shifted copy); backward: fp32.
        out["logits_and_loss"] = (max(1, logits * 4),)
        out["loss_forward_work"] = (max(1, logits * (numerics(plan).autocast or numerics(plan).weight_itemsize)),
                                    max(1, logits * 4))
        out["loss_backward_work"] = (max(1, logits * 4),)
    else:  # chunked / fused: the saved hidden states, then one chunk's buffers (estimate/techniques.py)
        out[loss_component(plan)] = (max(1, head.saved_bytes), max(1, head.forward_peak_bytes))
    out["backward_temporaries"] = (max(1, tokens * model.hidden_size * 2),)
    return out


def _landing(rp: RankParams, st, plan: TrainingPlan, model: ModelSpec) -> int:
    """A block's fresh gradients before the engine files them away (AccumulateGrad output, or
    param.grad awaiting the ZeRO bucket copy)."""
    if st.gradients_grow and plan.grad_accum == 1:
        return 0  # they are the stored gradients themselves
    wb = 2 if (plan.engine == "deepspeed" and plan.precision != "fp32") or plan.precision == "bf16-pure" else 4
    if plan.engine == "torch" and plan.zero_stage == 0 and not plan.is_lora:
        # AccumulateGrad adds each fresh gradient into the existing .grad as soon as it is made
        # (its nodes run first: sequence_nr UINT64_MAX, torch/csrc/autograd/node.h; in-place
        # `variable_grad += new_grad`, torch/csrc/autograd/functions/accumulate_grad.h), so one
        # weight's gradient lands at a time -- measured on a CPU pipeline stage (tests/e2e/
        # test_parallel_equivalence.py), whose peak is a block's backward.
        return max(lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
                   for lin in model.layer_linears) * wb
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
