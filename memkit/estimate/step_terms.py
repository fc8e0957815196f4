"""What each technique adds to one optimizer step's time, through one small interface.

The step-time walk (estimate/throughput.py estimate_step_time) prices the layers' kernels, the
data- and tensor-parallel communication and the engine's own work; each technique then adds its
own terms through a `StepTechnique`, as estimate/stage_terms.py's `Technique`s do for memory --
`setup` (switches the layer passes read: the checkpoint recompute's early stop, fp32 adapters),
`compute` (what the technique adds to a micro-batch's GPU compute or its recompute) and `exposed`
(time outside the compute: offload traffic, the optimizer step, the pipeline's transfers and
bubble). STEP_TECHNIQUES runs them in order, each reading what the earlier ones set; the order
is the order the terms are summed in, so every estimate is the same sum it always was. The walk
asks no plan which techniques it uses. memkit/ARCHITECTURE.md, "Techniques own their terms".
"""
from __future__ import annotations

from dataclasses import dataclass

from memkit.estimate import kernels
from memkit.estimate.backward_techniques import (IN_BACKWARD_OPS_PER_TENSOR, activation_offload_transfer_s,
                                                 offloaded_activation_bytes)
from memkit.estimate.quantized import dequant_traffic_bytes
from memkit.estimate.techniques import recompute_share
from memkit.estimate.throughput import (COMPILED_CHUNK_LOSS_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT, _head_rows,
                                        CPU_ADAM_BYTES_PER_PARAM, GB, GPU_OPTIMIZER_BYTES_PER_PARAM,
                                        HOST_MEMORY_GBPS_PER_NODE, NVME_GBPS_PER_NODE, OP_DISPATCH_S,
                                        CLIP_GRAD_PASSES, OPTIMIZER_OPS_PER_TENSOR, SINGLE_TENSOR_OPTIMIZER,
                                        _amp_fp32_weights, _elementwise_pass, _elt, _grad_bytes, adamw_step_bytes, bnb_8bit_step_bytes, _Pass, _param_tensors, _trainable_per_gpu,
                                        activation_offload_exposed_s, matmul_params, peft_fp32_adapters)
from memkit.plan.plan import EIGHT_BIT_OPTIMIZERS, PAGED_OPTIMIZERS, TrainingPlan
from memkit.spec.hardware import GPU, Hardware
from memkit.spec.model import ModelSpec
from memkit.spec.stack import StackBehaviour


@dataclass(frozen=True, slots=True, kw_only=True)
class StepContext:
    """What one step is, before any technique: the model, plan and hardware, the versions' behaviours,
    the tokens of one micro-batch per data-parallel rank, and how the run is set up (see
    estimate_step_time)."""

    model: ModelSpec
    plan: TrainingPlan
    hardware: Hardware
    gpu: GPU
    how: StackBehaviour
    tokens: int
    compiled: bool = False
    offload_streams: bool = False
    hf_checkpointing: bool = False
    lora_adapter_dtype: str | None = None
    fused_optimizer: bool = False
    chunked_loss_saves_logits: bool = False
    eager_fp32_rope: bool = False
    no_sync_step: bool = False


@dataclass(slots=True)
class StepTerms:
    """The terms the walk adds up; the techniques set them (the defaults are a plan that uses none).
    Seconds on one GPU, one micro-batch unless said otherwise."""

    early_stop: bool = False        # the recompute stops after a block's last saved tensor (throughput._output_unsaved)
    fp32_adapters: bool = False     # LoRA adapters in fp32 beside a 16-bit base (throughput.peft_fp32_adapters)
    recompute_share: float = 0.0    # of full checkpointing's recompute (estimate/techniques.py recompute_share)
    compute: _Pass = _Pass()        # forward and backward of the layers this GPU holds
    fwd_only_s: float = 0.0         # the forward of every block, all stages: what full checkpointing re-runs
    recompute_s: float = 0.0        # what backward re-runs
    offload_micro_s: float = 0.0    # host <-> GPU traffic exposed every micro-step
    offload_boundary_s: float = 0.0  # ... once per optimizer step (after the CPU step)
    optimizer_s: float = 0.0        # the optimizer step on the GPU, once per optimizer step
    pp_comm_s: float = 0.0          # stage-boundary transfers
    bubble: float = 1.0             # the pipeline bubble's stretch of the step

    @property
    def bwd_window_s(self) -> float:
        """The backward compute (with its recompute) that traffic can hide under."""
        return self.compute.bwd_s + self.recompute_s


