"""Model states on one rank: weights, master weights, gradients, optimizer states and the
engine's own buffers, for every engine x precision x ZeRO stage x offload combination.

Sources (DeepSpeed 0.19 as installed; the ZeRO paper for the accounting):
- Rajbhandari et al. 2020 (ZeRO), Sec. 3.1 and Fig. 1: mixed-precision Adam keeps 2Psi (fp16
  weights) + 2Psi (fp16 grads) + 12Psi (fp32 master, m, v); stages 1/2/3 divide the optimizer
  states / + gradients / + weights by the data-parallel degree.
- deepspeed/runtime/zero/stage_1_and_2.py: the bit16 weights are one flat buffer per group
  (bit16_groups_flat), the fp32 master partition is a clone (single_partition_of_fp32_groups),
  stage 2 reduces gradients through `reduce_bucket_size`-element ipg buffers (two with
  overlap_comm) into `grads_in_partition`, and the step converts the partition's gradient to fp32.
- deepspeed/runtime/zero/stage3.py: partitioned fp16 weights, persistent small parameters
  (numel < stage3_param_persistence_threshold) replicated, gathered parameters live up to the
  prefetch bucket, an fp16 gradient partition buffer and an ipg bucket, fp32 gradients at step.
- deepspeed/runtime/fp16/unfused_optimizer.py (ZeRO-0 fp16/bf16): fp32 copies of every
  parameter; the step casts every fp16 gradient to fp32.
- Ren et al. 2021 (ZeRO-Offload), Sec. 4: offloaded fp32 master weights, optimizer states and
  fp32 gradients live in pinned host memory; the GPU keeps fp16 weights and gradient buckets.
- torch/optim/adamw.py (_multi_tensor_adamw): on CUDA the foreach path allocates
  `exp_avg_sq_sqrt`, one temporary the size of all trainable parameters.
- torch/nn/parallel/distributed.py (Reducer): DDP gradient buckets are a second copy of the
  gradients unless gradient_as_bucket_view=True (Accelerate's and Trainer's default is False).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memkit.plan.plan import EIGHT_BIT_OPTIMIZERS, PAGED_OPTIMIZERS, TrainingPlan

BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes optim/optimizer.py Optimizer8bit.get_state_buffer (0.42 through 0.50): a paged optimizer
gives a parameter of fewer than 1e5 elements ordinary `torch.zeros_like` states (torch's caching
allocator); a larger one gets functional.get_paged: `lib.cget_managed_ptr` (csrc/pythonInterface.cpp:
cudaMallocManaged(&ptr, bytes, cudaMemAttachHost)) wrapped by `torch.frombuffer` -- CUDA managed
memory torch's allocator never sees, so it is in neither torch.cuda.max_memory_allocated() nor
max_memory_reserved(). The driver keeps it on the device while there is room (nvidia-smi counts it
there) and migrates it to the host under pressure (cprefetch / page faults)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankParams:
    """Parameter counts held by one rank (after the tensor/pipeline split)."""

    num_params: int
    num_trainable: int
    largest_module: int
    """Largest group of parameters gathered or reduced at once (a block, or the embedding)."""
    largest_tensor: int
    num_persistent: int = 0
    """Parameters below ZeRO-3's persistence threshold (norms, biases): kept whole on every rank."""
    layer_trainable: int = 0
    """Trainable parameters of one block (their gradients land block by block in backward)."""
    head_trainable: int = 0
    block_params: int = 0
    """Parameters of the blocks (what a per-block FSDP wrap puts into its units), embeddings and
    head excluded."""
    paged_trainable: int = 0
    """Trainable parameters in tensors of at least BNB_PAGED_MIN_NUMEL elements: those whose states
    a bitsandbytes paged optimizer puts in CUDA managed memory."""


