"""No code from a checkpoint: every `torch.load` of the toolkit unpickles weights only.

A DeepSpeed checkpoint is a set of pickle files (`torch.save`), and DeepSpeed loads them with
`weights_only=False`, so a crafted file runs its payload on `load`. Here every load, the
toolkit's own and DeepSpeed's inside `only_weights()`, is `torch.load(weights_only=True)`
(PyTorch's restricted unpickler: tensors, containers, numbers, strings) with an allowlist of
exactly the classes DeepSpeed's own checkpoint files hold (`deepspeed_globals`). A file needing
anything else is refused in one line naming the file and the class, before any of it runs.

References: PyTorch, `torch.serialization.safe_globals` and "weights_only" in `torch.load`'s
documentation.
"""

from __future__ import annotations

import functools
import pickle
import re
from contextlib import contextmanager

import torch

from shatter.accelerator import say_deepspeed_accelerator


class UnsafeCheckpointError(ValueError):
    """A file that holds more than weights (a class outside the allowlist): refused, not run."""


@functools.cache
def deepspeed_globals() -> tuple:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and containers: the
    fp32/bf16 partitions' slice mappings, the loss scalers (fp32, fp16) and the ZeRO stage."""
    say_deepspeed_accelerator()  # before DeepSpeed's first import: no warning of its guess
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum)


def _refusal(source, err: Exception) -> UnsafeCheckpointError:
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"Unsupported (\w+)", text)
    what = found.group(1) if found else " ".join(text.split())[:160]
    return UnsafeCheckpointError(
        f"{source} holds more than weights ({what}): refused, not unpickled (it could run code); "
        "load only checkpoints this toolkit wrote, or convert a trusted file yourself"
    )


def load(source, map_location="cpu", **kwargs):
    """`torch.load(source, weights_only=True)` with DeepSpeed's classes allowed; anything else
    is an `UnsafeCheckpointError` naming `source`."""
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)  # the restricted unpickler only
    try:
        with torch.serialization.safe_globals(list(deepspeed_globals())):
            return _REAL_LOAD(source, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise _refusal(source, err) from None


_REAL_LOAD = torch.load


def _load_for_deepspeed(f, map_location=None, *args, **kwargs):
    return load(f, map_location, **kwargs)


@contextmanager
def only_weights():
    """Inside, every `torch.load` (DeepSpeed's `weights_only=False` ones included) is `load`."""
    torch.load = _load_for_deepspeed
    try:
        yield
    finally:
        torch.load = _REAL_LOAD
