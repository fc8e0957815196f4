"""Step-time model: how long one optimizer step of a TrainingPlan takes, hence tokens/s and MFU.

The planner ranks feasible plans with it, so it must order plans correctly more than it must be
exact. Each term cites its source; the constants that are assumptions (not measurements) are named
at the top with the reasoning behind them. Pure arithmetic: no torch, no I/O, microseconds per call.

Per GPU and per optimizer step (m = grad_accum micro-steps):

    step = pipeline_factor * m * (compute + exposed comm + exposed offload traffic)   per micro-step
         + once-per-step terms (gradient sync at the accumulation boundary, optimizer step,
           offload transfers that cannot overlap)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memkit.estimate.techniques import loss_recompute_flops_per_token, recompute_share
from memkit.plan import TrainingPlan
from memkit.spec.hardware import Hardware
from memkit.spec.model import ModelSpec

# ---- assumptions (named, not measured here; each says why) -----------------------------------

PEAK_FRACTION = 0.45
"""Achievable fraction of dense peak for transformer fwd+bwd with large matmuls in 16-bit on
A100/H100 class GPUs. Megatron-LM reaches 44-52% MFU on A100 (Narayanan et al. 2021, Table 1;
Korthikanti et al. 2022, Table 5); PaLM reports 46.2% (Chowdhery et al. 2022, Sec. 4.1 / App. B).
Hugging Face fine-tuning stacks usually land a little lower, so 0.45 is the large-batch ceiling."""

HALF_EFFICIENCY_TOKENS = 256
"""Tokens per micro-batch (micro_batch_size * seq_len, the M dimension of every matmul) at which a
GPU reaches half of PEAK_FRACTION. Small M leaves tensor cores idle (GEMM efficiency falls with M,
cf. NVIDIA 'Matrix Multiplication Background' user guide, Sec. 'Dimension quantization effects');
the saturating curve eff(M) = PEAK_FRACTION * M / (M + 256) gives 0.40 at M = 2048 and 0.44 at
M = 8192."""

OVERLAP_FRACTION = 0.7
"""Share of the compute window that bucketed gradient reduction / ZeRO-3 prefetch can hide.
Communication kernels compete with compute for SMs and HBM, so overlap is partial (PyTorch DDP,
Li et al. 2020, VLDB, Sec. 3.2.3 and Fig. 7 show a fraction, not all, of allreduce hidden)."""

HOST_MEMORY_GBPS_PER_NODE = 100.0
"""Host DRAM bandwidth CPU-Adam achieves on one node (all its cores). CPU-Adam is a streaming,
memory-bound kernel (ZeRO-Offload, Ren et al. 2021, Sec. 5.1 vectorises it with AVX for that
reason); a two-socket server streams ~200-300 GB/s, and the optimizer reaches about half."""

CPU_ADAM_BYTES_PER_PARAM = 30
"""fp32 param, fp32 grad, m, v read (16 B) + param, m, v written (12 B) + the 16-bit copy (2 B)."""

NVME_GBPS_PER_NODE = 6.0
"""One PCIe 4.0 NVMe drive per node (~7 GB/s read, ~5 GB/s write); ZeRO-Infinity (Rajbhandari et
al. 2021, Sec. 6.2) stripes several for more. Conservative on purpose: NVMe plans rank last."""

GPU_OPTIMIZER_BYTES_PER_PARAM = {"adamw": 32, "adamw-8bit": 14, "paged-adamw-8bit": 14, "adafactor": 20, "sgd": 12}
"""HBM bytes the optimizer step reads+writes per trainable parameter (Adam: fp32 master, m, v
read and written, grad read, 16-bit copy written); the step is memory-bound (roofline, Williams
et al. 2009), so time = bytes / HBM bandwidth."""

HOST_OVERHEAD_S_PER_LAYER = 0.5e-3
"""CPU-side time per transformer block per micro-step (forward + backward): Python module calls
and ~100 kernel launches at ~5 us each. Invisible for big micro-batches, dominant for tiny ones;
it is what makes many small micro-steps slower than few large ones at equal FLOPs."""

ZERO3_OVERHEAD_S_PER_LAYER = 3.0e-3
"""Extra per block per micro-step under ZeRO-3: DeepSpeed's pre/post forward and backward hooks on
each of a block's ~10 parameterised submodules (~40 calls) fetch, release and track partitioned
parameters in Python and wait on the fetches, at ~50-75 us a call (deepspeed/runtime/zero/
parameter_offload.py, partitioned_param_coordinator.py). Not hidden. It reproduces the order the
transformers DeepSpeed guide gives when memory is no object: stage 2 faster than stage 3."""

STEP_OVERHEAD_S = 10e-3
"""Fixed per optimizer step: gradient-norm clipping, overflow checks, scheduler, logging."""

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeEstimate:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, App. B): model FLOPs / (time * peak)."""
    hfu: float
    """Hardware FLOPs utilisation: counts the recompute forward too (Korthikanti et al. 2022, Sec. 6)."""
    model_flops_per_step: float
    compute_efficiency: float
    """Fraction of peak the matmuls are assumed to reach at this micro-batch."""
    components_s: dict[str, float] = field(default_factory=dict)
    """Seconds per optimizer step by term (compute, recompute, pipeline_bubble, dp_comm, tp_comm,
    pp_comm, offload_transfer, optimizer_step, host_overhead)."""

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "hfu": self.hfu, "model_flops_per_step": self.model_flops_per_step,
                "compute_efficiency": self.compute_efficiency, "components_s": dict(self.components_s)}


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


