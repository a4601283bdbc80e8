"""The step guard of a training loop: each micro-batch's backward and step, skipped on every rank
when its loss is NaN/inf on some rank, counted, and `max_nonfinite` of them in a row stop the run;
the ranks' agreement on a stop request; the loss window and token count that log lines read.

Two implementations of one interface (`StepGuard`), chosen by the device:
- `HostGuard` (a CPU, where reading a value costs nothing): the non-finite flag, the stop request
  and the tokens are all-reduced before the backward, and a non-finite micro-batch goes through
  its backward and step with its loss zeroed (no gradient): it keeps its place in the gradient
  accumulation, so the step boundary, and the stream position a checkpoint saves, never move;
- `DeviceGuard` (a GPU: no host sync per step): the flag is all-reduced on the device and a
  non-finite loss is zeroed (no gradient; fp16 overflow stays the loss scaler's job); the sums
  stay on the device (`DeviceWindow`) and are read at log steps and checkpoints only (`settle`);
  the stop request is agreed one optimizer step late (`LaggedStop`).
After a stop request, `StepDeadline` says whether the step in progress can still finish and be
saved before the launcher's SIGKILL; the ranks agree on it in the all-reduce they do each
micro-batch anyway (no collective of its own), and the loop abandons the step (`abandoned`) and
saves the last completed one. On a GPU only a rank that has its own request reads that
all-reduce (the one host sync, after a stop), and the step is abandoned only when every rank has
a request (then every rank reads it and they decide alike): the launcher's group SIGTERM; a stop
of one rank alone waits for the step boundary.
The pretraining loop (train/loop.py) and the finetuning loop (train/finetuning/loop.py) use it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from shatter.train.checkpoint import TrainState


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a diverged loss); the message says what to do."""


class LossSpike:
    """Finite divergence, read at log lines (the window's loss, the same on every rank): a loss
    above `factor` × the median of the last `MEDIAN_OF` healthy log lines is a spike, and
    `lines` spikes in a row are a divergence. `check` returns what changed: "spike" (the first
    of a run: the checkpoint from before it is kept from pruning), "over" (the loss is back),
    "diverged", or None."""

    MEDIAN_OF = 50  # healthy log lines the median is taken over
    WARM = 5  # healthy log lines before anything is judged (the first losses fall fast)

    def __init__(self, factor: float, lines: int):
        self.factor, self.lines = factor, lines
        self.healthy: deque[float] = deque(maxlen=self.MEDIAN_OF)
        self.spikes = 0  # spike lines in a row
        self.healthy_step = 0  # the step of the last healthy log line
        self.median = float("nan")

    def check(self, step: int, loss: float) -> str | None:
        if self.factor <= 0 or not math.isfinite(loss):  # NaN/inf: the non-finite guard's
            return None
        if len(self.healthy) >= self.WARM:
            self.median = statistics.median(self.healthy)
            if loss > self.factor * self.median:
                self.spikes += 1
                if self.spikes >= self.lines:
                    return "diverged"
                return "spike" if self.spikes == 1 else None
        over = self.spikes > 0
        self.spikes, self.healthy_step = 0, step
        self.healthy.append(loss)
        return "over" if over else None

    def error(self, step: int, loss: float, kept: str | None) -> TrainingError:
        where = (
            f"the checkpoint from before the spike, {kept}, is the one a resume takes (newer "
            "ones moved aside as diverged-stepN)"
            if kept
            else "no checkpoint from before the spike exists"
        )
        return TrainingError(
            f"loss {loss:.4g} at step {step} is above {self.factor:g} × its running median "
            f"{self.median:.4g} for {self.spikes} log lines in a row (healthy until step "
            f"{self.healthy_step}): the run diverged; {where}; lower the lr (or raise "
            "run.diverge_factor) and run the same command again"
        )