class StepTechnique:
    """One technique's step-time contribution. Each method may read what earlier techniques set."""

    boundary_only = False
    """Its `exposed` terms exist only where the step ends in an optimizer step, so a no_sync
    micro-step (StepContext.no_sync_step) skips them (throughput._exposed_terms)."""

    def setup(self, c: StepContext, t: StepTerms) -> None:
        """Set the switches the layer passes read (t.early_stop, t.fp32_adapters, t.recompute_share)."""

    def compute(self, c: StepContext, t: StepTerms) -> None:
        """Add to one micro-batch's compute (t.compute) or recompute (t.recompute_s)."""

    def exposed(self, c: StepContext, t: StepTerms) -> None:
        """Add time outside the compute (offload traffic, optimizer step, pipeline)."""


class Checkpointing(StepTechnique):
    """Full, partial and selective checkpointing re-run forward work in backward (memkit/plan/
    techniques.py: which blocks; estimate/techniques.py: the share)."""

    def setup(self, c, t):
        # memkit's runs checkpoint with non-reentrant torch.utils.checkpoint (train/techniques.py), which
        # stops recomputing early from torch 2.1 (spec/stack.py CHECKPOINT_EARLY_STOP_TORCH).
        t.early_stop = c.how.checkpoint_early_stop and not (c.hf_checkpointing and c.how.hf_checkpoint_reentrant)
        t.recompute_share = recompute_share(c.plan, c.model.total_layers)

    def compute(self, c, t):
        plan, model = c.plan, c.model
        # The forward of the K checkpointed blocks; under selective checkpointing only the
        # elementwise ops between the kept matmul / attention outputs.
        t.recompute_s += t.fwd_only_s / plan.pp * t.recompute_share
        if plan.checkpointing == "selective":
            num_attn = max(1, sum(lin.role in ("o", "attn_out") for lin in model.layer_linears))
            t.recompute_s += (_elementwise_pass(c.gpu, plan, model, num_attn, c.tokens, compiled=c.compiled,
                                                 eager_fp32_rope=c.eager_fp32_rope).fwd_s
                              * model.total_layers / plan.pp)


class Loss(StepTechnique):
    """memkit's chunked loss recomputes each chunk's logits in backward: one more LM-head matmul
    (estimate/techniques.py loss_recompute_flops_per_token). A chunked loss that keeps the chunks'
    logits (StepContext.chunked_loss_saves_logits: torchtune's CEWithChunkedOutputLoss) recomputes
    nothing, and under torch.compile its compiled per-chunk cross-entropy moves
    COMPILED_CHUNK_LOSS_BYTES_PER_LOGIT instead of the head pass's LOSS_BYTES_PER_LOGIT."""

    def compute(self, c, t):
        plan, model = c.plan, c.model
        if plan.loss != "chunked" or plan.task != "causal-lm":
            return
        v = model.vocab_size // (plan.tp if plan.sequence_parallel else 1)
        if not c.chunked_loss_saves_logits:
            t.recompute_s += kernels.gemm_time_s(c.gpu, plan.precision, c.tokens, v, model.hidden_size) / plan.pp
        elif c.compiled:
            logits = _head_rows(model, plan, c.tokens) * v
            saved = kernels.memory_time_s(c.gpu, (LOSS_BYTES_PER_LOGIT - COMPILED_CHUNK_LOSS_BYTES_PER_LOGIT)
                                          * logits) / plan.pp
            t.compute = t.compute + _Pass(-saved / 2, -saved / 2)   # the head pass put half in each