def flops_per_token(model: ModelSpec, plan: TrainingPlan) -> tuple[float, float]:
    """(model FLOPs, extra recompute FLOPs) per token of one training step."""
    n = matmul_params(model)
    # Dense matmuls: 2N forward, 4N backward = 6N (Kaplan et al. 2020, Sec. 2.1). With LoRA the
    # frozen weights get no weight gradient, so backward is 2N (input grads only) and the
    # adapters are negligible (Hu et al. 2021, Sec. 4.2: no gradients for most parameters).
    dense_fwd = 2.0 * n
    dense_bwd = 2.0 * n if plan.is_lora else 4.0 * n
    # Attention scores and weighted values: 12 * L * H * Q * T per token for fwd+bwd (PaLM,
    # Chowdhery et al. 2022, App. B; H*Q = heads * head_dim, T = sequence length); 1/3 is forward.
    attn_total = 12.0 * model.total_layers * model.num_attention_heads * model.head_dim * plan.seq_len
    attn_fwd = attn_total / 3.0
    model_flops = dense_fwd + dense_bwd + attn_total
    # Full activation checkpointing recomputes each block's forward in backward: one more forward
    # (Korthikanti et al. 2022, Sec. 5; Chen et al. 2016).
    # Partial checkpointing pays K/L of it; the chunked loss recomputes the logits
    # (memkit/estimate/techniques.py).
    recompute = (dense_fwd + attn_fwd) * recompute_share(plan, model.total_layers) \
        + loss_recompute_flops_per_token(model, plan)
    return model_flops, recompute


def compute_efficiency(plan: TrainingPlan) -> float:
    tokens = plan.micro_batch_size * plan.seq_len
    return PEAK_FRACTION * tokens / (tokens + HALF_EFFICIENCY_TOKENS)


