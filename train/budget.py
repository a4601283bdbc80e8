"""A run given a wall-clock budget (`run.budget_hours`, cramming's `budget`) instead of a length.

The run starts on a schedule as long as `run.max_steps` (a ceiling). After the first
`MEASURE` optimizer steps that follow the first one (which builds kernels and fills the loader),
rank 0 times a step and sets the schedule's length to the steps the rest of the budget holds,
less a `RESERVE` share kept for the final checkpoint and export; a budgeted run's warm-up is at
most a tenth of that. It then re-plans every `MEASURE` steps and at log steps from the slower of
the run's mean step time and its recent one, so that the last planned step, its decay included,
fits the budget as steps slow down (validation, a busier host):

- before the decay starts, the plan's length follows the time left;
- inside the decay, a run found late squeezes the rest of its decay into the steps left (from
  the lr it is at, linearly to 0 at the new last step: `Plan.squeeze`), so it still ends
  annealed; a run found early keeps its plan and ends before its budget.

A run past its budget before its planned end ends there (with its checkpoint and export, as at
its last step) and says how far its lr was from annealed. The plan and the time spent are kept in
RUN/budget.json, so a resumed run keeps its schedule and its remaining time.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from shatter.train.config import TrainConfig
from shatter.train.schedule import Plan

FILE = "budget.json"
MEASURE = 5  # optimizer steps timed before the schedule's length is set, and between re-plans
RESERVE = 0.05  # the share of the time left that a plan leaves for the final save and export
TOLERANCE = 0.02  # a re-plan that moves the last step by less than this share is not made


def saved(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return {}


def planned_config(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """`cfg` with run.max_steps the length a resumed budgeted run planned (unchanged otherwise)."""
    before = saved(run_dir)
    steps = before.get("ended_at") or before.get("planned_steps")
    if cfg.run.budget_hours is None or not steps:
        return cfg
    return replace(cfg, run=replace(cfg.run, max_steps=min(int(steps), cfg.run.max_steps)))


class Budget:
    """Rank 0's clock over a budgeted run; `check` is called at every optimizer step boundary."""

    def __init__(self, cfg: TrainConfig, plan: Plan, run_dir: Path, rank: int, world: int):
        self.seconds = cfg.run.budget_hours * 3600
        self.plan, self.rank, self.world = plan, rank, world
        self.path, self.log_every = Path(run_dir) / FILE, cfg.run.log_every
        before = saved(run_dir)
        self.spent_before = float(before.get("spent_s", 0.0))
        self.planned = before.get("planned_steps")
        self.ended = before.get("ended_at")  # the step at which the budget was spent
        if before.get("squeeze"):
            plan.squeeze = tuple(before["squeeze"])
        if self.planned:
            self._apply(int(self.planned))
        self.start = time.perf_counter()
        self.marks: list[tuple[int, float]] = []  # (step, time) at each check of this session
        self.note: str | None = None  # a line for the run's log about the last check's decision

    def spent(self) -> float:
        return self.spent_before + time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds of the budget left."""
        return max(0.0, self.seconds - self.spent())

    def _apply(self, steps: int) -> None:
        self.plan.total = steps
        self.plan.warmup = min(self.plan.warmup, max(2, steps // 10))

    def _per_step(self, step: int, now: float) -> float:
        """The slowest of this session's mean step time, its recent one (the last quarter of its
        steps, at least MEASURE) and the median of its last three checks' (one validation pass
        does not move it): a slow-down is planned for at once, a speed-up slowly."""
        marks = [*self.marks, (step, now)]
        rate = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
        mean = (now - marks[0][1]) / (step - marks[0][0])
        recent = max(MEASURE, (step - marks[0][0]) // 4)
        then = [m for m in marks if m[0] <= step - recent] or marks[:1]
        return max(mean, (now - then[-1][1]) / (step - then[-1][0]), sorted(rate[-3:])[-2:][0])

    def _decide(self, step: int, ceiling: int) -> tuple | None:
        """Rank 0: ("end", step, None) when the budget is spent, ("plan", last step, squeeze)
        when the schedule changes, or None to go on as planned."""
        now, left = time.perf_counter(), self.seconds - self.spent()
        if left <= 0:
            return "end", step, None
        if step - self.marks[0][0] < MEASURE:
            return None
        fits = min(ceiling, step + int(left * (1 - RESERVE) / self._per_step(step, now)))
        if fits <= step:  # not one more step: the run ends here
            return "end", step, None
        iteration = step - 1  # the scheduler's iteration for the next step (train/schedule.py)
        if self.planned is not None and abs(fits - self.planned) <= TOLERANCE * self.planned:
            return None
        if self.planned is not None and iteration >= self.plan.decay_start():
            if fits >= self.planned:  # early inside the decay: it ends before its budget
                return None
            return "plan", fits, (iteration, self.plan.factor(iteration), fits)
        if iteration >= self.plan.decay_start(fits):  # the new plan's decay would have begun
            return "plan", fits, (iteration, self.plan.factor(iteration), fits)
        return "plan", fits, None

    def _due(self, step: int) -> bool:
        since = step - self.marks[0][0]
        logged = self.log_every > 0 and step % self.log_every == 0
        return since > 0 and (since % MEASURE == 0 or logged)

    def check(self, step: int, ceiling: int) -> int | None:
        """The run's new last step (its schedule re-planned, or this step when the budget is
        spent), or None; collective at the steps where ranks decide (every MEASURE steps and at
        log steps)."""
        self.note = None
        if not self.marks:
            self.marks.append((step, time.perf_counter()))
            return None
        if not self._due(step):
            return None
        decision = [self._decide(step, ceiling) if self.rank == 0 else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(decision, src=0)
        kind, last, squeeze = decision[0] or (None, None, None)
        self.marks.append((step, time.perf_counter()))
        if kind == "plan":
            self.note = self._planned_note(step, last, squeeze)
            self.planned, self.plan.squeeze = last, squeeze or self.plan.squeeze
            self._apply(last)
        elif kind == "end":
            self.note = self._ended_note(step)
            self.ended = last
        if self.rank == 0:
            self._record()
        return last

    def _planned_note(self, step: int, last: int, squeeze: tuple | None) -> str:
        was = f" (was {self.planned})" if self.planned is not None else ""
        line = f"budget: {last} steps planned{was}, {self.left():.0f} s left at step {step}"
        if squeeze is not None:
            line += f"; its decay now runs from {squeeze[1]:.0%} of the peak lr to 0 at {last}"
        return line

    def _ended_note(self, step: int) -> str:
        if self.planned is None or step >= self.planned:
            return f"budget: spent at step {step}"
        share = self.plan.factor(step - 1)
        return (
            f"budget: spent at step {step}, before its planned step {self.planned}: the export is "
            f"at {share:.0%} of the peak lr, not annealed (its steps slowed down more than planned "
            "for; give a longer --budget-hours or a shorter optim.cooldown)"
        )

    def _record(self) -> None:
        record = {
            "planned_steps": self.planned,
            "ended_at": self.ended,
            "spent_s": self.spent(),
            "squeeze": list(self.plan.squeeze) if self.plan.squeeze else None,
        }
        self.path.write_text(json.dumps(record) + "\n")
