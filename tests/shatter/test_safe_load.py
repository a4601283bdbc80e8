"""No code from a checkpoint: a crafted pickle is refused in one line naming the file, by the
toolkit's own loads and by DeepSpeed's inside `only_weights()`, and its payload never runs;
DeepSpeed's own classes (the allowlist) load. The 2-rank checks of real DeepSpeed files at every
precision and ZeRO stage are in tests/train/ranks_job.py (test_ranks) and test_faults."""

import os
from pathlib import Path

import pytest
import torch

from shatter import safe_load
from shatter.checkpoint import CheckpointError
from shatter.sources import MODEL_STATES, load_deepspeed


class Payload:
    """What a crafted checkpoint holds: unpickling it would create `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


@pytest.fixture
def crafted(tmp_path) -> tuple[Path, Path]:
    """A DeepSpeed-like tag folder whose model states run code when unpickled: (folder, marker)."""
    tag = tmp_path / "step00000004"
    tag.mkdir()
    marker = tmp_path / "payload-ran"
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)}, tag / MODEL_STATES)
    return tag, marker


def test_a_crafted_file_is_refused_in_one_line_and_never_run(crafted):
    tag, marker = crafted
    with pytest.raises(safe_load.UnsafeCheckpointError) as err:
        safe_load.load(tag / MODEL_STATES)
    line = str(err.value)
    assert str(tag / MODEL_STATES) in line and "os.makedirs" in line and "\n" not in line
    assert not marker.exists()


def test_deepspeed_s_own_loads_are_restricted_inside_only_weights(crafted):
    """DeepSpeed calls torch.load(..., weights_only=False): inside, it is refused all the same."""
    tag, marker = crafted
    with safe_load.only_weights(), pytest.raises(safe_load.UnsafeCheckpointError):
        torch.load(tag / MODEL_STATES, map_location="cpu", weights_only=False)
    assert not marker.exists()
    assert torch.load is safe_load._REAL_LOAD  # restored on the way out


def test_shatter_extend_s_loader_refuses_it(crafted):
    tag, marker = crafted
    with pytest.raises(CheckpointError) as err:
        load_deepspeed(tag)
    assert str(tag / MODEL_STATES) in str(err.value) and "refused" in str(err.value)
    assert not marker.exists()


def test_deepspeed_s_classes_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "zero_stage": ZeroStageEnum.optimizer_states,
        "loss_scaler": LossScaler(1.0),
        "dynamic": DynamicLossScaler(2.0**16, 1000, 1.0, False, False),
        "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
        "fp32": [torch.arange(4.0)],
    }
    torch.save(state, tmp_path / "optim.pt")
    back = safe_load.load(tmp_path / "optim.pt")
    assert back["zero_stage"] is ZeroStageEnum.optimizer_states
    assert back["loss_scaler"].cur_scale == 1.0 and back["dynamic"].cur_scale == 2.0**16
    assert back["param_slice_mappings"][0]["w"].numel == 4
    assert torch.equal(back["fp32"][0], torch.arange(4.0))