def optimizer_state_bytes_per_param(optimizer: str, precision: str) -> float:
    """Bytes of optimizer state per trainable parameter.
    AdamW: m and v (Loshchilov & Hutter 2019); fp32 unless the plan is bf16-pure.
    adamw-8bit: two uint8 states + one fp32 absmax per 256-element block for each
    (Dettmers et al. 2022, Sec. 2; bitsandbytes 0.50 optim/optimizer.py Optimizer2State.init_state:
    blocksize = 256). Tensors under min_8bit_size (4096 elements) keep fp32 states there; they
    are norms and biases, too small to count here.
    paged-adamw-8bit: the same states, those of tensors >= BNB_PAGED_MIN_NUMEL elements in CUDA
    managed memory outside torch's allocator (model_states: States.managed_optimizer_states).
    adafactor: factored second moment, ~(rows+cols) per matrix -- negligible per parameter
    (Shazeer & Stern 2018, Sec. 3); we count 4 bytes per 256 parameters for the factors.
    sgd: one momentum buffer (torch.optim.SGD with momentum > 0)."""
    state = 2 if precision == "bf16-pure" else 4
    if optimizer == "adamw":
        return 2 * state
    if optimizer in EIGHT_BIT_OPTIMIZERS:
        return 2 * (1 + 4 / 256)
    if optimizer == "adafactor":
        return 4 / 256
    return state  # sgd with momentum


@dataclass(slots=True)
class States:
    """Bytes by component. `device_*` stay on the GPU for the whole step; `step_*` exist only
    during the optimizer step; `host_*` live in host RAM; `nvme` on NVMe."""

    weights: int = 0
    master_weights: int = 0
    gradients: int = 0
    """Gradient bytes held once backward has finished (before the step)."""
    gradients_grow: bool = True
    """True: gradients appear block by block in backward (torch, ZeRO 0/1). False: the engine
    allocates its gradient partition up front (ZeRO 2/3)."""
    optimizer_states: int = 0
    buffers: dict[str, int] = field(default_factory=dict)
    """Engine buffers alive through forward/backward/step (ZeRO buckets, gathered params)."""
    backward_buffers: dict[str, int] = field(default_factory=dict)
    """Buffers that exist only from the first gradient reduction until the step releases them
    (ZeRO-2's ipg bucket and gradient partition: stage_1_and_2.py _release_ipg_buffers)."""
    reduction_buffers: dict[str, int] = field(default_factory=dict)
    """Buffers that exist from the first gradient hook of a backward to its end (ZeRO-1's ipg
    buckets: stage_1_and_2.py setup_buckets allocates them in the first hook, the backward
    epilogue independent_gradient_partition_epilogue -> _release_ipg_buffers frees them)."""
    step_transient: int = 0
    """Extra bytes during the optimizer step (fp32 gradient copies, foreach temporaries)."""
    gather_transient: int = 0
    """Extra bytes while ZeRO-3 gathers parameters around a block (forward and backward)."""
    host: dict[str, int] = field(default_factory=dict)
    nvme: int = 0
    managed_optimizer_states: int = 0
    """Optimizer state bytes a bitsandbytes paged optimizer holds in CUDA managed memory
    (BNB_PAGED_MIN_NUMEL): outside torch's caching allocator -- not in allocated or reserved --
    but on the device, as far as it has room, for nvidia-smi (estimate/memory.py)."""

    @property
    def resident(self) -> int:
        return self.weights + self.master_weights + self.optimizer_states + sum(self.buffers.values())


def model_states(plan: TrainingPlan, rp: RankParams, *, device: str = "cuda", fp32_adapters: bool = False) -> States:
    """Per-rank states for `plan`. `device='cpu'` models the CPU test runs (no foreach kernels).
    `fp32_adapters`: a LoRA plan's adapters are fp32 leaves over its 16-bit base (the stack's peft,
    spec/stack.py StackBehaviour.fp32_lora_adapters)."""
    opt_bpp = optimizer_state_bytes_per_param(plan.optimizer, plan.precision)
    if plan.engine == "torch":
        st = _torch_states(plan, rp, opt_bpp, device)
        if fp32_adapters:
            _fp32_adapter_states(plan, rp, st, device)
    else:
        by_stage = {0: _deepspeed_zero0_states, 1: _deepspeed_zero12_states, 2: _deepspeed_zero12_states}
        st = by_stage.get(plan.zero_stage, _deepspeed_zero3_states)(plan, rp, opt_bpp, device)
    if plan.optimizer in PAGED_OPTIMIZERS and device == "cuda":  # bitsandbytes pages only on CUDA
        st.managed_optimizer_states = _paged_share(plan, rp, st.optimizer_states)
        st.optimizer_states -= st.managed_optimizer_states
    return st


