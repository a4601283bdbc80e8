"""Host time per launch of the `triton` and `rows` attentions' Triton kernels: Triton's own path
(`kernel[grid](**kwargs)`) against shatter.kernels.launch's (`fast(kernel)[grid](**kwargs)`),
side by side from one run.

    python tools/bench/launch_cost.py                       # base shape, l = 256, bf16
    python tools/bench/launch_cost.py --length 1024 --rows 16
    python tools/bench/launch_cost.py --rows 4 --calls 500   # on a GPU (.ci/gpu/run.sh measure)

Each kernel is launched with the arguments a layer's forward and backward give it (captured from
one real call of each); the figures are the median µs of host time per launch over --calls
launches, and the GPU is never waited for. On a CUDA machine the kernels launch for real: keep
the batch small there (--rows 4), so that the GPU runs each launch faster than the host makes
it, and the host's own time is what is timed. Without one, a stand-in driver (`cpu_driver`)
compiles the kernels for sm_90 as the GPU would and launches nothing: what is timed is then all
of the host's work but the driver's own launch call (a few µs). Each row also checks that the
fast path, by its shortcut, passed the launcher exactly what Triton's path passed it (`same
launch`), and the script exits 1 if not (or where the fast path is off).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import click

# the kernels of each impl, as the table's totals group them (delta_kernel: below sm_90 only)
IMPLS = {
    "triton": ("row_stats_kernel", "mix_fwd_kernel", "mix_bwd_dv_kernel", "delta_kernel",
               "mix_bwd_dz_kernel"),
    "rows": ("rows_fwd_kernel", "rows_bwd_kernel"),
}  # fmt: skip  # the compiled kernels' host path, not the interpreter's


class _Utils:
    """The CUDA driver utilities Triton's launch path asks for, without a GPU."""

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "warpSize": 32}


class StandInDriver:
    """A CUDA driver for Triton on a machine without a GPU: the current device and stream are 0,
    the target sm_90; compilations are Triton's own; the launcher runs nothing; the autotuner's timing returns equal times (it
    then keeps its first configuration)."""

    utils = _Utils()

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_benchmarker(self):
        return lambda fn, quantiles=None, **kw: [1.0] * len(quantiles) if quantiles else 1.0

    def launcher_cls(self, src, metadata):
        return lambda *args: None

    def is_active(self):
        return True


@contextlib.contextmanager
def cpu_driver():
    """Triton's active driver set to a StandInDriver (and torch's device capability to sm_90,
    which the autotuner's pruning reads) for the duration."""
    import torch
    from triton.runtime import driver

    stand_in = StandInDriver()
    capability = torch.cuda.get_device_capability
    previous = driver._active  # None until a driver was asked for (none exists on this machine)
    driver.set_active(stand_in)
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    try:
        yield stand_in
    finally:
        driver._active = previous
        torch.cuda.get_device_capability = capability


def layer_launches(rows: int, length: int, d: int, n: int, device: str):
    """[(name, kernel, grid, args, kwargs)]: each Triton launch of one layer's forward and
    backward with the arguments the layer gives it (bf16, sigmoid scores, the part bias), for
    the `triton` impl (sm_80 and up) and the `rows` impl (the V100's)."""
    import torch

    import shatter.attention.rows as rows_impl
    import shatter.attention.triton_kernel as tk
    from shatter.attention.projection import context_views, padded, projection_width
    from shatter.partition import partition_table

    calls = []

    def record(kernel):
        def at(grid):
            def call(*args, **kwargs):
                name = getattr(kernel, "base_fn", kernel).__name__
                calls.append((name, kernel, grid, args, kwargs))
                kernel[grid](*args, **kwargs)

            return call

        return type("Recorded", (), {"__getitem__": lambda self, grid: at(grid)})()

    g = torch.Generator().manual_seed(0)
    new = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)  # noqa: E731
    P, X = new(rows, length, projection_width(d, n)), new(rows, length, d)
    mask = torch.ones(rows, length, dtype=torch.bool, device=device)
    table = partition_table(n, 0, 12, max(512, length)).to(device)
    _, _, c = tk.projection_views(P, d, n)
    real, tk.fast, rows_impl.fast = tk.fast, record, record
    try:
        Z = X.new_empty(rows, length, padded(length))  # made by the statistics (sm_80+)
        ctx, stat = tk.forward_kernels(P, X, mask, table, True, Z, make_z=True)
        out, part = context_views(ctx, n)
        g_out, g_part = context_views(torch.ones_like(ctx), n)
        tk.backward_kernels(P, X, mask, table, Z, stat, out, part, g_out, g_part, True)
        W, part = rows_impl.rows_fwd(Z, c, mask, table, True)
        dW = new(rows, n, length, padded(length))
        rows_impl.rows_bwd(Z, c, mask, table, dW, torch.ones_like(part), True, d**-0.5)
    finally:
        tk.fast = rows_impl.fast = real
    return calls


