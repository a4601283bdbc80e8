"""shatter.kernels.launch's fast path passes each kernel's launcher exactly what Triton's own path
passes it, and takes Triton's path again for a signature it has not seen (a tensor's alignment,
an integer argument). Without a GPU the kernels compile for sm_90 under a stand-in driver that
launches nothing (tools/bench/launch_cost.py), in a subprocess: the suite's own processes run
Triton's interpreter, where the fast path is off."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheel for this platform")

from shatter.kernels import launch  # noqa: E402
from shatter.tools.bench.launch_cost import same_launch  # noqa: E402
from tests.conftest import REPO  # noqa: E402


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", code] if code else [sys.executable, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_fast_path_launches_every_kernel_as_triton_does():
    """Every kernel of the `triton` and `rows` impls, at a length that is not a multiple of 16:
    the fast path's second call takes its shortcut and its launcher call equals Triton's (the
    script exits 1 otherwise)."""
    done = _run("tools/bench/launch_cost.py", "--rows", "2", "--length", "40", "--calls", "50")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fast path on" in done.stdout
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert {row[0].lstrip("| ") for row in rows} == {
        *("row_stats_kernel", "mix_fwd_kernel", "mix_bwd_dv_kernel", "delta_kernel"),
        *("mix_bwd_dz_kernel", "rows_fwd_kernel", "rows_bwd_kernel"),
    }
    assert all(row[-1].startswith("yes") for row in rows), done.stdout


SIGNATURES = """
import torch
from shatter.kernels.launch import fast
from shatter.tools.bench.launch_cost import cpu_driver, layer_launches

with cpu_driver():
    launches = {name: (k, g, a, kw) for name, k, g, a, kw in layer_launches(1, 32, 64, 4, "cpu")}
    kernel, grid, args, kwargs = launches["rows_fwd_kernel"]
    fl = fast(kernel)
    fl[grid](*args, **kwargs)
    fl[grid](*args, **kwargs)
    assert (len(fl.cache), fl.hits) == (1, 1), (len(fl.cache), fl.hits)
    (first, _), = fl.cache.values()
    Z = args[0]
    shifted = torch.empty(Z.numel() + 1, dtype=Z.dtype)[1:].view(Z.shape)  # 2 bytes off 16
    assert shifted.data_ptr() % 16
    fl[grid](shifted, *args[1:], **kwargs)
    assert (len(fl.cache), fl.hits) == (2, 1), (len(fl.cache), fl.hits)
    compiled = [c for c, _ in fl.cache.values()]
    assert compiled[1] is not first  # Triton compiled it for an unaligned Z
    other = list(args)
    other[-1] = args[-1] + 1  # T_CENTRE: an integer argument
    fl[grid](*other, **kwargs)
    assert (len(fl.cache), fl.hits) == (3, 1), (len(fl.cache), fl.hits)
print("ok")
"""


@pytest.mark.slow
def test_a_signature_not_seen_takes_triton_s_path():
    """A tensor 2 bytes off 16-byte alignment, or another integer value, is a new signature:
    Triton's own path (which compiles the unaligned one anew), not the kept launch."""
    done = _run(code=SIGNATURES)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_launches_compare_tensors_by_identity_and_values_by_equality():
    t = torch.zeros(3)
    assert same_launch((1, 2.0, t, (4, t)), (1, 2.0, t, (4, t)))
    assert not same_launch((1, t), (1, t.clone()))
    assert not same_launch((1, t), (2, t))
    assert not same_launch((1, True), (1, 1))  # a bool is not its integer
    assert not same_launch((1,), (1, 2))


def test_under_the_interpreter_kernels_launch_as_they_are():
    """The suite's processes run Triton's interpreter: `fast` hands the kernel back."""
    from shatter.kernels.partition_mixing import mix_fwd_kernel

    assert launch.INTERPRET == (os.environ.get("TRITON_INTERPRET") == "1")
    if launch.INTERPRET:
        assert not launch.ENABLED and launch.fast(mix_fwd_kernel) is mix_fwd_kernel
