"""The partition of unity (appendix): its properties, and its values against a direct float64
evaluation of the appendix formula at chosen points."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shatter
from shatter.partition import partition_mask, partition_of_unity, partition_params, partition_table
from tests.jobs import child_env

REPO = Path(__file__).resolve().parents[2]
CASES = [(4, 0, 2), (4, 1, 2), (12, 0, 12), (12, 5, 12), (12, 11, 12), (16, 23, 24)]


@pytest.mark.parametrize("n,k,L", CASES)
def test_partition_of_unity_properties(n, k, L):
    x = torch.arange(-3000, 3001)
    f = partition_of_unity(x, n, k, L, dtype=torch.float64)
    assert f.shape == (n, x.numel())
    assert (f >= 0).all()
    torch.testing.assert_close(
        f.sum(0), torch.ones_like(x, dtype=torch.float64), rtol=0, atol=1e-12
    )
    half = n // 2
    # the first half covers x > 0, the second half x < 0, mirrored
    assert (f[:half, x < 0] == 0).all() and (f[half:, x > 0] == 0).all()
    torch.testing.assert_close(f[half:], f[:half].flip(-1), rtol=0, atol=0)
    # x = 0 is split evenly between f_0 and f_{n/2}
    zero = f[:, x == 0].squeeze(-1)
    expected = torch.zeros(n, dtype=torch.float64)
    expected[0] = expected[half] = 0.5
    torch.testing.assert_close(zero, expected)
    # each f_nu, nu > 0, peaks farther from 0 than the one before it (parts cover the axis in order)
    peaks = [int(x[f[h].argmax()]) for h in range(half)]
    assert peaks == sorted(peaks) and len(set(peaks[1:])) == half - 1


def _appendix_f(h: int, x: int, n: int, k: int, L: int) -> float:
    """The appendix written out with Python floats (float64), x != 0."""
    D = n // 2 - 1
    alpha = -(k + 1) / L * D
    beta = -(1 / D) * (D / 12) ** ((k + 1) / L)
    side, nu = (1, h) if h < n // 2 else (-1, h - n // 2)
    if side * x <= 0:
        return 0.0
    ax = abs(x)
    u = math.log(math.exp(beta * ax) * (1 - math.exp(alpha)) + math.exp(alpha)) / alpha
    return math.comb(D, nu) * u**nu * (1 - u) ** (D - nu)


@pytest.mark.parametrize("n,k,L", CASES)
def test_partition_matches_appendix_formula(n, k, L):
    points = [-500, -37, -12, -5, -1, 1, 2, 3, 7, 12, 25, 60, 128, 1000]
    f = partition_of_unity(torch.tensor(points), n, k, L, dtype=torch.float64)
    for col, x in enumerate(points):
        for h in range(n):
            assert f[h, col].item() == pytest.approx(
                _appendix_f(h, x, n, k, L), rel=1e-12, abs=1e-15
            )


def test_partition_params_first_and_last_layer():
    D, alpha, beta = partition_params(12, 11, 12)  # last layer: beta = -1/12, parts ~12 apart
    assert (D, alpha, beta) == (5, -5.0, pytest.approx(-1 / 12))
    D, alpha, beta = partition_params(12, 0, 12)
    assert alpha == pytest.approx(-5 / 12) and beta == pytest.approx(
        -(1 / 5) * (5 / 12) ** (1 / 12)
    )


def test_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        partition_of_unity(torch.arange(3), 6 - 1, 0, 2)
    with pytest.raises(ValueError, match="even"):
        partition_of_unity(torch.arange(3), 2, 0, 2)
    with pytest.raises(ValueError, match="layer"):
        partition_of_unity(torch.arange(3), 4, 2, 2)
    with pytest.raises(TypeError, match="integer"):
        partition_of_unity(torch.zeros(3), 4, 0, 2)


def test_partition_mask_is_indexed_by_relative_position():
    table = partition_table(6, 1, 3, max_len=20)
    N = partition_mask(table, 9)
    i, j = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    direct = partition_of_unity(j - i, 6, 1, 3)
    torch.testing.assert_close(N, direct)
    with pytest.raises(ValueError, match="max_len"):
        partition_mask(table, 21)


@pytest.mark.slow
def test_plot_partition(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from shatter.partition import plot_partition

    ax = plot_partition(4, 0, 2, span=10)
    assert len(ax.lines) == 5  # f_0..f_3 and their sum
    assert ax.lines[-1].get_ydata() == pytest.approx([1.0] * 21)
    ax.figure.savefig(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow
def test_table_stays_fp32_under_a_bf16_deepspeed_engine():
    """A bf16 engine that casts buffers (data_types.buffer_dtype) rounds the non-persistent table
    (a bf16 partition misses 1 by ~2e-3); every impl must still be handed the exact fp32 table
    (the engine's own `module.to(device)` after its cast may already have made it exact)."""
    script = Path(__file__).with_name("deepspeed_partition.py")
    env = child_env()
    res = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    for impl in ("chunked", "lean", "naive"):
        calls, dtype, err = lines[impl].split()
        assert int(calls) == 2 and dtype == "torch.float32", lines[impl]
        assert float(err) < 1e-6, lines[impl]


def cast_tables(model, dtype):
    """Every partition table cast as DeepSpeed's buffer_dtype casts buffers (`.data`), which
    the module does not see."""
    for layer in model.encoder.layers:
        layer.attention.partition.data = layer.attention.partition.data.to(dtype)


def test_a_compiled_first_step_after_a_cast_rebuilds_the_table_without_a_dynamo_warning():
    """A bf16 engine casts the model before its first compiled step: the table is rebuilt in
    fp32 outside Dynamo's graph (which would trace its functools cache and warn the user)."""
    import warnings

    torch._dynamo.reset()  # a first compile: no frame left compiled by another test
    model = shatter.build_model("shatter-tiny", vocab_size=50, max_len=16)
    cast_tables(model, torch.bfloat16)
    x = torch.randint(0, 50, (2, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(x)
    assert not [w.message for w in caught if "Dynamo" in str(w.message)]
    assert model.encoder.layers[0].attention.partition.dtype == torch.float32


@pytest.mark.parametrize("arch", ["part-mask", "shatter"])
def test_a_module_wide_half_keeps_the_table_exact(arch):
    model = shatter.build_model(f"{arch}-tiny", vocab_size=50, max_len=16).half()
    table = model.encoder.layers[0].attention.partition
    assert table.dtype == torch.float32
    assert (table.double().sum(0) - 1).abs().max() < 1e-6


@pytest.mark.parametrize("arch", ["part-mask", "shatter"])
def test_table_is_rebuilt_after_a_cast_the_module_did_not_see(arch):
    model = shatter.build_model(f"{arch}-tiny", vocab_size=50, max_len=16)
    cast_tables(model, torch.float16)
    attention = model.encoder.layers[0].attention
    assert attention.partition.dtype == torch.float16
    table = attention.exact_partition()
    assert table.dtype == torch.float32 and attention.partition is table
    assert (table.double().sum(0) - 1).abs().max() < 1e-6
