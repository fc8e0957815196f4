"""Bytes and time of activation offload and of the optimizer in backward
(rules: memkit/plan/backward_techniques.py).

Activation offload (`--offload-activations cpu`, memkit/train/backward_techniques.py):
- Moved to host RAM per micro-batch: every distinct storage the forward saves for backward that
  is not a parameter -- the blocks' saved activations (or, for checkpointed blocks, their inputs,
  which torch's non-reentrant checkpoint saves through the hooks), under autocast the 16-bit
  weight copies the matmuls save, the head's saved tensors (fp32 log-probs) and the embedding's
  ids. Parameters stay (torchtune _activation_offloading.py skips nn.Parameter).
- Left on the GPU: the block being run (forward) or being differentiated (backward, its tensors
  copied back), the loss's tensors while the loss runs, and the autocast weight cache, which
  torch keeps for the whole autocast region (torch/csrc/autograd/autocast_mode.cpp cached_cast).
- Host RAM: the moved bytes, in pinned memory (torch/autograd/graph.py save_on_cpu,
  pin_memory=True), per local rank; one micro-batch at a time (each backward frees its copies).
- Time: each moved byte crosses PCIe twice per micro-step (device-to-host in forward, back in
  backward) at the GPU's host-link bandwidth (spec/hardware.py GPU.pcie_gbps, the figure
  ZeRO-Offload's traffic uses in estimate/throughput.py _offload). save_on_cpu copies on the
  compute stream, so nothing overlaps: the transfer adds to the micro-step.

Optimizer in backward (`--optimizer-in-backward`): one parameter's gradient exists at a time
(torch Tensor.register_post_accumulate_grad_hook; the hook steps and frees it), and the step's
temporaries are one parameter's (torch.optim on a one-tensor group). Optimizer states unchanged.
"""
from __future__ import annotations

from memkit.estimate.activations import block_activations, numerics
from memkit.estimate.techniques import loss_activations, selective_kept_bytes
from memkit.plan.plan import TrainingPlan
from memkit.spec.model import ModelSpec
from memkit.plan.techniques import checkpointed_blocks

GB = 1e9


def autocast_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Per block, the 16-bit copies torch.autocast makes of the linear weights (0 without autocast).
    torch.autocast caches the bf16 copy of every linear weight for the whole forward
    (torch/csrc/autograd/autocast_mode.cpp, cached_cast); the matmuls save them for backward.
    MoE experts' grouped_mm is not autocast (transformers moe.py)."""
    num = numerics(plan)
    if not num.autocast:
        return 0
    return num.autocast * sum(
        lin.count * lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
        for lin in spec.layer_linears if not lin.role.startswith("expert"))


def largest_autocast_copy_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """One linear's 16-bit weight copy (the largest of a block), which its matmul saved and its
    backward node unpacks beside the input under activation offload (0 without autocast)."""
    num = numerics(plan)
    if not num.autocast:
        return 0
    return num.autocast * max((lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
                               for lin in spec.layer_linears if not lin.role.startswith("expert")), default=0)


def offloads_activations(plan: TrainingPlan) -> bool:
    return plan.offload_activations != "none"


def offloaded_activation_bytes(spec: ModelSpec, plan: TrainingPlan, *, device: str = "cuda") -> int:
    """Bytes one micro-batch's forward moves to host RAM (0 without activation offload)."""
    if not offloads_activations(plan):
        return 0
    num = numerics(plan)
    blk = block_activations(spec, plan, device=device)
    head = loss_activations(spec, plan, device=device)
    n = spec.total_layers
    k = checkpointed_blocks(plan.checkpointing, n)
    kept = blk.input_bytes + (selective_kept_bytes(spec, plan) if plan.checkpointing == "selective" else 0)
    full = blk.saved_bytes + autocast_copy_bytes(spec, plan)
    head_copy = (num.autocast * spec.vocab_size * spec.hidden_size
                 if num.autocast and plan.loss == "standard" else 0)
    ids = plan.micro_batch_size * plan.seq_len * 8  # the embedding saves the int64 ids
    if k == 0 and first_block_input_frozen(spec, plan):  # block 0 saves less (see there)
        first = block_activations(spec, plan, device=device, input_requires_grad=False)
        return first.saved_bytes + autocast_copy_bytes(spec, plan) + (n - 1) * full \
            + head.saved_bytes + head_copy + ids
    return k * kept + (n - k) * full + head.saved_bytes + head_copy + ids


