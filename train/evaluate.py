"""Validation: masked-LM loss and accuracy at the masked positions of the validation split (for
the permutation LM: the query stream's loss and accuracy at the targets, train/plm.py).

The validation split is read in file order with the fixed static masks (masking copy 0), so the
figures of two runs or two archs are over the very same predictions. Every rank evaluates its own
share of the rows; the sums are all-reduced, so the result does not depend on the world size.
A rank whose rows run out first evaluates zero-weight padding batches (train/loader/stream.py) until the
others are done: under ZeRO-3 each forward is a collective, so every rank runs as many.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from shatter.model import predicted_positions


def default_device() -> torch.device:
    """The device a standalone evaluation runs on: the (current) GPU when there is one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def masked_lm_sums(model, batch: dict) -> torch.Tensor:
    """[sum of token losses, correct predictions, predicted tokens] of one batch (float64)."""
    labels = batch["labels"]
    order = {"perm_rank": batch["perm_rank"]} if "perm_rank" in batch else {}  # plm
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels, **order
    )
    # the loader's predicted positions (made here, on the labels' device, without); the model
    # (any masked LM: an export's too) finds its own
    predicted = batch.get("predicted")
    predicted = predicted_positions(labels) if predicted is None else predicted
    logits = out["logits"]
    target = labels.reshape(-1)[predicted]
    if logits.dim() == 3:  # a model that decodes every position
        logits = logits.flatten(0, 1)[predicted]
    logits = logits.float()
    loss_sum = F.cross_entropy(logits, target, reduction="sum")
    correct = (logits.argmax(-1) == target).sum()
    # every tensor of a step takes its device from its inputs
    count = torch.full((), target.numel(), dtype=torch.float64, device=target.device)
    return torch.stack([loss_sum.double(), correct.double(), count])


def eager() -> contextlib.AbstractContextManager:
    """Dynamo's force-eager stance where Dynamo is loaded; nothing where it is not: no model can
    be compiled then, and importing it for the stance costs a standalone evaluation (an export
    scored by shatter-evaluate) about 2.5 CPU-seconds, as much as the scoring itself."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@torch.no_grad()
def evaluate(model, batches, device: torch.device, distributed: bool) -> dict:
    """{"loss", "accuracy", "predictions"} over all batches of all ranks.

    A `torch.compile`d model runs eager here: its graphs are the training step's, and eval mode,
    no_grad and the split's last, shorter batch would each compile new ones (tens of seconds
    each on a CPU, for a pass of seconds) and count towards Dynamo's recompile limit."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # summed on the device
    with eager():
        for batch in batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            totals += masked_lm_sums(model, batch)
    if distributed and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
    if was_training:
        model.train()
    loss, correct, count = totals.tolist()  # the one host read of the pass
    n = max(count, 1.0)
    return {"loss": loss / n, "accuracy": correct / n, "predictions": int(count)}
