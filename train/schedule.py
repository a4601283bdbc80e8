"""The learning-rate schedules a pretraining run can follow after its linear warm-up.

- `linear`: linear decay to 0 at the last step (§A.2, BERT's schedule).
- `constant`: the peak lr to the end.
- `cosine`: half a cosine from the peak to 0 at the last step.
- `wsd` (warmup-stable-decay): the peak lr, then a linear decay to 0 over the last
  `optim.cooldown` share of the steps.
- `1-sqrt`: the same, with the cooldown shaped 1 - sqrt(p) (Hägele et al. 2024; ModernBERT's
  schedule, whose stable phase lets a later phase start without a new warm-up).

`linear` and `constant` are DeepSpeed's own schedulers (`WarmupDecayLR`, `WarmupLR`); the others,
and every schedule of a run whose length is set from a time budget (`run.budget_hours`), are a
`WarmupLR` whose factor comes from `lr_factor`, so every schedule shares DeepSpeed's counting:
optimizer step s (1-based) runs at iteration s - 2.
"""

from __future__ import annotations

import math

DECAYS = ("linear", "constant", "cosine", "wsd", "1-sqrt")
DEEPSPEED_DECAYS = ("linear", "constant")  # the ones DeepSpeed's config can describe


def lr_factor(decay: str, iteration: int, warmup: int, total: int, cooldown: float) -> float:
    """The share of the peak lr at scheduler iteration `iteration` (0-based) of a `total`-step
    run with `warmup` warm-up iterations; `cooldown`: the share of `total` that wsd and 1-sqrt
    decay over."""
    if iteration < 0:
        return 0.0
    if iteration < warmup:
        return iteration / warmup
    if decay == "constant":
        return 1.0
    if decay == "linear":
        return max(0.0, (total - iteration) / max(1.0, total - warmup))
    if decay == "cosine":
        p = min(1.0, (iteration - warmup) / max(1.0, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * p))
    length = max(1, round(total * cooldown))  # wsd, 1-sqrt: the final decay's steps
    p = min(1.0, max(0.0, (iteration - (total - length)) / length))
    return 1.0 - p if decay == "wsd" else 1.0 - math.sqrt(p)


class Plan:
    """The schedule's length and warm-up, which a budgeted run sets once it has timed its steps
    and re-plans as their time changes (train/budget.py); the scheduler reads them at every step.

    `squeeze` (iteration, factor, end): a budgeted run found late inside its decay decays from
    `factor` at `iteration` linearly to 0 at `end` (its new `total`), so it still ends annealed."""

    def __init__(self, decay: str, warmup: int, total: int, cooldown: float):
        self.decay, self.warmup, self.total, self.cooldown = decay, warmup, total, cooldown
        self.squeeze: tuple[int, float, int] | None = None

    def factor(self, iteration: int) -> float:
        if self.squeeze is not None and iteration >= self.squeeze[0]:
            start, factor, end = self.squeeze
            return factor * max(0.0, (end - iteration) / max(1, end - start))
        return lr_factor(self.decay, iteration, self.warmup, self.total, self.cooldown)

    def decay_start(self, total: int | None = None) -> int:
        """The first iteration below the peak lr for good in a `total`-step plan (this one's by
        default): from it on, a longer or shorter plan would move the lr (a re-plan then only
        squeezes the rest of the decay)."""
        if total is None and self.squeeze is not None:
            return self.squeeze[0]
        total = self.total if total is None else total
        if self.decay == "constant":
            return total
        if self.decay in ("wsd", "1-sqrt"):
            return total - max(1, round(total * self.cooldown))
        return self.warmup  # linear, cosine: the decay is the run


def client_scheduler(optim, plan: Plan):
    """A callable DeepSpeed builds the run's scheduler with (`deepspeed.initialize(lr_scheduler=)`):
    DeepSpeed's `WarmupLR`, its factor taken from `plan`."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    class PlannedLR(WarmupLR):
        def _get_gamma(self):
            return plan.factor(self.last_batch_iteration)

        def get_lr(self):
            # WarmupLR's constructor asks for the lr before step 0, and its get_lr warns of that
            # on every rank of every run; the answer there is the start of the warm-up
            if self.last_batch_iteration < 0:
                return self.min_lrs
            return super().get_lr()

    def build(optimizer):
        return PlannedLR(
            optimizer,
            warmup_min_lr=0.0,
            warmup_max_lr=optim.lr,
            warmup_num_steps=max(2, plan.warmup),
            warmup_type="linear",
        )

    return build