def _paged_share(plan: TrainingPlan, rp: RankParams, state_bytes: int) -> int:
    """The bytes of `state_bytes` a paged optimizer keeps in managed memory (BNB_PAGED_MIN_NUMEL):
    the share of the trainable parameters in large tensors; under DeepSpeed ZeRO >= 1 the optimizer
    steps one flat partition per group (stage_1_and_2.py single_partition_of_fp32_groups), all large.
    FSDP shards are priced at the unsharded tensors' share."""
    if plan.engine == "deepspeed" and plan.zero_stage >= 1:
        return state_bytes
    if rp.num_trainable <= 0:
        return 0
    return int(state_bytes * min(rp.paged_trainable, rp.num_trainable) / rp.num_trainable)


def _fp32_adapter_states(plan: TrainingPlan, rp: RankParams, st: States, device: str) -> None:
    """LoRA adapters kept in fp32 beside a bf16-pure base (peft <= 0.6 creates them in the default
    dtype and only moves them to the base's device: peft v0.6.2 tuners/lora/layer.py update_layer,
    tuners/lora/model.py _replace_module; peft >= 0.12 upcasts them, tuners_utils.py
    _cast_adapter_dtype): their weights, gradients (autograd accumulates in the leaf's dtype) and
    torch optimizer states (zeros_like) are 4-byte, AdamW's foreach temporary too. Plain torch
    without sharding only; other plans are priced in the base's dtype."""
    if not plan.is_lora or plan.precision != "bf16-pure" or plan.zero_stage != 0:
        return
    psi_t = rp.num_trainable
    st.weights += psi_t * 2  # 4 bytes instead of the base's 2
    st.gradients += psi_t * 2
    st.optimizer_states = int(psi_t * optimizer_state_bytes_per_param(plan.optimizer, "fp32"))
    if plan.dp > 1:
        st.buffers["ddp_buckets"] = psi_t * 4
    if plan.optimizer == "adamw":  # _adam_temp's foreach sqrt temporary, at the adapters' 4 bytes
        st.step_transient = psi_t * 4


def _deepspeed_sizes(plan: TrainingPlan, rp: RankParams) -> tuple[int, int, int, int, int]:
    """(data ranks, parameters, trainable parameters, bytes per weight, bytes per master weight)."""
    wb = 4 if plan.precision == "fp32" else 2  # DeepSpeed casts the module (engine.py)
    master_b = 0 if plan.precision in ("fp32", "bf16-pure") else 4
    return plan.dp, rp.num_params, rp.num_trainable, wb, master_b


def _deepspeed_zero0_states(plan: TrainingPlan, rp: RankParams, opt_bpp: float, device: str) -> States:
    """DeepSpeed without ZeRO: every rank holds everything."""
    n, psi, psi_t, wb, master_b = _deepspeed_sizes(plan, rp)
    st = States()
    grad_b = wb
    st.weights = psi * wb
    st.optimizer_states = int(psi_t * opt_bpp)
    st.gradients = psi_t * grad_b
    if master_b:
        # FP16/BF16 unfused optimizer: fp32 copy of every param; step casts grads to fp32.
        st.master_weights = psi_t * master_b
        st.step_transient = psi_t * 4
    if n > 1:  # engine.allreduce_gradients flattens up to one bucket at a time
        st.buffers["allreduce_bucket"] = min(plan.reduce_bucket_size, psi_t) * grad_b
    st.step_transient += _adam_temp(plan, psi_t, rp.largest_tensor, device)
    return st