def host_us(launch, calls: int) -> float:
    """Median µs of host time per call of `launch()`."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        launch()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def same_launch(a, b) -> bool:
    """Two launcher calls with the same arguments: tensors the same objects, the launch
    metadata (a LazyDict made per launch for the launch hooks) the same contents."""
    from triton.compiler.compiler import LazyDict

    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_launch, a, b))
    if isinstance(a, dict):
        return (
            type(b) is dict
            and a.keys() == b.keys()
            and all(map(same_launch, a.values(), b.values()))
        )
    if isinstance(a, LazyDict):
        return type(b) is LazyDict and same_launch((a.data, a.extras), (b.data, b.extras))
    return a is b or (type(a) is type(b) and not hasattr(a, "data_ptr") and a == b)


@contextlib.contextmanager
def recorded_launches(launcher):
    """The launcher calls of `launcher`'s compiled kernels (a FastLaunch), in a list: each
    compiled kernel's launcher wrapped to record its arguments, then call through."""
    calls, kept = [], []
    for compiled, _ in launcher.cache.values():
        run = compiled.run  # made on first use
        kept.append((compiled, run))
        compiled._run = lambda *args, run=run: (calls.append(args), run(*args))[1]
    try:
        yield calls
    finally:
        for compiled, run in kept:
            compiled._run = run


def compare(launches, calls: int) -> list[dict]:
    """Per launch: µs through Triton's path and the fast path, and whether the two passed the
    launcher the same arguments, the fast one by its shortcut (a kept signature's hit)."""
    from shatter.kernels.launch import fast

    rows = []
    for name, kernel, grid, args, kwargs in launches:
        fast(kernel)[grid](*args, **kwargs)  # the first call of the signature: Triton's own path
        with recorded_launches(fast(kernel)) as made:
            kernel[grid](*args, **kwargs)
            hits = fast(kernel).hits
            fast(kernel)[grid](*args, **kwargs)
        hit = fast(kernel).hits == hits + 1
        same = hit and len(made) == 2 and same_launch(*made)
        triton_us = host_us(lambda k=kernel, g=grid, a=args, kw=kwargs: k[g](*a, **kw), calls)
        fast_us = host_us(lambda k=kernel, g=grid, a=args, kw=kwargs: fast(k)[g](*a, **kw), calls)
        rows.append({"kernel": name, "args": len(args) + len(kwargs), "triton_us": triton_us,
                     "fast_us": fast_us, "same": same})  # fmt: skip
    return rows


@click.command()
@click.option("--rows", default=64, show_default=True, help="sequences a batch")
@click.option("--length", default=256, show_default=True)
@click.option("--hidden", default=768, show_default=True, help="d")
@click.option("--parts", default=12, show_default=True, help="n")
@click.option("--calls", default=2000, show_default=True, help="timed launches per kernel")
def main(rows: int, length: int, hidden: int, parts: int, calls: int) -> None:
    import torch
    import triton

    from shatter.kernels.launch import ENABLED

    if not ENABLED:
        sys.exit(
            f"launch_cost: the fast path is off here (Triton {triton.__version__}; it takes "
            "3.6-3.9 and never the interpreter): nothing to compare"
        )
    cuda = torch.cuda.is_available()
    with contextlib.nullcontext() if cuda else cpu_driver():
        launches = layer_launches(rows, length, hidden, parts, "cuda" if cuda else "cpu")
        table = compare(launches, calls)
    where = torch.cuda.get_device_name() if cuda else "no GPU: stand-in sm_90 driver"
    print(f"triton {triton.__version__}, torch {torch.__version__}, {where}; fast path on; "
          f"{rows} x {length}, d = {hidden}, n = {parts}")  # fmt: skip
    print("| kernel | arguments | Triton µs | fast µs | Triton / fast | same launch |")
    print("|---|---|---|---|---|---|")
    for r in table:
        same = "yes" if r["same"] else "NO"
        print(f"| {r['kernel']} | {r['args']} | {r['triton_us']:.1f} | {r['fast_us']:.1f} | "
              f"{r['triton_us'] / r['fast_us']:.2f} | {same} |")  # fmt: skip
    for impl, names in IMPLS.items():
        mine = [r for r in table if r["kernel"] in names]
        total = [sum(r[k] for r in mine) for k in ("triton_us", "fast_us")]
        print(
            f"{impl}: a layer's {len(mine)} launches, {total[0]:.0f} µs against {total[1]:.0f} µs"
        )
    if not all(r["same"] for r in table):
        sys.exit(
            "launch_cost: the fast path missed a kept signature or passed the launcher other "
            "arguments than Triton's path (the NO rows)"
        )


if __name__ == "__main__":
    # the compiled kernels' host path, not the interpreter's (read when shatter imports triton)
    os.environ.pop("TRITON_INTERPRET", None)
    main()
