"""Validation: masked-LM loss and accuracy at the masked positions of the validation split (for
the permutation LM: the query stream's loss and accuracy at the targets, train/plm.py).

The validation split is read in file order with the fixed static masks (masking copy 0), so the
figures of two runs or two archs are over the very same predictions. Every rank evaluates its own
share of the rows; the sums are all-reduced, so the result does not depend on the world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train.masking import IGNORE


def masked_lm_sums(model, batch: dict) -> torch.Tensor:
    """[sum of token losses, correct predictions, predicted tokens] of one batch (float64)."""
    labels = batch["labels"]
    order = {"perm_rank": batch["perm_rank"]} if "perm_rank" in batch else {}  # plm
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, **order
    )
    logits = out["logits"]
    target = labels[labels != IGNORE]
    if logits.dim() == 3:  # a model that decodes every position
        logits = logits[labels != IGNORE]
    logits = logits.float()
    loss_sum = F.cross_entropy(logits, target, reduction="sum")
    correct = (logits.argmax(-1) == target).sum()
    return torch.stack(
        [
            loss_sum.double(),
            correct.double(),
            torch.tensor(float(target.numel()), dtype=torch.float64),
        ]
    )


@torch.no_grad()
def evaluate(model, batches, device: torch.device, distributed: bool) -> dict:
    """{"loss", "accuracy", "predictions"} over all batches of all ranks."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        totals += masked_lm_sums(model, batch).cpu()
    if distributed and torch.distributed.is_initialized():
        reduced = totals.to(device)
        torch.distributed.all_reduce(reduced)
        totals = reduced.cpu()
    if was_training:
        model.train()
    n = max(totals[2].item(), 1.0)
    return {
        "loss": totals[0].item() / n,
        "accuracy": totals[1].item() / n,
        "predictions": int(totals[2].item()),
    }
