"""train/pretrain.py with one fault injected on one rank, for the exit-path tests.

SHATTER_TEST_FAULT=KIND:RANK:STEP; in STEP's backward, rank RANK (after saying `fault: KIND`):
- `raise`: a gradient hook of the first layer raises, with the later layers' gradients already
  reduced (ZeRO's buckets in flight); its `destroy_process_group` is made to block for ever, as
  NCCL's flush of pending work does after such a failure;
- `block`: waits (an hour) in a receive that no peer sends, so its peers' next collective
  times out;
- `kill`: SIGKILLs itself (the OOM killer).
"""

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[2])

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from train.lifecycle import run_cli  # noqa: E402
from train.pretrain import main  # noqa: E402

KIND, RANK, STEP = os.environ["SHATTER_TEST_FAULT"].split(":")
backward = deepspeed.DeepSpeedEngine.backward


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

if __name__ == "__main__":
    run_cli(main)