class MixedPrecision(StepTechnique):
    """torch autocast over fp32 weights (throughput._amp_fp32_weights)."""

    def compute(self, c, t):
        plan, model = c.plan, c.model
        if _amp_fp32_weights(plan):
            # autocast re-casts every fp32 weight to 16 bits in each forward (4 B read + 2 B written;
            # its cast cache lives for one autocast region, so the recompute casts again), and
            # AccumulateGrad adds each 16-bit weight gradient into the fp32 .grad (2 + 4 read, 4 written).
            n = matmul_params(model) / (plan.tp * plan.pp)
            trainable = model.lora_params(plan.lora_rank, plan.lora_targets) if plan.is_lora else n
            cast = kernels.memory_time_s(c.gpu, 6 * n * (not plan.is_quantized))  # 4-bit bases: no autocast cast
            t.compute = t.compute + _Pass(cast, kernels.memory_time_s(c.gpu, 10 * trainable), 0)
            t.recompute_s += cast * t.recompute_share


class QuantizedBase(StepTechnique):
    """QLoRA's 4-bit base: dequantisation and casts of the 4-bit linears (estimate/quantized.py)."""

    def compute(self, c, t):
        if c.plan.is_quantized:
            fwd_b, bwd_b = dequant_traffic_bytes(c.model, c.plan, c.tokens)
            t.compute = t.compute + _Pass(kernels.memory_time_s(c.gpu, fwd_b), kernels.memory_time_s(c.gpu, bwd_b), 0)
            t.recompute_s += kernels.memory_time_s(c.gpu, fwd_b) * t.recompute_share


class Lora(StepTechnique):
    """LoRA adapters: their GEMMs are priced with each adapted linear (throughput.lora_adapter_pass),
    in fp32 where peft keeps them so (throughput.peft_fp32_adapters): the run's stated dtype, else
    the one the stack's stated peft gives (spec/stack.py StackBehaviour.lora_adapter_dtype)."""

    def setup(self, c, t):
        stated = c.lora_adapter_dtype
        if stated is None and c.how.lora_adapter_dtype == "base" and c.plan.precision == "bf16-pure":
            stated = "bf16"  # the 16-bit base's dtype (a mixed-precision base is fp32 already)
        t.fp32_adapters = peft_fp32_adapters(c.plan, stated)


class OptimizerOffload(StepTechnique):
    """ZeRO-Offload (Ren et al. 2021, Sec. 4): 16-bit grads GPU->CPU during backward, CPU-Adam on the
    host, updated 16-bit params back after the step; NVMe pages the states in and out."""

    def exposed(self, c, t):
        plan = c.plan
        if plan.offload_optimizer == "none":
            return
        pcie, per_node = c.gpu.pcie_gbps * GB, c.hardware.num_gpus_per_node
        partition = _trainable_per_gpu(c.model, plan) / (plan.dp if plan.zero_stage >= 1 else 1)
        e = 4 if plan.precision == "fp32" else 2
        t.offload_micro_s += max(0.0, partition * e / pcie - t.bwd_window_s)   # grad copies overlap backward
        t.offload_boundary_s += partition * e / pcie                            # params back, after the CPU step
        t.offload_boundary_s += partition * CPU_ADAM_BYTES_PER_PARAM / (HOST_MEMORY_GBPS_PER_NODE * GB / per_node)
        if plan.offload_optimizer == "nvme":
            t.offload_boundary_s += 2 * partition * 12 / (NVME_GBPS_PER_NODE * GB / per_node)


class ActivationOffload(StepTechnique):
    """--offload-activations cpu: saved activations out to the host in forward and back in backward
    (estimate/backward_techniques.py activation_offload_transfer_s)."""

    def exposed(self, c, t):
        if c.plan.offload_activations == "none":
            return
        moved = activation_offload_transfer_s(c.model, c.plan, c.gpu.pcie_gbps)
        if c.offload_streams:
            t.offload_micro_s += activation_offload_exposed_s(moved, fwd_s=t.compute.fwd_s, bwd_s=t.bwd_window_s)
            # The side stream hides the PCIe time, not the HBM traffic: the copy engines read each
            # offloaded tensor out of HBM in forward and write it back in backward, bandwidth the
            # compute kernels running beside them lose (side_stream_hbm_s).
            t.offload_micro_s += side_stream_hbm_s(c.gpu, offloaded_activation_bytes(c.model, c.plan))
        else:   # memkit's runner copies on the compute stream (train/backward_techniques.py)
            t.offload_micro_s += moved


