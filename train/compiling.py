"""`run.compile`: the model compiled by torch.compile (inductor), or refused in one line.

`true` compiles (or refuses), `false` runs eager; unset (`auto`) compiles on a CUDA GPU where
inductor can run (triton installed) and runs eager on a CPU, where inductor's C++ build costs
more than it saves on a small model. The compiled model equals the eager one (tests/shatter/
test_kernel_ops.py and tests/train/test_compiling.py check it).

The model is compiled in place (`nn.Module.compile`), so its state dict, and with it the
checkpoints and the export, keep their names. Inductor's mix-order reductions (a LayerNorm
backward's weight and bias gradients) are finished by one torch op a kernel (train/mix_order.py). Inductor builds C++ kernels on a CPU and Triton
kernels on a GPU: without a C++ compiler, or without triton, the run is refused before it starts;
a model torch.compile cannot compile is refused at its first step.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch
from torch import nn

from shatter.train.config import ConfigError
from shatter.train.mix_order import finish_in_one


def compile_problem(device_type: str) -> str | None:
    """A sentence saying why inductor cannot compile here, else None."""
    if device_type == "cpu":
        compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in compilers):
            return (
                "run.compile on a CPU needs a C++ compiler (inductor builds its kernels with one): "
                "install g++ or set run.compile: false"
            )
    elif importlib.util.find_spec("triton") is None:
        return "run.compile on a GPU needs triton: pip install triton, or set run.compile: false"
    return None


def wants_compile(setting: bool | None, device_type: str, zero_stage: int = 0) -> bool:
    """run.compile resolved: `auto` (None) is on for CUDA where inductor can run, else off; off
    under ZeRO-3, whose partitioned parameters are 1-D placeholders outside DeepSpeed's gathers
    (Dynamo traces them as such: "b must be 2D" on an H200), and `true` there is refused."""
    if zero_stage == 3:
        if setting:
            raise ConfigError(
                "run.compile: true cannot run under ZeRO-3 (torch.compile traces its partitioned "
                "parameters as empty 1-D tensors); set run.compile: false or --zero-stage 2"
            )
        return False
    if setting is not None:
        return setting
    return device_type == "cuda" and compile_problem(device_type) is None


def compile_model(model: nn.Module) -> nn.Module:
    """`model`, compiled in place; a ConfigError where inductor cannot run."""
    problem = compile_problem("cuda" if torch.cuda.is_available() else "cpu")
    if problem:
        raise ConfigError(problem)
    return compile_in_place(model)


def compile_in_place(model: nn.Module) -> nn.Module:
    """`model.compile()` as every compiled run takes it: with inductor's mix-order reductions
    finished in one op a kernel (`finish_in_one`)."""
    finish_in_one()
    model.compile()
    return model


def mark_varying(inputs: dict) -> None:
    """The count of predicted positions (`predicted`) changes with every batch: a dynamic size
    under torch.compile from the first batch on. Without the mark, Dynamo compiles the first
    batch's count, then the whole step once more at the second's. Nothing without torch.compile
    (torch._dynamo not loaded)."""
    predicted = inputs.get("predicted")
    if predicted is not None and "torch._dynamo" in sys.modules:
        torch._dynamo.maybe_mark_dynamic(predicted, 0)


def one_line(err: Exception) -> str:
    """The refusal of a model that torch.compile failed on."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return (
        f"run.compile: torch.compile could not compile the model ({first[:300]}); "
        "train without it (run.compile: false)"
    )