def _ring_time_s(num_bytes: float, num_ranks: int, bus_gbps: float, *, allreduce: bool) -> float:
    """Ring collective time: all-reduce moves 2(n-1)/n of the buffer per rank, reduce-scatter and
    all-gather (n-1)/n (Patarasuk & Yuan 2009; nccl-tests 'busbw' uses the same factors)."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    factor = (2.0 if allreduce else 1.0) * (num_ranks - 1) / num_ranks
    return num_bytes * factor / (bus_gbps * GB)


def _grad_bytes(plan: TrainingPlan) -> int:
    """Gradients travel in the training dtype: 16-bit under fp16/bf16 (DeepSpeed's
    communication_data_type defaults to it), 4 bytes under fp32."""
    return 4 if plan.precision == "fp32" else 2


def _param_bytes(plan: TrainingPlan) -> int:
    return 4 if plan.precision == "fp32" else 2


def estimate_step_time(model: ModelSpec, plan: TrainingPlan, hardware: Hardware) -> StepTimeEstimate:
    gpu = hardware.gpu
    num_gpus = plan.num_gpus
    m = plan.grad_accum
    tokens_micro = plan.micro_batch_size * plan.seq_len  # per data-parallel rank
    model_fpt, recompute_fpt = flops_per_token(model, plan)
    eff = compute_efficiency(plan)
    peak = gpu.peak_tflops(plan.precision) * 1e12
    # Each GPU does 1/(tp*pp) of a micro-batch's work (Megatron, Narayanan et al. 2021, Sec. 2).
    shard = plan.tp * plan.pp
    t_compute = model_fpt * tokens_micro / shard / (peak * eff)
    t_recompute = recompute_fpt * tokens_micro / shard / (peak * eff)
    t_micro_compute = t_compute + t_recompute
    t_bwd_window = t_micro_compute * (2.0 / 3.0)  # backward is ~2/3 of fwd+bwd FLOPs (6N = 2N + 4N)

    # ---- data-parallel communication (ZeRO paper, Rajbhandari et al. 2020, Sec. 7) ----------
    n_local = model.num_params / shard          # parameters held by this tp/pp slice
    trainable = _trainable_params(model, plan) / shard
    dp = plan.dp
    # DP ranks sit on one node when tp*dp fits in it (ranks ordered tp, dp, pp as in Megatron).
    dp_bw = gpu.intra_node_gbps if (hardware.num_nodes == 1 or plan.tp * dp <= hardware.num_gpus_per_node) \
        else min(gpu.intra_node_gbps, hardware.inter_node_gbps)
    grad_b = trainable * _grad_bytes(plan)
    par_b = n_local * _param_bytes(plan)
    per_micro_overlappable = 0.0   # hidden under compute up to OVERLAP_FRACTION of its window
    per_step_exposed = 0.0         # at the accumulation boundary, not hidden
    overlap = plan.overlap_comm
    if plan.zero_stage == 0:
        # DDP-equivalent all-reduce of 2*Psi per step (Sec. 7.1); DeepSpeed's engine reduces at the
        # accumulation boundary after backward, so it is exposed.
        per_step_exposed += _ring_time_s(grad_b, dp, dp_bw, allreduce=True)
    elif plan.zero_stage == 1:
        # Reduce-scatter of gradients at the boundary + all-gather of updated 16-bit params:
        # 2*Psi, the same volume as DDP (Sec. 7.2.1).
        rs = _ring_time_s(grad_b, dp, dp_bw, allreduce=False)
        per_step_exposed += _ring_time_s(trainable * _param_bytes(plan), dp, dp_bw, allreduce=False)
        per_step_exposed += max(0.0, rs - (OVERLAP_FRACTION * t_bwd_window if overlap else 0.0))
    elif plan.zero_stage == 2:
        # Gradients reduce-scattered during every micro-step's backward (partitioned gradients),
        # params all-gathered once after the step (Sec. 7.2.1).
        rs = _ring_time_s(grad_b, dp, dp_bw, allreduce=False)
        per_micro_overlappable += rs if overlap else 0.0
        per_step_exposed += 0.0 if overlap else m * rs
        per_step_exposed += _ring_time_s(trainable * _param_bytes(plan), dp, dp_bw, allreduce=False)
    else:
        # ZeRO-3: all-gather params in forward and again in backward, reduce-scatter grads:
        # 3*Psi, 1.5x DDP (Sec. 7.2.2), every micro-step; prefetch overlaps the gathers.
        ag = _ring_time_s(par_b, dp, dp_bw, allreduce=False)
        rs = _ring_time_s(grad_b, dp, dp_bw, allreduce=False)
        per_micro_overlappable += 2 * ag + rs
    window = OVERLAP_FRACTION * (t_micro_compute if plan.zero_stage == 3 else t_bwd_window)

    # ---- offload traffic (ZeRO-Offload, Ren et al. 2021, Sec. 4; ZeRO-Infinity Sec. 5) -------
    pcie = gpu.pcie_gbps * GB
    per_micro_offload = 0.0
    per_step_offload = 0.0
    partition = trainable / (dp if plan.zero_stage >= 1 else 1)
    gpus_per_node = hardware.num_gpus_per_node
    if plan.offload_optimizer != "none":
        # Sec. 4.1: 16-bit gradients go GPU->CPU during backward (overlapped), the CPU runs Adam,
        # updated 16-bit params come back CPU->GPU after the step (exposed).
        per_micro_offload += partition * _grad_bytes(plan) / pcie
        per_step_offload += partition * _param_bytes(plan) / pcie
        host_bw = HOST_MEMORY_GBPS_PER_NODE * GB / gpus_per_node  # ranks share the node's DRAM
        per_step_offload += partition * CPU_ADAM_BYTES_PER_PARAM / host_bw
        if plan.offload_optimizer == "nvme":
            # fp32 master, m, v read from and written back to NVMe every step (12 B each way).
            per_step_offload += 2 * partition * 12 / (NVME_GBPS_PER_NODE * GB / gpus_per_node)
    if plan.offload_params != "none":
        # ZeRO-3 param offload: this rank's partition crosses PCIe for forward and for backward.
        p_part = n_local / dp * _param_bytes(plan)
        per_micro_offload += 2 * p_part / pcie
        if plan.offload_params == "nvme":
            per_micro_offload += 2 * p_part / (NVME_GBPS_PER_NODE * GB / gpus_per_node)

    exposed_micro = max(0.0, per_micro_overlappable + per_micro_offload - window)
    dp_micro_exposed = max(0.0, per_micro_overlappable - window)
    offload_micro_exposed = exposed_micro - dp_micro_exposed

    # ---- tensor parallel (Megatron, Shoeybi et al. 2019, Sec. 3) ------------------------------
    # Two all-reduces of b*s*h activations in forward and two in backward per layer; the
    # recompute forward repeats the forward two (Korthikanti et al. 2022, Sec. 5). Not overlapped.
    t_tp_micro = 0.0
    if plan.tp > 1:
        layers_here = model.total_layers / plan.pp
        act_b = tokens_micro * model.hidden_size * _param_bytes(plan)
        num_allreduce = 4 + 2 * recompute_share(plan, model.total_layers)
        t_tp_micro = layers_here * num_allreduce * _ring_time_s(act_b, plan.tp, gpu.intra_node_gbps,
                                                                allreduce=True)

    # ---- pipeline parallel ---------------------------------------------------------------------
    t_pp_micro = 0.0
    bubble_factor = 1.0
    if plan.pp > 1:
        # Point-to-point activations forward and their gradients backward at each stage boundary.
        act_b = tokens_micro * model.hidden_size * _param_bytes(plan)
        pp_bw = gpu.intra_node_gbps if hardware.num_nodes == 1 else hardware.inter_node_gbps
        t_pp_micro = 2 * act_b / (pp_bw * GB)
        # 1F1B / GPipe bubble: (p-1)/(m+p-1) of the time is idle (Narayanan et al. 2021, Sec. 2.2;
        # Huang et al. 2019, GPipe Sec. 2.3), i.e. the busy time stretches by (m+p-1)/m.
        bubble_factor = (m + plan.pp - 1) / m

    # Kernel launches overlap the GPU's work (CUDA is asynchronous), so only the excess shows;
    # ZeRO-3's hooks synchronise on parameter fetches, so theirs adds.
    layers_here = model.total_layers / plan.pp
    t_host_micro = layers_here * HOST_OVERHEAD_S_PER_LAYER
    t_zero3_micro = layers_here * ZERO3_OVERHEAD_S_PER_LAYER if plan.zero_stage == 3 else 0.0
    micro_total = max(t_micro_compute, t_host_micro) + t_zero3_micro + exposed_micro + t_tp_micro + t_pp_micro
    pipeline_time = micro_total * m * bubble_factor

    # ---- optimizer step on the GPU (memory-bound) ------------------------------------------
    t_opt = 0.0
    if plan.offload_optimizer == "none":
        t_opt = partition * GPU_OPTIMIZER_BYTES_PER_PARAM[plan.optimizer] / (gpu.hbm_gbps * GB)

    step = pipeline_time + per_step_exposed + per_step_offload + t_opt + STEP_OVERHEAD_S
    tokens_step = plan.tokens_per_step
    model_flops_step = model_fpt * tokens_step
    peak_all = peak * num_gpus
    components = {
        "compute": t_compute * m,
        "recompute": t_recompute * m,
        "pipeline_bubble": micro_total * m * (bubble_factor - 1.0),
        "dp_comm": dp_micro_exposed * m + per_step_exposed,
        "tp_comm": t_tp_micro * m,
        "pp_comm": t_pp_micro * m,
        "offload_transfer": offload_micro_exposed * m + per_step_offload,
        "optimizer_step": t_opt,
        "host_overhead": (max(0.0, t_host_micro - t_micro_compute) + t_zero3_micro) * m + STEP_OVERHEAD_S,
    }
    return StepTimeEstimate(
        step_time_s=step,
        tokens_per_s=tokens_step / step,
        mfu=model_flops_step / (step * peak_all),
        hfu=(model_fpt + recompute_fpt) * tokens_step / (step * peak_all),
        model_flops_per_step=model_flops_step,
        compute_efficiency=eff,
        components_s=components,
    )


def _trainable_params(model: ModelSpec, plan: TrainingPlan) -> int:
    if plan.is_lora:
        return model.lora_params(plan.lora_rank, plan.lora_targets)
    return model.num_params
