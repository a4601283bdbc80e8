"""Host reads of a training step that does not log (tools/bench/count_ops.py's counter, one process)."""

from __future__ import annotations

import argparse

import pytest
import torch

from shatter.tools.bench.count_ops import OpCounter, count_engine
from shatter.train.engine import init_distributed
from shatter.train.guard import DeviceWindow, LaggedStop


@pytest.mark.slow
def test_a_step_that_does_not_log_reads_nothing_on_the_host():
    """Real DeepSpeed engines with the trainer's GPU config: forward, engine.backward,
    engine.step, and the loop's device-side bookkeeping of a micro-batch (the non-finite flag,
    the loss window, the stop agreement), counted by aten op. Reads of ours: none. DeepSpeed's
    own: none at fp32 ZeRO-0, nor at bf16 ZeRO-1, where it read the global norm's validity to
    skip a non-finite step (stage_1_and_2.step) and its clipping's check of the norm once per
    parameter group: both are made on the device (train/engine.py, skip_on_the_device,
    clip_without_host_reads)."""
    init_distributed()
    args = argparse.Namespace(micro_batch=2, seq_len=32, vocab=300, grad_accum=2, warmup=1)
    for precision, stage, deepspeed_reads in (("fp32", 0, 0), ("bf16", 1, 0)):
        tally = count_engine("bert-tiny", precision, stage, {}, args)
        sites = dict(tally.read_sites)
        # forward: the CPU-only validation of the attention mask (model.py reads it on a CPU,
        # where a read is free; on a GPU the branch is sync-free), one per micro-batch
        forward = {s: n for s, n in sites.items() if s.startswith("forward")}
        assert sum(forward.values()) == args.grad_accum, sites
        assert all(s.startswith("forward shatter/model.py") for s in forward), sites
        rest = {s: n for s, n in sites.items() if not s.startswith("forward")}
        assert all(s.split()[1].startswith("deepspeed/") for s in rest), rest
        assert sum(rest.values()) == deepspeed_reads, (precision, stage, rest)
        assert tally.ops["step"] > 0 and tally.ops["backward"] > 0
    # the loop's own per-micro-batch device work on a step that does not log
    counter = OpCounter()
    window, stop = DeviceWindow(torch.device("cpu")), LaggedStop(torch.device("cpu"), 1)
    loss = torch.tensor(2.5, requires_grad=True)
    with counter, counter.counting("step"):
        for _ in range(3):
            bad = (~torch.isfinite(loss.detach())).to(torch.float64)
            kept = torch.where(bad > 0, torch.zeros_like(loss), loss)
            window.add(kept, bad)
            stop(False)
    assert counter.tally.reads["step"] == 0 and counter.tally.ops["step"] > 0
