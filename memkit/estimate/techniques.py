"""Bytes and FLOPs of the memory-saving techniques (memkit/plan/techniques.py states their rules).

- Chunked cross-entropy (memkit/train/chunked_loss.py, the runner's and the Trainer recipe's
  implementation): forward keeps no logits; it saves the final hidden states (N x H) instead of
  the fp32 log-probs (N x V). One chunk of c tokens holds its logits and one fp32 work tensor at
  a time: forward `logits.float()` + logsumexp's `(x - max).exp()` (aten ReduceOps.cpp,
  logsumexp_out_impl), backward the recomputed logits and their in-place softmax + the 16-bit
  cast of the gradient, 8 bytes x c x V at most either way. Backward also allocates the whole
  grad of the hidden states (N x H) and, for a trainable head, its weight gradient at once
  (accumulated chunk by chunk with addmm_), so the head's gradient lands when the loss backward
  starts. Under torch autocast the forward casts the head weight once (V x H x 2 bytes, freed
  at its end; nothing is cached for the rest of the forward).
- liger-kernel fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py):
  the forward writes each chunk's gradient into its logits in place and accumulates grad_input
  (N x H) and grad_weight (V x H, weight dtype) there; both are saved for backward, which only
  scales them. Priced, not measured (no CUDA here).
- Step time: the chunked loss runs the head's matmul once more in backward (2 H V FLOPs per
  token, the recomputed logits); liger's computes the gradients in the forward: none extra.
  Partial checkpointing recomputes K of the L blocks: K/L of full checkpointing's recompute
  (Chen et al. 2016, Sec. 3: recompute cost is the forward of the dropped segments).
"""
from __future__ import annotations

from dataclasses import replace

from memkit.estimate.activations import HeadActivations, head_activations, numerics
from memkit.plan.plan import TrainingPlan
from memkit.spec.model import ModelSpec
from memkit.plan.techniques import checkpointed_blocks, loss_chunk_tokens


def loss_activations(spec: ModelSpec, plan: TrainingPlan, *, device: str = "cuda") -> HeadActivations:
    """Final norm + LM head + loss of one micro-batch, for the plan's loss."""
    standard = head_activations(spec, plan, device=device)
    if plan.loss == "standard":
        return standard
    num = numerics(plan)
    tokens = plan.micro_batch_size * plan.seq_len
    h, v = spec.hidden_size, spec.vocab_size
    chunk = loss_chunk_tokens(tokens, v, h)
    stream = num.stream_itemsize
    compute = num.autocast or num.weight_itemsize
    # What the standard head saves besides the final norm's tensors: the lm_head input (only when
    # its weight trains; the autocast copy under AMP) and the fp32 log-probs.
    head_input = 0 if plan.is_lora else tokens * h * compute
    norm_saved = standard.saved_bytes - tokens * v * 4 - head_input
    hidden = tokens * h * stream
    if plan.loss == "chunked":
        weight_cast = v * h * compute if num.autocast else 0
        return replace(standard, saved_bytes=norm_saved + hidden,
                       forward_peak_bytes=8 * chunk * v + weight_cast,
                       backward_peak_bytes=8 * chunk * v + hidden)
    # fused (liger): grad_input and grad_weight live from the forward on; the chunk's logits
    # are its only work tensor.
    grad_weight = 0 if plan.is_lora else v * h * num.weight_itemsize
    return replace(standard, saved_bytes=norm_saved + hidden + grad_weight,
                   forward_peak_bytes=chunk * v * compute, backward_peak_bytes=0)


def head_grad_lands_early(plan: TrainingPlan) -> bool:
    """The chunked loss allocates the head's weight gradient when the loss backward starts, not
    after the head's own backward (liger's is in its saved bytes from the forward on)."""
    return plan.loss == "chunked"


def recompute_share(plan: TrainingPlan, num_blocks: int) -> float:
    """Share of full checkpointing's recompute the plan pays (K/L for partial)."""
    if num_blocks <= 0:
        return 0.0
    if plan.checkpointing == "selective":
        # Only the elementwise ops between the kept matmuls rerun: no matmul FLOPs (their memory
        # traffic is not priced).
        return 0.0
    return checkpointed_blocks(plan.checkpointing, num_blocks) / num_blocks


def loss_recompute_flops_per_token(spec: ModelSpec, plan: TrainingPlan) -> float:
    """The chunked loss recomputes the logits in backward: one more head matmul."""
    return 2.0 * spec.hidden_size * spec.vocab_size if plan.loss == "chunked" else 0.0


def loss_component(plan: TrainingPlan) -> str:
    """Name of the loss's bytes in an estimate's components: 'logits_and_loss' (the full fp32
    logits), 'chunked_loss' or 'fused_loss' (saved hidden states + one chunk's buffers)."""
    return "logits_and_loss" if plan.loss == "standard" else f"{plan.loss}_loss"


def selective_kept_bytes(spec: ModelSpec, plan: TrainingPlan) -> int:
    """Per block under selective checkpointing, what the policy keeps besides the block input:
    the output of every matmul (aten mm/addmm/bmm; LoRA's two included) and of the attention
    kernel (out + fp32 logsumexp), in the compute dtype (memkit/train/techniques.py's policy,
    torchtitan's _save_list). Everything else is recomputed in backward."""
    num = numerics(plan)
    act = num.autocast or num.weight_itemsize
    tokens = plan.micro_batch_size * plan.seq_len
    tp = plan.tp
    out = 0
    targets = set(plan.lora_targets) if plan.is_lora else set()
    for lin in spec.layer_linears:
        split = tp if lin.tp_style != "replicate" else 1
        out += lin.count * tokens * lin.out_features // split
        if lin.name in targets:  # lora_A (rank) and lora_B (out) are matmuls too
            out += lin.count * tokens * (plan.lora_rank + lin.out_features // split)
    heads = spec.num_attention_heads // tp
    attn = tokens * heads * spec.head_dim * act + heads * tokens * 4
    if plan.attention == "eager":  # q @ k^T scores and probs @ v: two bmm outputs
        attn = tokens * heads * plan.seq_len * act + tokens * heads * spec.head_dim * act
    return out * act + attn