def first_block_input_frozen(spec: ModelSpec, plan: TrainingPlan) -> bool:
    """LoRA on a plain (not 4-bit) decoder: the embedding is frozen and nothing makes its output
    require grad (peft's enable_input_require_grads runs only in prepare_model_for_kbit_training),
    so block 0's input norm and the LoRA dropouts reading it save nothing (autograd saves `other`
    for a mul only if `self` requires grad: tools/autograd/derivatives.yaml). Measured: the pack
    hook's bytes (benchmarks/measure_cpu_backward.py, llama/qwen2 lora8 offload rows) are the tape's
    minus block 0's input norm and its two dropout noises. Not used where block 0 is checkpointed
    (its kept input is what moves) or for traced families (no tape replay)."""
    return plan.is_lora and not plan.is_quantized and spec.kind == "decoder" and not spec.traced


def offloaded_loss_backward_saved(spec: ModelSpec, plan: TrainingPlan) -> int | None:
    """With activation offload and the standard loss, the saved bytes on the GPU at the loss
    backward's peak (log_softmax's backward): only the fp32 log-probs that node unpacks
    (torch/csrc/autograd: a SavedVariable's unpack hook runs when its node applies, and the copy
    dies when the node returns). The final norm's tensors, the lm_head input and under autocast
    the head weight's 16-bit copy stay on the host until the head's own nodes run, after the
    logits-sized gradients are freed. Measured (benchmarks/offload_backward_nodes.py --row
    qwen2-bf16-sdpa-lora8-offload): unpacked copies + gradients = 3 x tokens x V x 4 bytes there.
    None: not offloaded, or a chunked / fused loss (not measured with offload; priced as without it)."""
    if not offloads_activations(plan) or plan.loss != "standard":
        return None
    return plan.micro_batch_size * plan.seq_len * spec.vocab_size * 4


def activation_offload_transfer_s(spec: ModelSpec, plan: TrainingPlan, pcie_gbps: float) -> float:
    """PCIe seconds per micro-step: the moved bytes out in forward and back in backward."""
    return 2 * offloaded_activation_bytes(spec, plan) / (pcie_gbps * GB)


def largest_block_tensor(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Elements of the largest trainable tensor of one block: under LoRA the largest adapter
    matrix (r x in or out x r of a targeted linear), else the largest linear weight."""
    if plan.is_lora:
        return max((plan.lora_rank * max(lin.in_features, lin.out_features)
                    for lin in spec.layer_linears if lin.name in plan.lora_targets), default=0)
    return max((lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
                for lin in spec.layer_linears), default=0)


def _step_bytes(plan: TrainingPlan, numel: int) -> tuple[int, int]:
    """(gradient bytes, step temporaries) of one tensor stepped alone. AdamW (foreach) on a
    one-tensor group allocates exp_avg_sq_sqrt the size of that tensor (estimate/states.py _adam_temp)."""
    grad_b = 2 if plan.precision == "bf16-pure" else 4
    return numel * grad_b, (numel * grad_b if plan.optimizer == "adamw" else 0)


def one_gradient_states(st, spec: ModelSpec, plan: TrainingPlan):
    """`st` (estimate/states.py States) for the optimizer in backward: in a block's backward, one
    of its parameters' gradient and step temporaries; returns it. A tied embedding/head weight's
    hook fires once, after its second use (the embedding) has added its part: the autograd
    engine holds the head's part in the weight's input buffer through the whole backward
    (torch/csrc/autograd/input_buffer.cpp). An untied head steps right after its own backward,
    when the loss's gradients (2 x tokens x V x 4 bytes) are already freed, and is never larger
    than them for tokens >= hidden size; it is not a moment of its own here."""
    if not plan.optimizer_in_backward or st.gradients == 0:
        return st
    grad, temp = _step_bytes(plan, largest_block_tensor(spec, plan))
    tied = spec.tie_word_embeddings and not plan.is_lora
    st.gradients = grad + (_step_bytes(plan, spec.vocab_size * spec.hidden_size)[0] if tied else 0)
    st.step_transient = temp
    st.gradients_grow = False
    return st

IN_BACKWARD_OPS_PER_TENSOR = {"adamw": 9, "sgd": 3, "adamw-8bit": 3, "paged-adamw-8bit": 3, "adafactor": 15}
"""Ops one optimizer issues per step of a one-tensor group (the optimizer in backward steps each
tensor alone). torch/optim/adamw.py _multi_tensor_adamw: _foreach_add_ (step), weight-decay
_foreach_mul_, _foreach_lerp_, _foreach_mul_, _foreach_addcmul_, _foreach_sqrt, _foreach_div_,
_foreach_add_, _foreach_addcdiv_ = 9; torch/optim/sgd.py (momentum): mul_, add_ (buffer), add_
(param) = 3; bitsandbytes' fused 8-bit kernel and Adafactor as in estimate/throughput.py
OPTIMIZER_OPS_PER_TENSOR. The update's HBM traffic is the same as one fused step."""
