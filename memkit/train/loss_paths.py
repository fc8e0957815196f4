"""The user's loss paths (memkit/plan/techniques.py LOSS_PATHS) as code, so each is measured as priced
(estimate/activations.py loss_path_bytes): 'hf' is the model called with labels; 'ce-16bit' and
'upcast' call the model without labels and compute F.cross_entropy themselves, shifting the labels
as transformers ForCausalLMLoss does (loss/loss_utils.py: `nn.functional.pad(labels, (0, 1),
value=ignore_index)[..., 1:]`), so no logits copy is made for the shift."""
from __future__ import annotations

IGNORE_INDEX = -100
"""transformers loss/loss_utils.py ForCausalLMLoss ignore_index (torch.nn.CrossEntropyLoss's default)."""


def user_loss(model, batch: dict, loss_path: str):
    """(loss, held): `held` is what the loop keeps alive until backward ends (an 'upcast' loop's
    fp32 logits; None otherwise). The caller drops it after loss.backward()."""
    if loss_path == "hf":
        return model(**batch).loss, None
    import torch.nn.functional as F

    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    if loss_path == "upcast":
        logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), shifted, ignore_index=IGNORE_INDEX)
    return loss, (logits if loss_path == "upcast" else None)
