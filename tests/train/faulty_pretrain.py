"""train/pretrain.py with one fault injected on one rank, for the exit-path tests.

SHATTER_TEST_FAULT=KIND:RANK:STEP; in STEP's backward, rank RANK (after saying `fault: KIND`):
- `raise`: a gradient hook of the first layer raises, with the later layers' gradients already
  reduced (ZeRO's buckets in flight); its `destroy_process_group` is made to block for ever, as
  NCCL's flush of pending work does after such a failure;
- `block`: waits (an hour) in a receive that no peer sends, so its peers' next collective
  times out;
- `kill`: SIGKILLs itself (the OOM killer).

SHATTER_TEST_KILL_SAVE=POINT:STEP: kill -9 of the whole job (launcher, ranks, loader
workers: the process group) at a point of the save of checkpoint STEP, as a preemption's SIGKILL
that lands during a save:
- `before`: before any file of it is written;
- `between`: rank 0's files written, rank 1's not (its optimizer partition is removed again);
- `after`: once `latest` names it.

SHATTER_TEST_NAN=MICRO: the loss of the run's micro-batch MICRO (counted from 0, on every rank)
is NaN, with a gradient.

SHATTER_TEST_SPIKE=MICRO: from the run's micro-batch MICRO on, every loss is 100 times larger (a
finite divergence), with its gradient.

SHATTER_TEST_SLOW=SECONDS: every training micro-batch's forward takes SECONDS longer (a slow
node); SHATTER_TEST_GRACE=SECONDS: the launcher's SIGKILL is taken to come SECONDS after a stop
request (train/lifecycle.py's `LAUNCHER_KILL_S`), so a step is abandoned as a long one would be.
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shatter.train import checkpoint, lifecycle  # noqa: E402
from shatter.train.lifecycle import run_cli  # noqa: E402
from shatter.train.pretrain import main  # noqa: E402

KIND, RANK, STEP = os.environ.get("SHATTER_TEST_FAULT", "none:-1:0").split(":")
KILL = os.environ.get("SHATTER_TEST_KILL_SAVE", "none:0").split(":")
backward = deepspeed.DeepSpeedEngine.backward
save_checkpoint = deepspeed.DeepSpeedEngine.save_checkpoint
save = checkpoint.save
forward = deepspeed.DeepSpeedEngine.forward
NAN_MICRO = int(os.environ.get("SHATTER_TEST_NAN", "-1"))


SPIKE_MICRO = int(os.environ.get("SHATTER_TEST_SPIKE", "-1"))
SLOW_S = float(os.environ.get("SHATTER_TEST_SLOW", "0"))
lifecycle.LAUNCHER_KILL_S = float(os.environ.get("SHATTER_TEST_GRACE", lifecycle.LAUNCHER_KILL_S))


def nan_forward(engine, *args, **kwargs):
    if engine.training and SLOW_S:
        time.sleep(SLOW_S)
    out = forward(engine, *args, **kwargs)
    if engine.training and engine.micro_steps == NAN_MICRO:
        out["loss"] = out["loss"] * float("nan")
    if engine.training and 0 <= SPIKE_MICRO <= engine.micro_steps:
        out["loss"] = out["loss"] * 100.0  # a finite divergence from there on
    return out


def kill_job(point: str) -> None:
    sys.stderr.write(f"kill -9 {point} the save of step {KILL[1]}\n")
    sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


def killing_save(engine, run_dir, state, *args, **kwargs):
    if KILL[0] == "before" and state.step == int(KILL[1]) and os.environ.get("RANK") == "0":
        kill_job("before")
    name = save(engine, run_dir, state, *args, **kwargs)
    if KILL[0] == "after" and state.step == int(KILL[1]) and os.environ.get("RANK") == "0":
        kill_job("after")
    return name


def killing_save_checkpoint(engine, save_dir, tag=None, *args, **kwargs):
    done = save_checkpoint(engine, save_dir, tag, *args, **kwargs)
    if (
        KILL[0] == "between"
        and tag == checkpoint.tag(int(KILL[1]))
        and os.environ.get("RANK") == "1"
    ):
        for path in Path(save_dir, tag).glob("*zero_pp_rank_1_*"):
            path.unlink()  # not written yet when the kill lands
        kill_job("between")
    return done


def _raise(grad):
    raise RuntimeError("injected failure in the backward")


def faulty_backward(engine, loss, *args, **kwargs):
    if os.environ.get("RANK") == RANK and engine.global_steps + 1 == int(STEP):
        sys.stderr.write(f"fault: {KIND} on rank {RANK}\n")
        sys.stderr.flush()
        if KIND == "raise":
            dist.destroy_process_group = lambda *a, **k: time.sleep(10**6)
            first = next(p for n, p in engine.module.named_parameters() if "layers.0." in n)
            first.register_hook(_raise)
        elif KIND == "block":
            work = dist.irecv(torch.zeros(1), src=1 - int(RANK), tag=424242)
            work.wait(timeout=timedelta(hours=1))  # longer than any collective timeout
        elif KIND == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    return backward(engine, loss, *args, **kwargs)


deepspeed.DeepSpeedEngine.backward = faulty_backward
deepspeed.DeepSpeedEngine.save_checkpoint = killing_save_checkpoint
checkpoint.save = killing_save
deepspeed.DeepSpeedEngine.forward = nan_forward

if __name__ == "__main__":
    run_cli(main)