def side_stream_hbm_s(gpu: GPU, offloaded_bytes: float) -> float:
    """Seconds of HBM bandwidth an overlapped activation offload takes from compute per micro-step:
    the bytes read for the device->host copy and written again for the host->device one."""
    return kernels.memory_time_s(gpu, 2 * offloaded_bytes)


class ParamOffload(StepTechnique):
    """ZeRO-3 parameter offload: each micro-step's parameters cross PCIe twice (Ren et al. 2021;
    ZeRO-Infinity, Rajbhandari et al. 2021, Sec. 6.2, for NVMe)."""

    def exposed(self, c, t):
        plan = c.plan
        if plan.offload_params == "none":
            return
        e = 4 if plan.precision == "fp32" else 2
        p_part = c.model.num_params / (plan.tp * plan.pp) / plan.dp * e
        t.offload_micro_s += 2 * p_part / (c.gpu.pcie_gbps * GB)
        if plan.offload_params == "nvme":
            t.offload_micro_s += 2 * p_part / (NVME_GBPS_PER_NODE * GB / c.hardware.num_gpus_per_node)


class OptimizerStep(StepTechnique):
    """The optimizer step on the GPU, memory-bound (GPU_OPTIMIZER_BYTES_PER_PARAM; AdamW by its
    implementation, throughput.adamw_step_bytes) or, where torch loops over tensors, dispatch-bound
    (OPTIMIZER_OPS_PER_TENSOR, SINGLE_TENSOR_OPTIMIZER); none when the optimizer is offloaded
    (OptimizerOffload prices the CPU step)."""

    boundary_only = True

    def exposed(self, c, t):
        plan = c.plan
        if plan.offload_optimizer != "none":
            return
        partition = _trainable_per_gpu(c.model, plan) / (plan.dp if plan.zero_stage >= 1 else 1)
        bytes_per_param = GPU_OPTIMIZER_BYTES_PER_PARAM[plan.optimizer]
        ops_per_tensor = OPTIMIZER_OPS_PER_TENSOR[plan.optimizer]
        if plan.optimizer == "adamw":
            # DeepSpeed steps its fp32 partition with FusedAdam; torch.optim.AdamW takes the foreach
            # path unless the run asks for fused=True (StepContext.fused_optimizer).
            torch_engine = plan.engine == "torch"
            bytes_per_param = adamw_step_bytes(
                state_itemsize(c, t), fused=c.fused_optimizer or not torch_engine,
                master_copy=plan.is_mixed and not _amp_fp32_weights(plan))
        elif plan.optimizer in EIGHT_BIT_OPTIMIZERS:
            bytes_per_param = bnb_8bit_step_bytes(state_itemsize(c, t))
        if plan.engine == "torch" and plan.optimizer in SINGLE_TENSOR_OPTIMIZER and not c.how.foreach_optimizer:
            ops_per_tensor, bytes_per_param = SINGLE_TENSOR_OPTIMIZER[plan.optimizer]
        t.optimizer_s = kernels.memory_time_s(c.gpu, partition * bytes_per_param)
        if plan.engine == "torch":   # DeepSpeed steps flattened partitions: a handful of launches
            host_s = _param_tensors(c.model, plan) * ops_per_tensor * OP_DISPATCH_S
            # bitsandbytes synchronizes after each tensor (BNB_SYNC_PER_TENSOR): no overlap of the
            # host's issue with the kernels, the two add up.
            synced = plan.optimizer in EIGHT_BIT_OPTIMIZERS and BNB_SYNC_PER_TENSOR
            t.optimizer_s = t.optimizer_s + host_s if synced else max(t.optimizer_s, host_s)
            if not plan.optimizer_in_backward:   # one step() call: one paged end-of-step sync
                t.optimizer_s += paged_host_ops(c.model, plan, step_calls=1) * OP_DISPATCH_S


