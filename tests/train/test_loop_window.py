"""The loop's device-side sums (what a GPU step keeps instead of reading values per step)
against a plain host computation of the same micro-batch sequence."""

import math

import torch

from shatter.train.checkpoint import TrainState
from shatter.train.guard import DeviceWindow, LaggedStop, StepDeadline


def test_device_window_matches_a_host_count_of_losses_skips_and_runs():
    losses = [2.0, float("nan"), float("inf"), 1.5, float("nan"), float("nan"), float("nan"), 1.0]
    window, state = DeviceWindow(torch.device("cpu")), TrainState()
    folds = []
    for i, value in enumerate(losses):
        loss = torch.tensor(value)
        bad = (~torch.isfinite(loss)).double()
        window.add(torch.where(bad > 0, torch.zeros_like(loss), loss), bad)
        if i in (2, 7):  # log steps
            folds.append(window.fold(state))
    finite = [x for x in losses if math.isfinite(x)]
    assert state.window_loss == sum(finite) and state.window_micro == len(finite)
    assert state.skipped_nonfinite == 5
    assert folds == [(2, 2), (3, 3)]  # the longest run in a row, across the fold at step 2


def test_one_rank_reads_its_own_stop_flag():
    stop = LaggedStop(torch.device("cpu"), world=1)
    assert stop(False) is False and stop(True) is True


def test_a_step_is_abandoned_when_it_cannot_finish_and_be_saved_within_the_grace():
    """8 micro-batches of 1 s a step, a 30 s grace, a request 2 micro-batches into a step: 6 s
    to go, half the grace kept for a save not timed yet, and the margin fit (24 s); so does a
    save timed at 5 s; a step slowed to 4 s a micro-batch does not, nor a save of 25 s. A
    request without a time (a store failure, in-band) never abandons."""
    now = [0.0]
    deadline = StepDeadline(8, 30.0, lambda: now[0])
    now[0] = 8.0
    deadline.step_ended()  # 1 s a micro-batch
    deadline.step_began()
    now[0] = 10.0  # 2 of this step's micro-batches done; the request now
    assert not deadline.over(10.0, 2)  # 6 + 15 + 3 s
    deadline.save_s = 5.0
    assert not deadline.over(10.0, 2)
    now[0] = 24.0  # slowed down: 16 s for 4 micro-batches, 4 more to go
    assert deadline.over(10.0, 4)  # 14 + 16 + 5 + 3 s
    deadline.save_s = 25.0
    now[0] = 10.0
    assert deadline.over(10.0, 2) and not deadline.over(0.0, 2)


def test_host_and_device_guards_skip_count_and_stop_alike():
    """The two step guards over one loss sequence on real DeepSpeed engines: the same loss
    window and skip count; both step on a zeroed loss, so a skipped micro-batch keeps its place in
    the gradient accumulation; `max_nonfinite` in a row end in one TrainingError that
    ends with the caller's advice (the host guard at once, the device guard when it settles)."""
    import pytest

    from shatter.train.config import RunArgs, TrainConfig
    from shatter.train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from shatter.train.guard import DeviceGuard, HostGuard, TrainingError

    init_distributed()
    cfg = TrainConfig(run=RunArgs(micro_batch=1, max_steps=20, zero_stage=0))
    x = torch.ones(1, 2)
    for kind, steps in ((HostGuard, 4), (DeviceGuard, 4)):
        torch.manual_seed(0)
        engine = build_engine(torch.nn.Linear(2, 1), cfg, resolved_deepspeed_config(cfg, 1))
        lines, state = [], TrainState()
        guard = kind(torch.device("cpu"), 1, 3, lines.append, "lower the lr")
        for value in (1.0, float("nan"), 2.0, float("nan")):
            guard.micro_step(engine, engine(x).sum() * 0 + value, 5, False, state)
        guard.settle(state)
        assert (state.window_loss, state.window_micro, state.skipped_nonfinite) == (3.0, 2, 2)
        assert state.tokens == 20 and engine.global_steps == steps and lines
        assert guard.stop(False) is False
        with pytest.raises(TrainingError, match="micro-batches in a row.*lower the lr$"):
            for _ in range(3):
                guard.micro_step(engine, engine(x).sum() * float("nan"), 5, False, state)
            guard.settle(state)


def test_both_guards_abandon_a_step_over_its_deadline_once_every_rank_has_a_request():
    """After a stop request, a micro-batch whose step cannot be saved in time gets no backward
    and no step on either guard; before the deadline passes the micro-batch trains as ever. The
    device guard (one host sync, after a request) abandons only when every rank has a request:
    the ranks that read the all-reduce are then all of them, so they decide alike."""
    from shatter.train.config import RunArgs, TrainConfig
    from shatter.train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from shatter.train.guard import DeviceGuard, HostGuard

    init_distributed()
    cfg = TrainConfig(run=RunArgs(micro_batch=1, max_steps=20, zero_stage=0, grad_accum=2))
    x = torch.ones(1, 2)
    for kind in (HostGuard, DeviceGuard):
        engine = build_engine(torch.nn.Linear(2, 1), cfg, resolved_deepspeed_config(cfg, 1))
        guard, state = kind(torch.device("cpu"), 1, 3, print, "lower the lr"), TrainState()
        guard.micro_step(engine, engine(x).sum(), 5, True, state, over=False)
        assert not guard.abandoned and engine.micro_steps == 1
        guard.micro_step(engine, engine(x).sum(), 5, True, state, over=True)
        assert guard.abandoned and engine.micro_steps == 1 and engine.global_steps == 0
    guard = DeviceGuard(torch.device("cpu"), 2, 3, print, "lower the lr")  # the rule, 2 ranks
    flags = lambda *f: torch.tensor(f, dtype=torch.float64)  # noqa: E731
    assert not guard._abandon(flags(0, 1, 1))  # one rank's request: the step boundary's stop
    assert not guard._abandon(flags(0, 2, 0))  # both requested, both in time
    assert guard._abandon(flags(0, 2, 1)) and guard.abandoned and guard.stop_seen
