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

    return outside_graphs(run)


def outside_graphs(fn):
    """`torch.compiler.disable(fn)`, made on `fn`'s first call: importing torch._dynamo takes
    1.5-3 s, which every `import shatter` (each data-pipeline worker too) would pay at import
    time. torch's own lazy form where it has one (a private API), else the public one."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def constant_under_compile(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing torch._dynamo: that
    decorator only marks `fn` (tests/shatter/test_eager.py checks that it still does)."""
    fn._dynamo_marked_constant = True
    return fn
