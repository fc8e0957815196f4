"""The runner's side of the memory-saving techniques (rules: memkit/plan/techniques.py): activation
checkpointing of all or the first K decoder blocks, and the chunked loss. Used by
memkit/train/model.py (apply_plan), memkit/train/loop.py and memkit/calibrate/cpu_step.py, so the
runner, the CPU measurements and the Trainer recipe run the same code.
"""
from __future__ import annotations

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.plan.techniques import CPU_REFUSALS, checkpointed_blocks, partial_blocks_error


def apply_checkpointing(model, checkpointing: str, *, reentrant: bool = False) -> list[int]:
    """Checkpoint every block ('full') or the first K ('K'); returns the checkpointed block
    indices. Non-reentrant torch.utils.checkpoint per block (torch.utils.checkpoint docs
    recommend use_reentrant=False; it works with frozen inputs (LoRA) and ZeRO-3), set through
    transformers' GradientCheckpointingLayer flags (transformers modeling_layers.py)."""
    if checkpointing == "none":
        return []
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", True):  # PreTrainedModel's flag; a remote model's own
        raise MemkitError(f"--checkpointing {checkpointing}: {type(model).__name__} does not support activation "
                          "checkpointing (its supports_gradient_checkpointing is False); plan with --checkpointing none")
    kwargs = {"use_reentrant": reentrant}
    if checkpointing == "selective":
        kwargs["context_fn"] = _selective_context
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    error = partial_blocks_error(checkpointing, len(blocks))
    if error:
        raise MemkitError(error)
    k = checkpointed_blocks(checkpointing, len(blocks))
    for block in blocks[k:]:
        block.gradient_checkpointing = False
    return list(range(k))


def _save_list():
    """Ops whose outputs selective checkpointing keeps: matmuls and attention kernels
    (torchtitan/models/llama3/infra/parallelize.py _save_list); the rest is recomputed."""
    import torch

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_context():
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = _save_list()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)()


def refuse_on_cpu(plan: TrainingPlan) -> None:
    """One line for settings that need CUDA, before any model is built."""
    import torch

    if torch.cuda.is_available():
        return
    for value in (plan.loss, plan.optimizer):
        if value in CPU_REFUSALS:
            raise MemkitError(CPU_REFUSALS[value])


def apply_loss(model, plan: TrainingPlan):
    """Install the plan's loss head; returns the ChunkedLossHead or None for the standard loss.
    'fused' is liger-kernel's LigerFusedLinearCrossEntropyLoss (CUDA only)."""
    if plan.loss == "standard":
        return None
    refuse_on_cpu(plan)
    from memkit.train.chunked_loss import apply_chunked_loss

    return apply_chunked_loss(model, fused=plan.loss == "fused")


def mask_kwargs(batch: dict) -> dict:
    """The forward's mask arguments for a batch: --packing isolated's per-example position ids, no
    2D mask and no KV cache, from which transformers builds the block-diagonal causal mask
    (masking_utils._preprocess_mask_arguments: only when attention_mask and the cache are None;
    memkit.train.data.PackedData.position_ids); else the padding mask."""
    if batch.get("position_ids") is not None:
        return {"position_ids": batch["position_ids"], "use_cache": False}
    return {"attention_mask": batch.get("attention_mask")}


def micro_loss_sum(model, head, batch: dict, standard_loss_sum):
    """Sum of the micro-batch's token losses: through the chunked head, or the model's logits
    and `standard_loss_sum(logits, labels)`."""
    isolated = batch.get("position_ids") is not None
    mask = mask_kwargs(batch)
    if head is None:
        logits = model(input_ids=batch["input_ids"], **mask).logits
        return standard_loss_sum(logits, batch["labels"])
    from memkit.train.chunked_loss import loss_sum

    return loss_sum(model, head, input_ids=batch["input_ids"], labels=batch["labels"],
                    attention_mask=None if isolated else batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"))  # loss_sum turns the cache off itself
