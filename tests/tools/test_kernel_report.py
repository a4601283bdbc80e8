"""tools/bench/kernel_report.py compiles the Triton mixing, row and FFN kernels ahead of time (no GPU) and its checks
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
    # a dot kernel whose sweep Triton did not pipeline (no cp.async), where it was read
    assert Row(**{**ok.__dict__, "ldgsts": 0}).problems() == [
        "no cp.async: its sweep is not pipelined (a loop inside it?)"
    ]
    assert Row(**{**ok.__dict__, "ldgsts": 12}).problems() == []


def _report(*args: str) -> list[list[str]]:
    """The table rows of a kernel_report run (not the summary), after checking it passed."""
    pytest.importorskip("triton", reason="triton has no wheel for this platform")
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    cmd = [sys.executable, "tools/bench/kernel_report.py", "--shape", "base", "--dtype", "bf16"]
    cmd += ["--has-c", "true", "--length", "509", "--first-config", *args]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("sm_")]
    rows = [row for row in rows if len(row) > 12]  # the table, not the summary
    assert rows and all(row[-1] == "ok" for row in rows)
    return rows


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_spills():
    """The CI subset: each kernel's first sm_90 configuration at the base shape in bf16, with the
    partition bias and a length that is not a multiple of 16, for the sigmoid and the softmax,
    reading Z (the hybrid impl), recomputing Q Xᵀ (the fused impl) and making Z (the hybrid's
    statistics: no Z-reading statistics on sm_90), and the FFN's GEMMs with GELU in their
    epilogues; the statistics, forward, dZ and FFN kernels use wgmma (HGMMA), the dV kernel
    reading Z (32 keys a tile, so that all six parts' accumulators fit) mma.sync (HMMA)."""
    rows = _report("--arch", "90")
    kernels = [tuple(row[1:3]) for row in rows]
    acts = ("sigmoid", "softmax")
    want = [(f"{k}/{s}", a) for k in ("fwd", "dv", "dz") for s in ("z", "qx") for a in acts]
    want += [(f"stats/{s}", a) for s in ("qx", "make") for a in acts]
    want.append(("delta/z", "sigmoid"))  # no scores, no activation: once
    want += [("ffn_fwd/-", "-"), ("ffn_bwd/-", "-")]  # the FFN: its shape and dtype alone
    assert sorted(kernels) == sorted(want)
    for row in rows:
        if (
            row[1].split("/")[0] in ("fwd", "dz", "stats", "ffn_fwd", "ffn_bwd")
            or row[1] == "dv/qx"
        ):
            assert int(row[-2]) > 0, row  # HGMMA
        if row[1] == "dv/z":
            assert int(row[-3]) > 0, row  # HMMA


@pytest.mark.slow
def test_the_v100_kernels_compile_for_sm70_without_spills():
    """What `auto` runs on a V100 (sm_70, fp16), with the partition bias, at a ragged length: the
    `rows` impl's row kernels (also at the longest row a program holds) and the hybrid's mixing
    kernels reading Z with FMA dots (no recomputing variant, no tensor-core instruction
    expected): registers reported, 0 spill bytes."""
    pytest.importorskip("triton", reason="triton has no wheel for this platform")
    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    cmd = [sys.executable, "tools/bench/kernel_report.py", "--arch", "70", "--shape", "base"]
    cmd += ["--dtype", "fp16", "--has-c", "true", "--activation", "sigmoid"]
    cmd += ["--length", "509,4096", "--jobs", "2"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line.startswith("sm_70 ")]
    rows = [row for row in rows if len(row) > 12]  # the table, not the summary
    kernels = ("stats", "fwd", "delta", "dv", "dz", "rows_fwd", "rows_bwd")
    assert [(row[1], row[6]) for row in rows] == [
        (f"{kernel}/z", length) for kernel in kernels for length in ("509", "4096")
    ]
    for row in rows:
        assert row[-1] == "ok" and row[-5] == "0" and 0 < int(row[-6]) <= 255, row  # spill, regs


@pytest.mark.slow
def test_fused_kernels_compile_for_sm80_with_mma():
    """The fused impl's kernels (Q Xᵀ recomputed) and the FFN's on sm_80: no spills, mma.sync
    (HMMA) in every kernel with a dot, the row statistics' Q Xᵀ included."""
    rows = _report("--arch", "80", "--source", "qx", "--activation", "sigmoid")
    kernels = ["stats/qx", "fwd/qx", "delta/z", "dv/qx", "dz/qx", "ffn_fwd/-", "ffn_bwd/-"]
    assert [row[1] for row in rows] == kernels
    assert all(int(row[-3]) > 0 for row in rows if row[1] != "delta/z")  # HMMA