class DeviceWindow:
    """What the loop sums per micro-batch, kept where the loss is: [loss sum, micro-batches,
    non-finite micro-batches, current run of them in a row, longest run]. `fold` reads it into
    the `TrainState` (one host sync) at log steps and checkpoints."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, bad: torch.Tensor) -> None:
        s, bad = self.sums, bad.to(torch.float64)
        s[0] += torch.where(bad > 0, 0.0, loss.detach().to(torch.float64))
        s[1] += 1 - bad
        s[2] += bad
        s[3] = (s[3] + 1) * bad  # the current run: reset to 0 by a finite micro-batch
        s[4] = torch.maximum(s[4], s[3])

    def fold(self, state: TrainState) -> tuple[int, int]:
        """Move the sums into `state`; returns (new non-finite micro-batches, longest run)."""
        loss, micro, bad, run, longest = self.sums.tolist()
        state.window_loss += loss
        state.window_micro += int(micro)
        state.skipped_nonfinite += int(bad)
        self.sums[:3] = 0
        self.sums[4] = run
        return int(bad), int(longest)


class LaggedStop:
    """The ranks' agreement on a stop request, one optimizer step late: each boundary posts
    this rank's flag (an async all-reduce and a pinned copy) and reads the previous boundary's
    agreed value, which the GPU finished long ago. One rank alone reads its flag directly."""

    def __init__(self, device: torch.device, world: int):
        self.device, self.world, self.pending = device, world, None

    def __call__(self, requested: bool) -> bool:
        if self.world == 1:
            return requested
        flag = torch.full((1,), float(requested), device=self.device)
        torch.distributed.all_reduce(flag)
        host = torch.empty(1, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, self.pending = self.pending, (host, done)
        if previous is None:
            return False
        previous[1].synchronize()
        return bool(previous[0][0] > 0)


class StepDeadline:
    """After a stop request: whether the step in progress can still finish, and its checkpoint be
    saved, within `grace_s` of the request (the deepspeed launcher's SIGKILL). The step's time
    is estimated from the last whole step's and from this one's micro-batches so far, the save's
    from this session's last save (half the grace until one is timed), plus `MARGIN_S`."""

    MARGIN_S = 3.0  # the exit after the save, and the estimates' error

    def __init__(self, grad_accum: int, grace_s: float, clock: Callable[[], float]):
        self.grad_accum, self.grace_s, self.clock = grad_accum, grace_s, clock
        self.began = clock()  # when the step in progress began (the last boundary's end)
        self.per_micro = 0.0  # seconds per micro-batch of the last whole step
        self.save_s: float | None = None  # seconds of this session's last save

    def step_ended(self) -> None:
        self.per_micro = (self.clock() - self.began) / self.grad_accum

    def step_began(self) -> None:
        self.began = self.clock()

    def over(self, requested_at: float, done: int) -> bool:
        """True when the step, `done` of its micro-batches finished, cannot finish and be
        saved in time (`requested_at`: 0 for a request with no launcher behind it)."""
        if not requested_at:
            return False
        now = self.clock()
        per_micro = max(self.per_micro, (now - self.began) / max(done, 1))
        finished = now + (self.grad_accum - done) * per_micro
        save = self.save_s if self.save_s is not None else self.grace_s / 2
        return finished + save + self.MARGIN_S - requested_at > self.grace_s


class StepGuard(Protocol):
    stop_seen: bool  # a stop was requested on some rank (as far as this rank knows yet)
    abandoned: bool  # the ranks agreed to abandon the step in progress (`StepDeadline`)

    def micro_step(
        self,
        engine,
        loss: torch.Tensor,
        tokens: int,
        requested: bool,
        state: TrainState,
        over: bool = False,
    ) -> None:
        """Backward and step of one micro-batch (`tokens`: its non-padding tokens on this
        rank; `requested`: a stop asked of this rank); a non-finite one with its loss zeroed.
        `over`: this rank's `StepDeadline` says the step cannot be saved in time; where the
        ranks agree on it, the micro-batch gets no backward and `abandoned` is set."""

    def mark(self) -> None:
        """At a step boundary, after its log line and checkpoint: what `rewind` goes back to."""

    def rewind(self) -> None:
        """The sums of an abandoned step's micro-batches dropped (back to `mark`)."""

    def stop(self, requested: bool) -> bool:
        """At an optimizer-step boundary: whether the ranks agree to stop."""

    def settle(self, state: TrainState) -> None:
        """Before a log line or a checkpoint: the counts into `state`; a TrainingError when the
        loss has been non-finite `max_nonfinite` micro-batches in a row."""


class _Guard:
    def __init__(self, device, world: int, max_nonfinite: int, report: Callable, advice: str):
        self.world, self.max_nonfinite, self.report, self.advice = (
            world,
            max_nonfinite,
            report,
            advice,
        )
        self.window = DeviceWindow(device)
        self.stop_seen = False
        self.abandoned = False
        self._marked = self.window.sums.clone()

    def mark(self) -> None:
        self._marked.copy_(self.window.sums)  # on the device: no host sync

    def rewind(self) -> None:
        self.window.sums.copy_(self._marked)

    def diverged(self, run: int, step: int) -> TrainingError:
        return TrainingError(
            f"the loss was NaN/inf for {run} micro-batches in a row at step {step}: the run "
            f"has diverged; {self.advice}"
        )


class HostGuard(_Guard):
    """Decisions read on the host before the backward (module docstring)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.in_a_row = 0

    def micro_step(self, engine, loss, tokens, requested, state, over=False) -> None:
        finite = torch.isfinite(loss.detach()).item()
        flags = torch.tensor(
            [float(not finite), float(requested), float(tokens), float(over)], dtype=torch.float64
        )
        if self.world > 1:
            torch.distributed.all_reduce(flags)
        self.stop_seen = self.stop_seen or bool(flags[1] > 0)
        if flags[3] > 0:  # some rank's deadline: no backward; the loop saves the last step
            self.abandoned = True
            return
        state.tokens += int(flags[2])
        if flags[0] > 0:
            state.skipped_nonfinite += 1
            self.in_a_row += 1
            self.report(
                f"step {state.step + 1}: non-finite loss, micro-batch skipped "
                f"({state.skipped_nonfinite} so far)"
            )
            if self.in_a_row >= self.max_nonfinite:
                raise self.diverged(self.in_a_row, state.step + 1)
            # its place in the accumulation kept; its loss zeroed (where: keeps the graph)
            engine.backward(torch.where(flags[0] > 0, torch.zeros_like(loss), loss))
            engine.step()
            return
        self.in_a_row = 0
        engine.backward(loss)
        engine.step()
        self.window.add(loss, torch.zeros((), dtype=torch.float64))

    def stop(self, requested: bool) -> bool:
        return self.stop_seen

    def settle(self, state: TrainState) -> None:
        self.window.fold(state)


class DeviceGuard(_Guard):
    """No host sync per micro-batch (module docstring)."""

    def __init__(self, device, world: int, *args):
        super().__init__(device, world, *args)
        self.device, self.local_tokens, self._marked_tokens = device, 0, 0
        self.agreed_stop = LaggedStop(device, world)
        # [non-finite, stop requested, step over its deadline], summed over the ranks
        self._flags = torch.zeros(3, dtype=torch.float64, device=device)

    def mark(self) -> None:
        super().mark()
        self._marked_tokens = self.local_tokens

    def rewind(self) -> None:
        super().rewind()
        self.local_tokens = self._marked_tokens

    def micro_step(self, engine, loss, tokens, requested, state, over=False) -> None:
        flags = self._flags
        flags[0].copy_(~torch.isfinite(loss.detach()))
        flags[1].fill_(float(requested))  # fills, not host tensors: no copy to the device
        flags[2].fill_(float(over))
        if self.world > 1:
            torch.distributed.all_reduce(flags)
        if requested and self._abandon(flags):
            return
        self.local_tokens += tokens
        bad = (flags[0] > 0).to(torch.float64)
        loss = torch.where(bad > 0, torch.zeros_like(loss), loss)  # skipped: no gradient
        engine.backward(loss)
        engine.step()
        self.window.add(loss, bad)

    def _abandon(self, flags: torch.Tensor) -> bool:
        """Read by a rank with a stop request only: every rank has one (so every rank reads
        this) and some rank's step is over its deadline. Sets `abandoned` and `stop_seen`."""
        _, requested, over = flags.tolist()
        self.abandoned = requested >= self.world and over > 0
        self.stop_seen = self.stop_seen or self.abandoned
        return self.abandoned

    def stop(self, requested: bool) -> bool:
        self.stop_seen = self.stop_seen or self.agreed_stop(requested)
        return self.stop_seen

    def settle(self, state: TrainState) -> None:
        state.tokens += self._global_tokens()
        new_bad, longest = self.window.fold(state)
        if new_bad:
            self.report(
                f"step {state.step}: {new_bad} non-finite micro-batches skipped "
                f"({state.skipped_nonfinite} so far)"
            )
        if longest >= self.max_nonfinite:
            raise self.diverged(longest, state.step)

    def _global_tokens(self) -> int:
        local, self.local_tokens = self.local_tokens, 0
        if self.world == 1:
            return local
        total = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(total)
        return int(total.item())


def step_guard(
    device: torch.device, world: int, max_nonfinite: int, report: Callable, advice: str
) -> StepGuard:
    """The guard for `device`: `HostGuard` on a CPU, `DeviceGuard` otherwise. `report` shows a
    line (the progress bar's write); `advice` ends the divergence error ("lower the lr ...")."""
    kind = HostGuard if device.type == "cpu" else DeviceGuard
    return kind(device, world, max_nonfinite, report, advice)