def _deepspeed_zero12_states(plan: TrainingPlan, rp: RankParams, opt_bpp: float, device: str) -> States:
    """ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py): optimizer states (and under ZeRO-2
    gradients) partitioned over the data ranks."""
    n, psi, psi_t, wb, master_b = _deepspeed_sizes(plan, rp)
    st = States()
    zero = plan.zero_stage
    grad_b = wb
    st.weights = psi * wb  # bit16_groups_flat: every rank holds all weights
    # The master partition is a clone even in fp32 (single_partition_of_fp32_groups).
    master = _div(psi_t, n) * (master_b or 4) if plan.precision != "bf16-pure" else 0
    optim = int(_div(psi_t, n) * opt_bpp)
    fp32_grad = _div(psi_t, n) * 4
    if plan.offload_optimizer == "cpu":
        st.host["master_weights"] = master
        st.host["optimizer_states"] = optim
        st.host["fp32_gradients"] = fp32_grad
        st.host["bit16_param_buffer"] = _div(psi_t, n) * wb
        st.host["offload_grad_buffer"] = rp.largest_tensor * wb  # temp_grad_buffer_for_cpu_offload
        st.buffers["offload_grad_buffer"] = rp.largest_tensor * wb  # temp_grad_buffer_for_gpu_offload
    else:
        st.master_weights = master
        st.optimizer_states = optim
        # The basic optimizer steps one flat fp32 partition (a single tensor).
        st.step_transient = fp32_grad + _adam_temp(plan, _div(psi_t, n), _div(psi_t, n), device)
    # The ipg bucket is allocated at its configured size whatever the model's size
    # (stage_1_and_2.py setup_buckets); two of them with overlap_comm.
    ipg = plan.reduce_bucket_size * grad_b * (2 if plan.overlap_comm else 1)
    if zero == 2:
        st.gradients_grow = False
        st.backward_buffers["ipg_bucket"] = ipg if plan.contiguous_gradients else 0
        st.gradients = 0 if plan.offload_optimizer == "cpu" else _div(psi_t, n) * grad_b
    else:
        st.gradients = psi_t * grad_b  # stage 1 keeps whole gradients until the step
        st.step_transient += _div(psi_t, n) * grad_b  # averaged_gradients partition
        # Stage 1 registers the gradient hooks too when contiguous_gradients is on
        # (stage_1_and_2.py __init__: partition_gradients or overlap_comm or ... or
        # contiguous_gradients), and the first hook allocates the ipg bucket(s) at their
        # configured size (setup_buckets; a second with overlap_comm). Measured:
        # tests/golden/cpu_measurements.json ds-z1-bf16-overlap-tiny-suggested (issue #15).
        if plan.contiguous_gradients:
            st.reduction_buffers["ipg_bucket"] = ipg
    return st


def _deepspeed_zero3_states(plan: TrainingPlan, rp: RankParams, opt_bpp: float, device: str) -> States:
    """ZeRO-3 (deepspeed/runtime/zero/stage3.py): parameters partitioned too."""
    n, psi, psi_t, wb, master_b = _deepspeed_sizes(plan, rp)
    st = States()
    st.gradients_grow = False
    part = _div(psi - rp.num_persistent, n) + rp.num_persistent
    # Gathered parameters: the running block plus the prefetch bucket; and where the forward turns
    # into backward, every parameter whose next use is within stage3_max_reuse_distance elements
    # stays gathered (deepspeed/runtime/zero/partitioned_param_coordinator.py, release_sub_module),
    # all bounded by stage3_max_live_parameters.
    working = rp.largest_module + min(plan.stage3_prefetch_bucket_size, rp.largest_module)
    retained = min(plan.stage3_max_reuse_distance, psi)
    gathered = min(max(working, retained), max(plan.stage3_max_live_parameters, working)) * wb
    if plan.offload_params != "none":
        where = "host" if plan.offload_params == "cpu" else "nvme"
        if where == "host":
            st.host["weights"] = part * wb
        else:
            st.nvme += part * wb
        st.weights = rp.num_persistent * wb
    else:
        st.weights = part * wb
    st.gather_transient = gathered
    master = _div(psi_t, n) * (master_b or 4) if plan.precision != "bf16-pure" else 0
    optim = int(_div(psi_t, n) * opt_bpp)
    fp32_grad = _div(psi_t, n) * 4
    if plan.offload_optimizer != "none":
        if plan.offload_optimizer == "cpu":
            st.host.update(master_weights=master, optimizer_states=optim, fp32_gradients=fp32_grad)
        else:
            st.nvme += master + optim
            st.host["fp32_gradients"] = fp32_grad
            st.host["nvme_swap_buffers"] = 4 * 100_000_000 * 4  # aio: buffer_count 4 x 1e8 fp32
    else:
        st.master_weights = master
        st.optimizer_states = optim
        st.step_transient = fp32_grad + _adam_temp(plan, _div(psi_t, n), _div(psi_t, n), device)
    # stage3.py _setup_for_real_optimizer: the gradient partitions are one flat buffer
    # (grad_partitions_flat_buffer, gradient_accumulation_dtype = the weights' by default) on
    # self.device, which is the host (pinned) when the optimizer is offloaded -- measured there on
    # CPU: ds-z3-bf16-offload, tests/golden/cpu_measurements.json (__param_id_to_grad_partition).
    grad_partitions = _div(psi_t, n) * wb
    if plan.offload_optimizer != "none":
        st.host["grad_partitions"] = grad_partitions
        st.gradients = 0
    else:
        st.gradients = grad_partitions
    st.buffers["ipg_bucket"] = plan.reduce_bucket_size * wb  # stage3.py: allocated at its configured size
    return st


