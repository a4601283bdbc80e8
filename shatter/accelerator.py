"""The accelerator: DeepSpeed's, said rather than guessed; a CUDA device's compute capability;
whether triton imports.

Without `DS_ACCELERATOR` DeepSpeed probes for one when it is first imported, and on a machine
without CUDA it prints `[WARNING] ... Setting accelerator to CPU. If you have GPU or other
accelerator, we were unable to detect it.` from every process that imports it (the `deepspeed`
launcher, its per-node launcher, each rank, `shatter-extend` reading a DeepSpeed checkpoint). The
toolkit runs on CUDA or on the CPU, so it says which before any import of DeepSpeed; a value the
user set is kept.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from shatter.eager import constant_under_compile


def say_deepspeed_accelerator() -> None:
    """`DS_ACCELERATOR=cpu` in os.environ (which child processes inherit) on a machine without
    CUDA, unless it is set already; with CUDA, DeepSpeed's own detection finds it without a
    warning."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


_CAPABILITIES: dict[int, tuple[int, int]] = {}


def capability(index: int) -> tuple[int, int]:
    """CUDA device `index`'s compute capability, a driver query made once (no sync per call). A
    plain dict, not functools.cache: torch.compile traces this from every layer's forward and
    warns of each cached function it meets."""
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def device_index(device: torch.device) -> int:
    """A CUDA device's index, the current device's where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


_TRITON: list[bool] = []  # whether triton imports, found once


@constant_under_compile
def triton_importable() -> bool:
    """Whether triton imports here (looked up once; a constant to torch.compile, which reads it
    from every layer's forward)."""
    if not _TRITON:
        _TRITON.append(importlib.util.find_spec("triton") is not None)
    return _TRITON[0]
