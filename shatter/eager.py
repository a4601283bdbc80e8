"""Model code that torch.compile leaves to eager, and the mark that says so.

`@eager` runs a function outside Dynamo's graphs (`torch.compiler.disable`: a graph break) inside
the profiler range EAGER, and `eager_region()` opens that range by hand (a custom autograd
Function's backward, which autograd runs outside the compiled graphs when its forward ran
outside them). Used where inductor would run the code worse than eager: a `cat` of many
parameters, which inductor copies with one kernel per parameter (each layer's W^Q, W^K, W^V and
their biases: 72 launches a forward for BERT-base) where CUDA's eager `cat` copies them in one. torch.profiler shows
the range by its name; tools/bench/step_trace.py reads it to price those kernels as eager ones
in a compiled step.
"""

from __future__ import annotations

import functools

import torch

EAGER = "shatter::eager"


def eager_region():
    """The profiler range that marks eager kernels (a context manager)."""
    return torch.profiler.record_function(EAGER)


def eager(fn):
    """`fn`, run eagerly under torch.compile (a graph break) and marked (module doc)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with eager_region():
            return fn(*args, **kwargs)

    return torch.compiler.disable(run)
