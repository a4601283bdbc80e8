"""A budgeted run's plan on a simulated clock (train/budget.py): steps that slow down after the
plan is made are re-planned for, so the last planned step, its decay included, fits the budget;
a run late inside its decay squeezes the rest of it; one that still runs over says so."""

import pytest

from shatter.train import budget as budget_module
from shatter.train.budget import Budget
from shatter.train.config import OptimArgs, RunArgs, TrainConfig
from shatter.train.schedule import Plan


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(tmp_path, monkeypatch, seconds: float, step_s, decay="wsd", ceiling=100_000):
    """A one-rank run of `seconds` whose step `s` takes `step_s(s)` seconds: (its last step, the
    lr factor each step ran at, the budget, the seconds spent at its end)."""
    clock = Clock()
    monkeypatch.setattr(budget_module.time, "perf_counter", clock)
    cfg = TrainConfig(
        run=RunArgs(budget_hours=seconds / 3600, max_steps=ceiling, log_every=10),
        optim=OptimArgs(decay=decay, warmup_steps=2, cooldown=0.5),
    )
    plan = Plan(decay, 2, ceiling, 0.5)
    run = Budget(cfg, plan, tmp_path, rank=0, world=1)
    last, step, factors, notes = ceiling, 0, {}, []
    while step < last:
        step += 1
        factors[step] = plan.factor(step - 2)  # optimizer step s runs at iteration s - 2
        clock.now += step_s(step)
        planned = run.check(step, ceiling)
        notes += [run.note] if run.note else []
        last = planned if planned is not None else last
    return step, factors, run, clock.now, notes


def test_steps_that_slow_down_are_re_planned_so_the_decay_ends_inside_the_budget(
    tmp_path, monkeypatch
):
    """1 s a step while the first plan is made, 2 s from step 30: the plan shrinks as the steps
    slow, and the run ends at its planned step with its lr decayed, inside 100 s."""
    last, factors, run, spent, notes = simulate(
        tmp_path, monkeypatch, 100.0, lambda s: 1.0 if s < 30 else 2.0
    )
    assert spent <= 100.0, (last, spent)
    assert run.ended is None and last == run.planned
    assert factors[last] <= 0.1 and max(factors.values()) == 1.0
    assert any("steps planned (was" in n for n in notes), notes


def test_a_run_late_inside_its_decay_squeezes_the_rest_of_it(tmp_path, monkeypatch):
    """Steps 3x slower from step 70 (inside wsd's decay): the rest of the decay runs from its lr
    to 0 at the step the time left holds, without a jump up."""
    last, factors, run, spent, notes = simulate(
        tmp_path, monkeypatch, 100.0, lambda s: 1.0 if s < 70 else 3.0
    )
    assert spent <= 100.0 and run.plan.squeeze is not None, (last, spent, run.plan.squeeze)
    assert factors[last] <= 0.2
    assert all(factors[s + 1] <= factors[s] + 1e-12 for s in range(60, last))
    assert any("its decay now runs from" in n for n in notes), notes


def test_a_run_found_past_its_budget_ends_annealed_in_a_short_tail(tmp_path, monkeypatch):
    """A step of 60 s at step 40 spends the budget at once: the run takes TAIL_MIN more steps
    past it, whose lr falls from the lr it was at towards 0, and says so; a resume keeps the tail
    (no check ends it early, though its budget is spent)."""
    last, factors, run, spent, notes = simulate(
        tmp_path, monkeypatch, 100.0, lambda s: 60.0 if s == 40 else 1.0
    )
    assert run.tail and run.ended is None and last == 40 + budget_module.TAIL_MIN, (last, notes)
    assert all(factors[s + 1] < factors[s] for s in range(40, last)), factors
    assert factors[last] <= factors[40] / budget_module.TAIL_MIN
    assert spent <= 100.0 + budget_module.TAIL_MIN and "the export is annealed" in notes[-1]
    cfg = TrainConfig(run=RunArgs(budget_hours=1 / 36, max_steps=100_000, log_every=10))
    resumed = Budget(cfg, Plan("wsd", 2, 100_000, 0.5), tmp_path, rank=0, world=1)
    assert resumed.tail and resumed.planned == last and resumed.plan.total == last
    assert [resumed.plan.factor(s - 2) for s in range(41, last + 1)] == [
        factors[s] for s in range(41, last + 1)
    ]
    resumed.seconds = 0.0  # spent: a check would end the run
    assert [resumed.check(s, 100_000) for s in range(41, last + 1)] == [None] * (last - 40)


def test_a_tail_is_overruns_length_keeps_a_plan_that_fits_it_and_not_a_newer_budget_file(
    tmp_path, monkeypatch
):
    """A 1000 s budget spent by a 600 s stall at step 500: the tail is the steps OVERRUN of the
    budget holds at the plan's step time, more than TAIL_MIN and under OVERRUN of the budget at
    1 s a step. A resume from a checkpoint older than the tail's decision drops it (the next
    check decides again). Found late near its planned end, a run keeps its plan's own decay
    past the budget (no squeeze)."""
    last, factors, run, _, notes = simulate(
        tmp_path, monkeypatch, 1000.0, lambda s: 600.0 if s == 500 else 1.0
    )
    assert run.tail and budget_module.TAIL_MIN < last - 500 < 50, (last, notes)
    assert run.plan.squeeze is not None and factors[last] < factors[500] / 5
    cfg = TrainConfig(run=RunArgs(budget_hours=1000 / 3600, max_steps=100_000, log_every=10))
    older = Budget(cfg, Plan("wsd", 2, 100_000, 0.5), tmp_path, rank=0, world=1)
    assert older.tail and older.check(300, 100_000) is None and not older.tail
    (tmp_path / "near").mkdir()
    near = simulate(tmp_path / "near", monkeypatch, 1000.0, lambda s: 100.0 if s == 940 else 1.0)
    last, factors, run, _, notes = near
    assert run.tail and run.plan.squeeze is None and factors[last] <= 0.01, (last, notes)
    assert "decay and all, run on" in notes[-1], notes


def test_a_run_spent_before_its_first_plan_ends_and_says_why(tmp_path, monkeypatch):
    """A budget spent by the first steps (a model too slow for it): the run ends at its first
    check, before any plan, and says that its export is from the warm-up."""
    last, _, run, _, notes = simulate(
        tmp_path, monkeypatch, 10.0, lambda s: 20.0 if s == 2 else 1.0
    )
    assert run.ended == last == 1 + budget_module.MEASURE and not run.tail, (last, notes)
    assert "before its schedule was planned" in notes[-1], notes


@pytest.mark.parametrize("decay", ["linear", "cosine", "1-sqrt", "constant"])
def test_every_decay_ends_inside_its_budget(tmp_path, monkeypatch, decay):
    last, factors, run, spent, _ = simulate(
        tmp_path, monkeypatch, 60.0, lambda s: 0.5 if s < 20 else 0.8, decay=decay
    )
    assert spent <= 60.0 and last == run.planned, (last, spent)
    if decay != "constant":
        assert factors[last] <= 0.15, factors[last]
