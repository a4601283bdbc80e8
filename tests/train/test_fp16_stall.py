"""fp16 that cannot stall, the parts a CPU runs: DeepSpeed's dynamic loss scaler with its
raise at the minimum scale turned off (as `guard_nonfinite_steps` leaves it) keeps skipping
instead of ending the run after 18 overflows, and the diagnostic forward names the first layer
whose output is not finite. The whole path (an fp16 engine on a GPU) is in tests/train/test_gpu.py."""

import pytest
import torch

import shatter
from shatter.train.engine import first_nonfinite_output, init_distributed


def test_the_loss_scaler_at_its_minimum_skips_instead_of_raising():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    def scaler():
        return DynamicLossScaler(2.0**16, 1000, 1.0, delayed_shift=2, consecutive_hysteresis=False)

    if not torch.distributed.is_initialized():
        init_distributed()  # a world of one: the scaler asks its rank
    raising, overflows = scaler(), 0
    with pytest.raises(Exception, match="already at minimum"):
        while overflows < 100:
            overflows += 1
            raising.update_scale(True)
    assert overflows == 18  # DeepSpeed's own end of a persistent overflow: before 100 skips
    quiet = scaler()
    quiet.raise_error_at_min_scale = False
    for _ in range(100):
        quiet.update_scale(True)
    assert quiet.cur_scale == 1.0


def test_the_first_non_finite_output_is_named():
    torch.manual_seed(0)
    model = shatter.build_model("shatter-tiny", vocab_size=100, max_len=16).eval()
    inputs = {"input_ids": torch.randint(5, 100, (2, 16)), "attention_mask": torch.ones(2, 16)}
    assert first_nonfinite_output(model, inputs) is None
    ffn = model.encoder.layers[1].ffn_in
    handle = ffn.register_forward_hook(lambda m, i, o: o * float("nan"))
    assert first_nonfinite_output(model, inputs) == "encoder.layers.1.ffn_in"
    handle.remove()
