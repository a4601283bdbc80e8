"""tools/bench/kernel_report.py compiles the Triton mixing kernels ahead of time (no GPU) and its checks
catch what would make an autotune configuration unfit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shatter.tools.bench.kernel_report import Row
from tests.jobs import child_env

REPO = Path(__file__).resolve().parents[2]


def test_checks_flag_spills_shared_memory_and_missing_tensor_cores():
    ok = Row(
        90, "fwd", "sigmoid", "base", "bf16", "M32", 12288, regs=177, spill=0, hmma=104, hgmma=0
    )
    assert ok.problems() == []
    assert Row(**{**ok.__dict__, "spill": 16}).problems() == ["spills 16 bytes"]
    assert Row(**{**ok.__dict__, "hmma": 0}).problems() == ["no tensor-core instruction"]
    too_big = Row(**{**ok.__dict__, "arch": 80, "smem": 200 * 1024})
    assert too_big.problems() == [f"smem {200 * 1024} > {163 * 1024}"]
    # the elementwise sweeps (row statistics, delta) have no dot: no tensor core to expect
    for kernel in ("stats", "delta"):
        assert Row(**{**ok.__dict__, "kernel": kernel, "hmma": 0}).problems() == []
    assert Row(**{**ok.__dict__, "kernel": "dz", "hmma": 0}).problems() != []


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_spills():
    """The CI subset: each kernel's first sm_90 configuration at the base shape in bf16, with the
    partition bias and a length that is not a multiple of 16, for the sigmoid and the softmax;
    the forward and dZ kernels use wgmma (HGMMA), the dV kernel (32 keys a tile, so that all six
    parts' accumulators fit) mma.sync (HMMA)."""
    pytest.importorskip("triton", reason="triton has no wheel for this platform")
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    cmd = [sys.executable, "tools/bench/kernel_report.py", "--arch", "90", "--shape", "base"]
    cmd += ["--dtype", "bf16", "--has-c", "true", "--length", "509", "--first-config"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("sm_90 ")]
    rows = [row for row in rows if len(row) > 12]  # the table, not the summary
    kernels = [tuple(row[1:3]) for row in rows]
    acts = ("sigmoid", "softmax")
    want = [(k, a) for k in ("stats", "fwd", "delta", "dv", "dz") for a in acts]
    assert kernels == [kv for kv in want if kv != ("delta", "softmax")]
    assert all(row[-1] == "ok" for row in rows)
    for row in rows:
        if row[1] in ("fwd", "dz"):
            assert int(row[-2]) > 0, row  # HGMMA
        if row[1] == "dv":
            assert int(row[-3]) > 0, row  # HMMA
