"""Rules of the memory-saving techniques a plan can ask for, shared by the estimator, the planner,
the emitters and the runner (torch-free, like memkit/plan/parallel.py): which blocks a partial
checkpoint covers, how many tokens one loss chunk holds, and what each technique cannot run with.

- Partial ("sublinear") activation checkpointing: `--checkpointing K` checkpoints K of the L
  decoder blocks (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", Sec. 3-4:
  keep only some blocks' inputs, recompute their insides in backward). Which K: the FIRST K
  (blocks 0..K-1). The activations alive at the loss are the same for any K blocks
  ((L-K) full blocks + K block inputs), but backward runs from the last block down: with the
  first K checkpointed, every recompute happens after the un-checkpointed blocks above have
  freed their activations, so the recomputed block never adds to the largest moment (with the
  last K checkpointed, each recompute would sit on top of all L-K full blocks). Evenly spaced
  blocks (Chen's sqrt(n) segments) would be in between.
- Chunked cross-entropy (`--loss chunked`): the logits of `loss_chunk_tokens` tokens at a time,
  recomputed in backward from the final hidden states (memkit/train/chunked_loss.py), so the
  tokens x vocab fp32 logits never exist at once. `--loss fused`: liger-kernel's fused linear
  cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py), which computes the gradients
  chunk by chunk inside its forward; it needs a CUDA GPU and Triton.
"""
from __future__ import annotations

import math

CHECKPOINTING = ("none", "full", "selective")
"""Named checkpointing settings; an integer K (0 < K < number of blocks) is the partial one.
'selective': every block, per op (torch.utils.checkpoint create_selective_checkpoint_contexts):
the outputs of the matmuls and attention kernels are kept, the cheap ops between them recomputed
(torchtitan's selective op AC, torchtitan/models/llama3/infra/parallelize.py _save_list)."""
LOSSES = ("standard", "chunked", "fused")
LOSS_PATHS = ("hf", "ce-16bit", "upcast")
"""Who computes the cross-entropy on the materialised logits of `--loss standard` (`--loss-path`):
'hf': the model called with `labels` (transformers ForCausalLMLoss, loss/loss_utils.py: `logits.float()`
inside the loss, labels shifted; before v4.46 each *ForCausalLM.forward shifted a contiguous copy of
the logits: spec/stack.py), HF Trainer's path and the default; 'ce-16bit': the user's own
`F.cross_entropy` on the 16-bit logits (no upcast; autocast upcasts log_softmax itself under AMP);
'upcast': the user's code upcasts (`logits = model(...).logits.float()`, or the model does, as
torchtune's TransformerDecoder `self.output(h).float()`) and the loop holds the fp32 logits until
backward ends. memkit's chunked loss and liger's fused linear cross-entropy are `--loss chunked` /
`--loss fused` (no logits materialised). Priced in estimate/activations.py loss_path_bytes."""


def checkpointing_error(value: str) -> str | None:
    """Why `value` is not a --checkpointing setting, or None."""
    if value in CHECKPOINTING:
        return None
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return None
    return (f"--checkpointing {value!r} is not one of {', '.join(CHECKPOINTING)} or a number of "
            "decoder blocks K > 0 (K of L blocks checkpointed)")


def checkpointed_blocks(checkpointing: str, num_blocks: int) -> int:
    """How many of `num_blocks` blocks a setting checkpoints (the first ones, see above)."""
    if checkpointing in ("full", "selective"):
        return num_blocks
    if checkpointing == "none":
        return 0
    return min(int(checkpointing), num_blocks)


def partial_blocks_error(checkpointing: str, num_blocks: int) -> str | None:
    """K must leave at least one block un-checkpointed (K = L is 'full')."""
    if checkpointing in CHECKPOINTING:
        return None
    k = int(checkpointing)
    if k >= num_blocks:
        return (f"--checkpointing {k}: the model has {num_blocks} blocks; use K < {num_blocks} "
                "or --checkpointing full")
    return None


def loss_chunk_tokens(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Tokens per loss chunk: liger-kernel's rule (fused_linear_cross_entropy.py:
    inc_factor = cdiv(V, H); chunk_size = next_power_of_2(cdiv(BT, inc_factor))), which makes one
    chunk's logits about the size of the hidden states. The chunked loss uses the same rule."""
    inc = -(-vocab_size // hidden_size)
    chunk = -(-tokens // inc)
    return min(tokens, 1 << max(0, math.ceil(math.log2(max(1, chunk)))))


def loss_knob_error(loss: str, *, tp: int, pp: int) -> str | None:
    """What a chunked / fused loss cannot run with in memkit's runner."""
    if loss not in LOSSES:
        return f"--loss {loss!r} is not one of {', '.join(LOSSES)}"
    if loss != "standard" and (tp > 1 or pp > 1):
        return (f"--loss {loss} with tp={tp} pp={pp}: split runs compute the loss in their own "
                "stage/shard code; use --loss standard with --tp/--pp")
    return None


def loss_path_error(loss_path: str, *, task: str) -> str | None:
    """A user's loss path is priced on a language-model head's logits. (With --loss chunked / fused,
    memkit's or liger's loss replaces the user's and the path prices nothing: the planner may choose
    chunked for a user who stated a path, and the Trainer recipe then wraps the model.)"""
    if loss_path != "hf" and task != "causal-lm":
        return (f"--loss-path {loss_path} with --task {task}: priced for a language-model head; "
                "use --loss-path hf")
    return None


CPU_REFUSALS = {
    "fused": "--loss fused is liger-kernel's Triton kernel and needs a CUDA GPU; use --loss chunked on CPU",
    "paged-adamw-8bit": "--optimizer paged-adamw-8bit keeps its states in CUDA unified memory and needs a "
                        "CUDA GPU; use --optimizer adamw-8bit on CPU",
}
"""Plan settings the runner refuses on a machine without CUDA (one line each)."""


def checkpointing_type(text: str) -> str:
    """argparse `type=` for --checkpointing: none, full, or K (argparse prints the error, exit 2)."""
    import argparse

    if checkpointing_error(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not none, full, selective or a number of decoder blocks K > 0 "
                                         "(the first K blocks are checkpointed)")
    return text
