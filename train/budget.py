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

A run found past its budget before its planned end (a step far slower than the ones before, a
resume after the budget was spent) still ends annealed: it takes a short tail past its budget
whose lr falls linearly from the lr it is at to 0 after its last step, over the steps an
`OVERRUN` share of the budget holds (at least `TAIL_MIN`, at most its plan's), and says so. A run
spent before its first plan (its warm-up) ends there. The plan, any squeeze or tail and the time
spent are kept in RUN/budget.json, so a resumed run keeps its schedule and its remaining time.
Every decision is rank 0's, broadcast at steps every rank knows, so the ranks follow one plan.
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
OVERRUN = 0.05  # the share of the budget a run found late may run past it to end its decay
TAIL_MIN = 5  # the fewest steps that decay: fewer would export a model near its lr


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
        self.tail = bool(before.get("tail"))  # past the budget, decaying to its end: no more checks
        self.tail_from = before.get("tail_from")  # the step at which the tail was decided
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
        mean = (now - marks[0][1]) / (step - marks[0][0])
        recent = max(MEASURE, (step - marks[0][0]) // 4)
        then = [m for m in marks if m[0] <= step - recent] or marks[:1]
        return max(mean, (now - then[-1][1]) / (step - then[-1][0]), self._usual_step(step, now))

    def _usual_step(self, step: int, now: float) -> float:
        """The median of this session's last three checks' step times: a step's time apart from
        a one-off pause (a validation pass, a host that stalled)."""
        marks = [*self.marks[-3:], (step, now)]
        rate = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(marks, marks[1:])]
        return sorted(rate)[-2:][0]

    def _decide(self, step: int, ceiling: int) -> tuple | None:
        """Rank 0: ("end", step, None) or ("tail", last step, squeeze) when the budget is spent
        (`_late`), ("plan", last step, squeeze) when the schedule changes, or None to go on as
        planned."""
        now, left = time.perf_counter(), self.seconds - self.spent()
        if left <= 0:
            return self._late(step, now)
        if step - self.marks[0][0] < MEASURE:
            return None
        fits = min(ceiling, step + int(left * (1 - RESERVE) / self._per_step(step, now)))
        if fits <= step:  # not one more step
            return self._late(step, now)
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

    def _late(self, step: int, now: float) -> tuple:
        """Rank 0, the budget spent (or not one more step left) at `step`: ("end", step, None)
        before the first plan or at its last step, else ("tail", last step, squeeze) over the
        steps OVERRUN of the budget holds at the step time plans use (at least TAIL_MIN): the
        plan's own remaining steps, decay and all, where they fit in that (squeeze None), else
        the lr of `step` falling linearly to 0 after the tail's last step."""
        if self.planned is None or step >= self.planned:
            return "end", step, None
        holds = max(TAIL_MIN, int(OVERRUN * self.seconds / self._per_step(step, now)))
        if self.planned - step <= holds:
            return "tail", self.planned, None
        iteration = step - 2  # the scheduler's iteration for `step` (train/schedule.py)
        return "tail", step + holds, (iteration, self.plan.factor(iteration), step + holds - 1)

    def _due(self, step: int) -> bool:
        since = step - self.marks[0][0]
        logged = self.log_every > 0 and step % self.log_every == 0
        return since > 0 and (since % MEASURE == 0 or logged)

    def check(self, step: int, ceiling: int) -> int | None:
        """The run's new last step (its schedule re-planned, or this step when the budget is
        spent), or None; collective at a session's first check and where ranks decide (every
        MEASURE steps and at log steps, until a tail starts)."""
        self.note = None
        if not self.marks:
            self._agree_on_tail(step)
            self.marks.append((step, time.perf_counter()))
            return None
        if self.tail or not self._due(step):  # every rank knows both: no rank waits alone
            return None
        decision = [self._decide(step, ceiling) if self.rank == 0 else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(decision, src=0)
        kind, last, squeeze = decision[0] or (None, None, None)
        was = self.planned
        if kind in ("plan", "tail"):
            self.planned, self.plan.squeeze = last, squeeze or self.plan.squeeze
            self.tail = kind == "tail"
            self.tail_from = step if self.tail else None
            self._apply(last)
        if kind == "plan":
            self.note = self._planned_note(step, last, squeeze, was)
        elif kind == "tail":
            self.note = self._tail_note(step, last, squeeze, was)
        elif kind == "end":
            self.note = self._ended_note(step)
            self.ended = last
        self.marks.append((step, time.perf_counter()))
        if self.rank == 0:
            self._record()
        return last

    def _agree_on_tail(self, step: int) -> None:
        """At a session's first check: every rank takes rank 0's restored tail (a rank whose node
        has no copy of RUN/budget.json would otherwise check alone and wait for ever), and a tail
        decided after the checkpoint this run resumed from is dropped (budget.json is newer than
        that checkpoint): the next due check decides again, within OVERRUN of the budget."""
        tail = [self.tail and self.tail_from is not None and step >= self.tail_from]
        if self.world > 1:
            torch.distributed.broadcast_object_list(tail, src=0)
        self.tail = tail[0]

    def _planned_note(self, step: int, last: int, squeeze: tuple | None, was: int | None) -> str:
        before = f" (was {was})" if was is not None else ""
        line = f"budget: {last} steps planned{before}, {self.left():.0f} s left at step {step}"
        if squeeze is not None:
            line += f"; its decay now runs from {squeeze[1]:.0%} of the peak lr to 0 at {last}"
        return line

    def _tail_note(self, step: int, last: int, squeeze: tuple | None, was: int | None) -> str:
        steps = last - step
        over = steps * self._per_step(step, time.perf_counter())
        decay = (
            f"its lr falls from {squeeze[1]:.0%} of the peak over {steps} more steps (to "
            f"{self.plan.factor(last - 2):.0%} at the last)"
            if squeeze is not None
            else f"its plan's last {steps} steps, decay and all, run on"
        )
        return (
            f"budget: spent at step {step}, before its planned step {was} (its steps slowed down "
            f"more than planned for): so that the export is annealed, {decay}, about {over:.0f} s "
            "past the budget; a longer --budget-hours trains to the plan"
        )

    def _ended_note(self, step: int) -> str:
        if self.planned is not None:
            return f"budget: spent at step {step}"
        return (
            f"budget: spent at step {step}, before its schedule was planned (from the time of the "
            f"{MEASURE} steps after the first): the export is from its warm-up, not annealed; give "
            "a longer --budget-hours"
        )

    def _record(self) -> None:
        record = {
            "planned_steps": self.planned,
            "ended_at": self.ended,
            "spent_s": self.spent(),
            "squeeze": list(self.plan.squeeze) if self.plan.squeeze else None,
            "tail": self.tail,
            "tail_from": self.tail_from,
        }
        self.path.write_text(json.dumps(record) + "\n")
