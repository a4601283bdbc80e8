"""The loop's device-side sums (what a GPU step keeps instead of reading values per step)
against a plain host computation of the same micro-batch sequence."""

import math

import torch

from train.checkpoint import TrainState
from train.loop import DeviceWindow, LaggedStop


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