def state_itemsize(c: StepContext, t: StepTerms) -> int:
    """Bytes per element of the trainable parameters, their gradients and torch's optimizer states
    (zeros_like(param), torch/optim/adam.py _init_group): 2 under the torch engine's bf16-pure, 4
    otherwise (fp32 masters; DeepSpeed keeps an fp32 partition under bf16 too) and for peft's fp32
    adapters (StepTerms.fp32_adapters)."""
    pure16 = c.plan.precision == "bf16-pure" and c.plan.engine == "torch"
    return 2 if pure16 and not (c.plan.is_lora and t.fp32_adapters) else 4


class GradClipping(StepTechnique):
    """--gradient-clipping > 0: the global norm and the unconditional rescale (CLIP_GRAD_PASSES) over
    this GPU's gradients, once per optimizer step, memory-bound. The optimizer in backward steps
    each tensor before the norm exists, so torchtune refuses the pair and memkit prices none. With
    the optimizer offloaded, DeepSpeed clips the fp32 gradients on the host inside the CPU step
    (runtime/zero/stage_1_and_2.py unscale_and_clip_grads on the CPU partition), which
    OptimizerOffload's CPU_ADAM_BYTES_PER_PARAM covers."""

    def exposed(self, c, t):
        plan = c.plan
        if plan.gradient_clipping <= 0 or plan.optimizer_in_backward or plan.offload_optimizer != "none":
            return
        # inside FSDP1's no_sync() the gradients are still unsharded (throughput._dp_comm no_sync):
        # FSDP.clip_grad_norm_ reads and rescales every element on each rank
        sharded = plan.zero_stage >= 1 and not c.no_sync_step
        partition = _trainable_per_gpu(c.model, plan) / (plan.dp if sharded else 1)
        itemsize = 4 if plan.engine == "deepspeed" else max(_grad_bytes(plan), state_itemsize(c, t))
        t.optimizer_s += kernels.memory_time_s(c.gpu, CLIP_GRAD_PASSES * itemsize * partition)


BNB_SYNC_PER_TENSOR = True
"""bitsandbytes' Optimizer8bit.step calls torch.cuda.synchronize() after every parameter's
update_step (bitsandbytes/optim/optimizer.py, 0.41.0 through 0.50: `self.update_step(group, p,
gindex, pindex)` then the sync, and once more at the end when paged). The host therefore cannot
run ahead: each tensor's launches wait for the previous tensor's kernel, and under the optimizer in
backward (one optimizer per parameter, stepped in its gradient hook) every hook drains the
backward's queue, so the GPU idles while the host issues the hook's ops and the next backward op."""


PAGED_STATE_MIN_NUMEL = 100_000
"""bitsandbytes pages a state buffer only for a parameter of at least 1e5 elements; smaller ones get
torch.zeros_like (bitsandbytes/optim/optimizer.py Optimizer8bit.get_state_buffer, 0.44.1 through HEAD)."""

PREFETCH_CALLS_PER_PAGED_TENSOR = 2
"""Optimizer8bit.prefetch_state calls F.prefetch_tensor on state1 and state2 of a paged tensor
before its update_step, every step (bitsandbytes/optim/optimizer.py; functional.py prefetch_tensor
-> csrc/pythonInterface.cpp cprefetch: cudaDeviceGetAttribute, then cudaMemPrefetchAsync): two
ctypes calls into the driver, each priced as one dispatched op."""


