"""A run given a wall-clock budget (`run.budget_hours`, cramming's `budget`) instead of a length.

The run starts on a schedule as long as `run.max_steps` (a ceiling). After the first
`MEASURE` optimizer steps that follow the first one (which builds kernels and fills the loader),
rank 0 times a step and sets the schedule's length to the steps the rest of the budget holds;
a budgeted run's warm-up is at most a tenth of that. At every log step, a run past its budget
ends there (with its checkpoint and export, as at its last step; its schedule is left as
planned). The plan and the time
spent are kept in RUN/budget.json, so a resumed run keeps its schedule and its remaining time.
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
MEASURE = 5  # optimizer steps timed before the schedule's length is set


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
        if self.planned:
            self._apply(int(self.planned))
        self.start = time.perf_counter()
        self.first: tuple[int, float] | None = None  # (step, time) at the first boundary

    def spent(self) -> float:
        return self.spent_before + time.perf_counter() - self.start

    def _apply(self, steps: int) -> None:
        self.plan.total = steps
        self.plan.warmup = min(self.plan.warmup, max(2, steps // 10))

    def _decide(self, step: int, ceiling: int) -> tuple[str, int] | None:
        """Rank 0: ("end", step) when the budget is spent, ("plan", the schedule's length) once
        the steps are timed, or None to go on as planned."""
        now = time.perf_counter()
        if self.spent() >= self.seconds:
            return "end", step
        if self.planned is None and step - self.first[0] >= MEASURE:
            per_step = (now - self.first[1]) / (step - self.first[0])
            left = self.seconds - self.spent()
            return "plan", max(step, min(ceiling, step + int(left / per_step)))
        return None

    def check(self, step: int, ceiling: int) -> int | None:
        """The run's new last step (its schedule re-planned), or None; collective at the steps
        where ranks decide (the measuring step and log steps)."""
        if self.first is None:
            self.first = (step, time.perf_counter())
            return None
        measuring = self.planned is None and step - self.first[0] == MEASURE
        if not measuring and (self.log_every <= 0 or step % self.log_every):
            return None
        decision = [self._decide(step, ceiling) if self.rank == 0 else None]
        if self.world > 1:
            torch.distributed.broadcast_object_list(decision, src=0)
        kind, last = decision[0] or (None, None)
        if kind == "plan":
            self.planned = last
            self._apply(last)
        elif kind == "end":
            self.ended = last
        if self.rank == 0:
            record = {
                "planned_steps": self.planned,
                "ended_at": self.ended,
                "spent_s": self.spent(),
            }
            self.path.write_text(json.dumps(record) + "\n")
        return last
