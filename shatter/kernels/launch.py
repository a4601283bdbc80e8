"""Triton launches without Triton's per-call Python, once a call's signature has been seen.

`kernel[grid](**kwargs)` spends tens of µs of host time before the GPU sees the launch: the
autotuner's key, the binder's specialization of every argument, the cache key, the grid
(`python tools/bench/launch_cost.py` prints it per kernel). Shatter's `triton` attention makes
four such launches a layer, with about 45 arguments each, and the host's time is what a step
waits for when the GPU outruns it. `fast(kernel)[grid](**kwargs)` takes Triton's own path the
first time it sees a signature, keeps the compiled kernel and the configuration the autotuner
chose, and from then on calls that compiled kernel's launcher directly, with the arguments
Triton's `JITFunction.run` passes it (the same call in Triton 3.6 to 3.9).

A signature is every argument's value, with a tensor counted by its dtype and whether its address
is 16-byte aligned: a superset of what Triton specializes a compilation on (and of the
autotuner's key), so a kernel is never launched with arguments it was not compiled for. The
current device and stream are read on every call, as Triton reads them. Anything else (the
interpreter, a Triton outside the tested versions, an object that is not a Triton kernel, as a
test's stand-in) takes Triton's own path every time.
"""

from __future__ import annotations

import functools
import os

import triton
from torch import Tensor
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

# Triton's interpreter (CPU tensors; the tests without a GPU): read once, as Triton reads it
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The Triton versions whose `JITFunction.run` launches as `_launch` does (tools/bench/
# launch_cost.py compares the two: the suite under 3.9, the GPU lane and its rehearsal under 3.6)
TESTED = ((3, 6), (3, 9))
_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2])
ENABLED = not INTERPRET and TESTED[0] <= _VERSION <= TESTED[1]


def pow2(x: int) -> int:
    """triton.next_power_of_2 as plain Python: Triton 3.9's is a constexpr function whose call
    from Python costs about 6 µs, on every kernel call's host path."""
    return 1 << (x - 1).bit_length() if x > 0 else 0


def fast(kernel):
    """`kernel` (a `triton.autotune` or `triton.jit` kernel) behind a launcher that skips
    Triton's per-call work after the first call of each signature; any other object (or with
    the fast path off: ENABLED) is returned as it is."""
    if not ENABLED or not isinstance(kernel, (Autotuner, JITFunction)):
        return kernel
    return _launcher(kernel)


@functools.cache
def _launcher(kernel) -> FastLaunch:
    return FastLaunch(kernel)


class FastLaunch:
    """`launcher[grid](**kwargs)` as `kernel[grid](**kwargs)` (module doc)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.jit = kernel
        while not isinstance(self.jit, JITFunction):
            self.jit = self.jit.fn
        params = self.jit.signature.parameters.values()
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.cache: dict[tuple, tuple] = {}
        self.hits = 0

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs) -> None:
        device = driver.active.get_current_device()
        # each argument's signature (module doc), inline: a function call per argument would
        # be a third of the launch's host time
        sig = tuple(
            (v.dtype, v.data_ptr() & 15 == 0) if isinstance(v, Tensor) else v
            for v in (*args, *kwargs.values())
        )
        key = (device, len(args), tuple(kwargs), sig)
        entry = self.cache.get(key)
        if entry is None:
            entry = self._first(grid, args, kwargs)
            if entry[0] is not None:  # None: Triton launched nothing (nothing to keep)
                self.cache[key] = entry
            return
        compiled, config = entry
        named = {**self.defaults, **dict(zip(self.jit.arg_names, args)), **kwargs, **config}
        grid = grid(named) if callable(grid) else grid
        stream = driver.active.get_current_stream(device)
        _launch(compiled, grid, stream, [named[name] for name in self.jit.arg_names])
        self.hits += 1

    def _first(self, grid, args, kwargs) -> tuple:
        """Triton's own launch, and what later calls of the signature reuse: the compiled
        kernel and the autotuner's configuration (its constexprs)."""
        compiled = self.kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # a compilation Triton ran asynchronously
            compiled = compiled.result()
        best = getattr(self.kernel, "best_config", None)
        return compiled, (best.kwargs if best is not None else {})


def _launch(compiled, grid, stream, values) -> None:
    """The launcher call of Triton's `JITFunction.run` (3.6 to 3.9), its hooks included."""
    knobs = triton.knobs  # read per call, as Triton reads it (a profiler sets the hooks)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
    size = len(grid)
    compiled.run(
        grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream,
        compiled.function, compiled.packed_metadata, meta, enter, leave, *values,
    )  # fmt: skip
