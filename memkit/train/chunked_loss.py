"""Chunked cross-entropy: the LM loss without the tokens x vocab logits ever existing at once.

`ChunkedCrossEntropy` is an autograd function of (final hidden states, lm_head weight, labels):
its forward computes the logits of `chunk` tokens at a time and keeps only the loss sum; its
backward recomputes each chunk's logits from the saved hidden states and turns them in place
into the softmax gradient, accumulating grad_hidden and grad_weight (addmm_) chunk by chunk.
The bytes it holds are priced in memkit/estimate/techniques.py; the chunk size rule is
memkit/plan/techniques.py's (liger-kernel's). Numerics: the forward runs the matmul in the autocast
dtype when autocast is on (as HF's lm_head would), the cross-entropy in fp32; the backward
works in the weight's dtype (fp32 under AMP).

Two ways to use it:
- memkit's runner: `apply_chunked_loss(model)` puts a `ChunkedLossHead` in place of the model's
  output embeddings; `loss_sum(model, head, input_ids, attention_mask, labels)` returns the sum
  of token losses (the head returns it instead of logits).
- HF Trainer: `chunked_causal_lm(model)` does the same and wraps the model's forward so that
  `model(input_ids=..., labels=...)` returns `.loss` (mean over target tokens, or sum /
  num_items_in_batch as Trainer passes it) with `logits=None`.
"""
from __future__ import annotations

import functools

import torch

from memkit.errors import MemkitError
from memkit.plan.techniques import loss_chunk_tokens

IGNORE_INDEX = -100  # transformers / torch cross_entropy default


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        """hidden [N, H], weight [V, H], labels [N] (already shifted; IGNORE_INDEX = no target)."""
        device = hidden.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            w = weight.to(autocast) if autocast is not None else weight
            for start in range(0, hidden.shape[0], chunk):
                h = hidden[start:start + chunk]
                y = labels[start:start + chunk]
                logits = torch.mm(h.to(w.dtype), w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                valid = y != IGNORE_INDEX
                target = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
                del logits
                total += ((lse - target) * valid).sum()
            del w
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        chunk = ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = grad_total.float()
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].to(weight.dtype)
            y = labels[start:start + chunk]
            grad = torch.mm(h, weight.t()).float()
            grad.sub_(torch.logsumexp(grad, dim=-1, keepdim=True)).exp_()  # softmax, in place
            valid = y != IGNORE_INDEX
            rows = torch.arange(y.shape[0], device=y.device)
            grad[rows, torch.where(valid, y, 0)] -= 1.0
            grad.mul_((valid.float() * scale).unsqueeze(1))
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = torch.mm(grad, weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), h)
            del grad
        return grad_hidden, grad_weight, None, None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: labels shifted left, IGNORE_INDEX at each sequence's end (as
    transformers loss/loss_utils.py ForCausalLMLoss and memkit's causal_lm_loss_sum)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


class ChunkedLossHead(torch.nn.Module):
    """Stands in for a causal LM's lm_head. With `labels` set (shifted, [B, S]) its forward
    returns the summed token loss of the hidden states it is given; without, plain logits (so
    evaluation and generation still work). It owns the original weight Parameter (tied
    embeddings stay tied), so ZeRO-3 gathers it around this module's forward and backward."""

    def __init__(self, lm_head: torch.nn.Module, *, fused: bool = False):
        super().__init__()
        self.fused = fused
        """liger-kernel's fused linear cross-entropy instead (CUDA + Triton; not tested here)."""
        if getattr(lm_head, "bias", None) is not None:
            raise MemkitError("--loss chunked: this model's lm_head has a bias; use --loss standard")
        self.weight = lm_head.weight
        self.labels: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return torch.nn.functional.linear(hidden, self.weight)
        labels, self.labels = self.labels, None
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.fused:
            try:
                from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            except ImportError:
                raise MemkitError("--loss fused needs liger-kernel on a CUDA machine (pip install "
                                  "liger-kernel); or use --loss chunked") from None
            fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
            return fn(self.weight, flat, labels.reshape(-1).to(hidden.device))
        chunk = loss_chunk_tokens(flat.shape[0], self.weight.shape[0], flat.shape[1])
        return ChunkedCrossEntropy.apply(flat, self.weight, labels.reshape(-1).to(hidden.device), chunk)


_UNSUPPORTED = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def apply_chunked_loss(model, *, fused: bool = False) -> ChunkedLossHead:
    """Replace the model's output embeddings by a ChunkedLossHead; returns it. Refuses models
    whose logits are post-processed after the head (soft-capping, scaling)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    for key in _UNSUPPORTED:
        if getattr(config, key, None) not in (None, 1, 1.0):
            raise MemkitError(f"--loss chunked: {config.model_type} applies {key}={getattr(config, key)} "
                              "to its logits after the head; use --loss standard")
    head = base.get_output_embeddings()
    if isinstance(head, ChunkedLossHead):
        return head
    if head is None or not hasattr(head, "weight"):
        raise MemkitError(f"--loss chunked: {type(base).__name__} has no linear output embeddings; "
                          "use --loss standard")
    new = ChunkedLossHead(head, fused=fused)
    base.set_output_embeddings(new)
    return new


def find_head(model) -> ChunkedLossHead | None:
    for module in model.modules():
        if isinstance(module, ChunkedLossHead):
            return module
    return None


def loss_sum(model, head: ChunkedLossHead, *, input_ids, labels, attention_mask=None,
             position_ids=None) -> torch.Tensor:
    """Sum of next-token losses of one micro-batch through the chunked head (model may be a
    DeepSpeed engine or an Accelerate-wrapped module); position_ids: --packing isolated."""
    head.labels = shift_labels(labels)
    extra = ({"position_ids": position_ids, "use_cache": False} if position_ids is not None
             else {"attention_mask": attention_mask})
    out = model(input_ids=input_ids, **extra)
    head.labels = None
    return out.logits


def chunked_causal_lm(model, *, fused: bool = False):
    """For HF Trainer users: the model, trained with the chunked loss. `model(..., labels=L)`
    returns an output whose `.loss` is the mean over target tokens (sum / num_items_in_batch
    when Trainer passes it, as transformers' own loss does) and whose `.logits` is None."""
    head = apply_chunked_loss(model, fused=fused)
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:
            return inner(*args, **kwargs)
        shifted = shift_labels(labels)
        head.labels = shifted
        out = inner(*args, **kwargs)
        head.labels = None
        total = out.logits
        count = num_items_in_batch if num_items_in_batch is not None else (shifted != IGNORE_INDEX).sum()
        out.loss = total / count
        out.logits = None
        return out

    model.forward = forward
    return model