def _paged_state_tensors(model: ModelSpec, plan: TrainingPlan) -> int:
    """Trainable tensors of this GPU whose bitsandbytes states are paged (PAGED_STATE_MIN_NUMEL):
    the linears' weights (an expert weight is one 3-D tensor) or, under LoRA, each adapter matrix
    (r x in, out x r) that large, and, in full fine-tuning, the embedding and the untied head.
    Norm weights and biases are vectors of the hidden or output size, under the limit."""
    total = 0
    for linears, layers in ((model.layer_linears, model.num_layers),
                            (model.encoder_layer_linears, model.num_encoder_layers)):
        per_block = 0
        for lin in linears:
            if plan.is_lora:
                if lin.name in plan.lora_targets:
                    per_block += sum(plan.lora_rank * n >= PAGED_STATE_MIN_NUMEL
                                     for n in (lin.in_features, lin.out_features))
            else:
                per_block += lin.count * lin.in_features * lin.out_features / plan.tp >= PAGED_STATE_MIN_NUMEL
        total += layers * per_block
    embeddings = 0 if plan.is_lora else (1 if model.tie_word_embeddings else 2)
    return total // plan.pp + embeddings


def paged_host_ops(model: ModelSpec, plan: TrainingPlan, *, step_calls: int) -> int:
    """Host calls a paged bitsandbytes optimizer (PAGED_OPTIMIZERS) makes beyond the unpaged one's,
    with the GPU idle behind BNB_SYNC_PER_TENSOR's synchronize: PREFETCH_CALLS_PER_PAGED_TENSOR per
    paged tensor, and the torch.cuda.synchronize() that Optimizer8bit.step adds at its end when
    is_paged (bitsandbytes/optim/optimizer.py, 0.44.1 through HEAD), once per `step_calls`. 0 for
    any other optimizer."""
    if plan.optimizer not in PAGED_OPTIMIZERS:
        return 0
    return PREFETCH_CALLS_PER_PAGED_TENSOR * _paged_state_tensors(model, plan) + step_calls


class OptimizerInBackward(StepTechnique):
    """--optimizer-in-backward: one step() per tensor, inside backward (estimate/backward_techniques.py
    IN_BACKWARD_OPS_PER_TENSOR)."""

    def exposed(self, c, t):
        plan = c.plan
        if plan.optimizer_in_backward and plan.offload_optimizer == "none":
            per_tensor = IN_BACKWARD_OPS_PER_TENSOR[plan.optimizer]
            tensors = _param_tensors(c.model, plan)
            t.optimizer_s = max(t.optimizer_s, tensors * per_tensor * OP_DISPATCH_S)
            if plan.optimizer in EIGHT_BIT_OPTIMIZERS and BNB_SYNC_PER_TENSOR:
                t.optimizer_s += tensors * (per_tensor + 1) * OP_DISPATCH_S
            # one paged optimizer per tensor (torchtune create_optim_in_bwd): each step() prefetches
            # and syncs again after the tensor's own sync, with the GPU idle (paged_host_ops)
            t.optimizer_s += paged_host_ops(c.model, plan, step_calls=tensors) * OP_DISPATCH_S


class Pipeline(StepTechnique):
    """Pipeline parallelism: activations forward and their gradients backward at each stage boundary;
    the 1F1B / GPipe bubble idles (p-1)/(m+p-1) of the time (Narayanan et al. 2021, Sec. 2.2)."""

    def exposed(self, c, t):
        plan, hardware = c.plan, c.hardware
        if plan.pp <= 1:
            return
        act = c.tokens * c.model.hidden_size * _elt(plan)
        pp_bw = hardware.gpu.intra_node_gbps if hardware.num_nodes == 1 else hardware.inter_node_gbps
        m = plan.grad_accum
        t.pp_comm_s, t.bubble = 2 * act / (pp_bw * GB), (m + plan.pp - 1) / m


STEP_TECHNIQUES: tuple[StepTechnique, ...] = (Checkpointing(), Loss(), MixedPrecision(), QuantizedBase(), Lora(),
                                              OptimizerOffload(), ActivationOffload(), ParamOffload(),
                                              OptimizerStep(), OptimizerInBackward(), GradClipping(), Pipeline())
"""In the order they run: a later one reads (and may override) what an earlier one set."""