def _torch_states(plan: TrainingPlan, rp: RankParams, opt_bpp: float, device: str) -> States:
    """Plain PyTorch: AMP keeps fp32 weights and grads; ZeRO stage 3 here means FSDP full shard."""
    n = plan.dp
    wb = 2 if plan.precision == "bf16-pure" else 4
    st = States()
    psi, psi_t = rp.num_params, rp.num_trainable
    if plan.zero_stage == 0:
        st.weights = psi * wb
        st.gradients = psi_t * wb
        st.optimizer_states = int(psi_t * opt_bpp)
        if n > 1:
            st.buffers["ddp_buckets"] = psi_t * wb
        st.step_transient = _adam_temp(plan, psi_t, rp.largest_tensor, device)
        return st
    # FSDP (Zhao et al. 2023, Sec. 3.2): flat sharded params/grads/states; one unit unsharded
    # at a time plus the prefetched next one, in the compute dtype.
    st.gradients_grow = False
    st.weights = _div(psi, n) * wb
    compute_b = 2 if plan.is_mixed or plan.precision == "bf16-pure" else 4
    # use_orig_params=True: a flat parameter that mixes frozen and trainable tensors requires grad
    # as a whole (torch/distributed/fsdp/_flat_param.py: flat_param_requires_grad = any(...)), so
    # LoRA in every block gives gradients as large as the blocks ("higher than expected gradient
    # memory", fully_sharded_data_parallel.py, FSDP class docstring).
    grad_numel = rp.block_params + psi_t if (plan.is_lora and plan.fsdp_use_orig_params) else psi_t
    st.gradients = _div(grad_numel, n) * wb
    if plan.zero_stage == 3 and plan.pp == 1 and plan.grad_accum > 1:
        # Accumulation runs the non-final micro-steps in FSDP.no_sync(), which keeps "the full model
        # gradients (instead of gradient shards) until the eventual sync" (fully_sharded_data_parallel.py,
        # no_sync), in the unsharded parameter's dtype (_runtime_utils.py _post_backward_hook returns
        # before the reduce-dtype cast). Accelerate's accumulate() does so for FSDP1 and FSDP2
        # (accelerate/accelerator.py no_sync; GradientAccumulationPlugin.sync_each_batch defaults to
        # False), Lightning Fabric through no_backward_sync (lightning/fabric/strategies/fsdp.py).
        st.gradients = grad_numel * compute_b
    st.optimizer_states = int(_div(psi_t, n) * opt_bpp)
    st.gather_transient = 2 * rp.largest_module * compute_b
    st.step_transient = _adam_temp(plan, _div(psi_t, n), rp.largest_tensor, device)
    return st


def _adam_temp(plan: TrainingPlan, numel: int, largest: int, device: str) -> int:
    """AdamW step temporaries. PyTorch's AdamW on CUDA takes the foreach path
    (torch/optim/adamw.py, _multi_tensor_adamw): `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`
    is one temporary as large as all `numel` parameters; memkit's CPU measurements force
    foreach=True to run the same path. DeepSpeed on CUDA builds the optimizer from the config's
    optimizer block instead: FusedAdam (multi_tensor_apply, in place) or DeepSpeedCPUAdam under
    offload -- no temporaries."""
    del largest
    if plan.optimizer != "adamw":
        return 0
    if plan.engine == "deepspeed" and device == "cuda":
        return 0
    return numel * (2 if plan.precision == "bf16-pure" else 4)


def _div(numel: int, n: int) -> int:
    """Partition size: ceil(numel / n) (DeepSpeed pads partitions to equal length)."""
    return -(-numel // n)
