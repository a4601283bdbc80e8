"""Both Triton partition attentions equal the naive reference (lean.partition_mix_naive with
Z0 = Q Xᵀ/√d, and autograd through it): `triton` (cuBLAS GEMMs around the Triton mixing kernels,
Z saved) and `fused` (the same kernels recomputing Q Xᵀ on chip, Z never stored). Values and the
gradients of Q, X, V and c, for 1h-sigmoid (c = None), part-bias/shatter (c) and 1h-softmax, with
padding (a sequence with no real key included) and lengths that are not a multiple of 16, in
fp32, fp16 and bf16.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py; one 16 x 16 configuration; bf16 dots widened to fp32 there, as the
interpreter multiplies bf16 bit patterns: partition_mixing._dot). Every test here is marked `gpu`
as well, so that `make test-gpu` and .ci/gpu/run.sh (`-m gpu`) run the small cases compiled and
the paper's base shape in fp32, fp16 and bf16.
"""

import os

import pytest
import torch

from tests.shatter.kernel_cases import (
    CASES,
    DEVICE,
    INTERPRET,
    TOLERANCE,
    _inputs,
    _reference,
    _rel_err,
    _values_and_grads,
    assert_equals_naive,
    equality_params,
)

pytest.importorskip("triton", reason="triton has no wheel for this platform")

IMPLS = ("triton", "fused")


def _impl(name: str):
    if name == "fused":
        from shatter.kernels.fused_attention import partition_attention_fused

        return partition_attention_fused
    from shatter.attention.triton_kernel import partition_attention_triton

    return partition_attention_triton


@pytest.fixture(scope="module", params=IMPLS)
def kernel(request):
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device")
    return _impl(request.param)


@pytest.mark.gpu  # also a GPU-lane case (`-m gpu`): compiled there
@pytest.mark.parametrize("case, dtype", equality_params(TOLERANCE))
def test_kernel_equals_naive(kernel, case, dtype):
    """fp32 against naive within 1e-5; fp16 and bf16 against naive in fp32 on the same rounded
    inputs within a relative L2 error of 5e-3 and 3e-2 per output and gradient (under the
    interpreter the 16-bit dtypes on kernel_cases.ROUNDED_CASES)."""
    assert_equals_naive(kernel, case, dtype)


@pytest.mark.gpu
def test_kernel_padding_keys_change_nothing(kernel):
    """Values at padded keys must not reach the real tokens' outputs."""
    Q, X, V, c, mask, table = _inputs(1, 21, 32, 4, True, [13], device=DEVICE)
    out, part = kernel(Q, X, V, c, mask, table, sigmoid=True)
    X2, V2 = X.detach().clone(), V.detach().clone()
    X2[:, 13:] += 5.0
    V2[:, :, 13:] -= 3.0
    out2, part2 = kernel(Q, X2, V2, c, mask, table, sigmoid=True)
    torch.testing.assert_close(out2[:, :, :13], out[:, :, :13], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(part2[:, :13], part[:, :13], rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_bad_shapes_are_refused(kernel):
    Q, X, V, c, mask, table = _inputs(1, 8, 32, 4, True, [8], device=DEVICE)
    with pytest.raises(ValueError, match="exceeds the table's max_len"):
        kernel(Q, X, V, c, mask, table[:, 60:-60], sigmoid=True)
    with pytest.raises(ValueError, match="V has shape"):
        kernel(Q, X, V[:, :, :-1], c, mask, table, sigmoid=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize(
    "bias, sigmoid",
    [(False, True), (True, True), (False, False)],
    ids=["1h-sigmoid", "shatter", "1h-softmax"],
)
def test_compiled_kernel_equals_naive_at_base_shape(impl, dtype, bias, sigmoid):
    """d = 768, n = 12 (base), L = 509 (ragged): the compiled kernels against the fp32 naive
    reference evaluated on the same (rounded) inputs, per output and gradient."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would not be compiled")
    if torch.cuda.get_device_capability() < (8, 0) and (impl == "fused" or dtype == torch.bfloat16):
        pytest.skip("below sm_80 only `triton` runs (its dots on FMAs), and in fp16 or fp32")
    inputs = _inputs(2, 509, 768, 12, bias, [509, 300], dtype=dtype, device="cuda")
    got = _values_and_grads(lambda *a: _impl(impl)(*a, sigmoid=sigmoid), *inputs)
    Q, X, V, c, mask, table = inputs
    as32 = [t.detach().float().requires_grad_() if t is not None else None for t in (Q, X, V, c)]
    want = _values_and_grads(lambda *a: _reference(*a, sigmoid=sigmoid), *as32, mask, table)
    for name, a, b in zip(["X_bar", "A_part", "dQ", "dX", "dV", "dc"], got, want):
        assert _rel_err(a, b) < TOLERANCE[dtype], f"{dtype} {name}: {_rel_err(a, b):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, group",
    [("shatter n=8", 2), ("softmax with the part bias, n=12", 2),
     ("1h-sigmoid, one sequence all padding", 1)],
)  # fmt: skip
def test_several_programs_per_side_equal_naive(kernel, case, group, monkeypatch):
    """A side's n/2 parts in groups of GROUP, one program each, give the naive reference's
    values and gradients too: GROUP 2 (sm_80's configurations; 2 and 3 programs a side, sigmoid
    and softmax) and GROUP 1 (any GPU at n = 10 and 14, and sm_90's forward at n = 4 until it
    had a G2 configuration: a program takes one part, and writes no neighbour's)."""
    if not INTERPRET:
        pytest.skip("the compiled kernels tune over their own configurations")
    from shatter.kernels import partition_mixing as pm

    for tuned in (pm.mix_fwd_kernel, pm.mix_bwd_dv_kernel):
        monkeypatch.setattr(tuned, "configs", [pm._cfg(16, 16, 1, 1, group=group)])
        monkeypatch.setattr(tuned, "cache", {})
    B, L, d, n, bias, lengths, sigmoid = CASES[case]
    inputs = _inputs(B, L, d, n, bias, lengths)
    got = _values_and_grads(lambda *a: kernel(*a, sigmoid=sigmoid), *inputs)
    want = _values_and_grads(lambda *a: _reference(*a, sigmoid=sigmoid), *inputs)
    for name, a, b in zip(["X_bar", "A_part", "dQ", "dX", "dV", "dc"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case}: {name} differs")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, dtype",
    [("1h-sigmoid, one sequence all padding", torch.float32),
     ("softmax with the part bias, n=12", torch.float32),
     ("shatter n=8", torch.float16)],
)  # fmt: skip
def test_delta_made_in_the_dz_kernel_equals_naive(case, dtype, monkeypatch):
    """sm_90's and sm_70's backward (family.delta_inside): the dZ kernel makes δ in its
    prologue, with no `delta_kernel` launch; values and gradients still equal naive's (sigmoid
    and softmax, the part bias, a sequence of padding only, fp16)."""
    if not INTERPRET:
        pytest.skip("the compiled kernels take the path of the GPU they run on")
    from shatter.attention import triton_kernel

    monkeypatch.setattr(triton_kernel, "delta_inside", lambda family: True)
    launched = []
    monkeypatch.setattr(triton_kernel, "delta_kernel", _Refused(launched))
    assert_equals_naive(_impl("triton"), case, dtype)
    assert not launched


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, dtype",
    [("1h-sigmoid, one sequence all padding", torch.float32),
     ("softmax with the part bias, n=12", torch.float32),
     ("shatter n=8", torch.float16)],
)  # fmt: skip
def test_z_from_cublas_equals_naive(case, dtype, monkeypatch):
    """sm_70's forward (family.z_inside false): Z = Q Xᵀ/√d from the scores GEMM, then the row
    statistics read it (and with the part bias write z + b back in place); values and gradients
    still equal naive's (sigmoid and softmax, the part bias, a sequence of padding only, fp16)."""
    if not INTERPRET:
        pytest.skip("the compiled kernels take the path of the GPU they run on")
    from shatter.attention import triton_kernel

    monkeypatch.setattr(triton_kernel, "z_inside", lambda family: False)
    made = []
    real = triton_kernel._scores
    monkeypatch.setattr(triton_kernel, "_scores", lambda Q, X: made.append(1) or real(Q, X))
    assert_equals_naive(_impl("triton"), case, dtype)
    assert made


def test_z_made_by_the_statistics_kernel_without_a_scores_gemm(monkeypatch):
    """sm_80+'s forward (the interpreter's default): one `row_stats_kernel` launch a forward
    makes Z's tiles, writes z + b and the statistics, and no scores GEMM runs, for sigmoid scores
    with and without the part bias and for softmax; the backward, which reads that Z, still
    equals naive's gradients (`assert_equals_naive`)."""
    if not INTERPRET:
        pytest.skip("the compiled kernels take the path of the GPU they run on")
    from shatter.attention import triton_kernel

    launched, made = [], []
    real = triton_kernel.row_stats_kernel
    monkeypatch.setattr(triton_kernel, "row_stats_kernel", _Counted(real, launched))
    monkeypatch.setattr(triton_kernel, "_scores", lambda Q, X: made.append(1))
    for k, case in enumerate(
        ["1h-sigmoid, one sequence all padding", "part-bias n=12, d=48", "softmax with the part bias, n=12"]
    ):  # fmt: skip
        assert_equals_naive(_impl("triton"), case, torch.float32)
        assert len(launched) == k + 1
    assert not made


@pytest.mark.gpu  # also a GPU-lane case: there the autotuner really times the kernel first
@pytest.mark.parametrize("case", ["part-bias n=12, d=48", "1h-sigmoid, one sequence all padding"])
def test_saved_scores_hold_the_part_bias(case):
    """The Z that the forward keeps for the backward is eq. 5's argument z + b in the input
    dtype: Q Xᵀ/√d plus b_ij = Σ_h c_ih f_h(j − i) (§3.3) at every pair of real positions (the
    statistics kernel adds b once; no kernel after it makes b again), and Q Xᵀ/√d alone
    without c."""
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device")
    assert_saved_scores(case)


def test_saved_scores_hold_the_bias_once_after_the_autotuners_timing(monkeypatch):
    """On a GPU the autotuner times the statistics kernel before its real run, several runs a
    configuration (Triton 3.6 even with one left), and below sm_80 the kernel adds b into
    cuBLAS's Z in place: each timed run's Z is put back (`restore_value`), so the saved Z holds
    b once. The GPU's timing simulated under the interpreter: two configurations, each run three
    times, on a shape no other test tuned."""
    if not INTERPRET:
        pytest.skip("simulates on the interpreter what a GPU's autotuner does")
    from shatter.attention import triton_kernel
    from shatter.kernels import partition_mixing

    monkeypatch.setattr(triton_kernel, "z_inside", lambda family: False)

    kernel = partition_mixing.row_stats_kernel

    def timing(kernel_call, quantiles):
        for _ in range(3):
            kernel_call()
        return [1.0] * len(quantiles)

    monkeypatch.setattr(kernel, "configs", kernel.configs * 2)
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "_do_bench", timing)
    assert_saved_scores("part-bias n=12, d=48", length=24)


def assert_saved_scores(case: str, length: int | None = None) -> None:
    """mixing_fwd's saved Z equals Q Xᵀ/√d + b (without c: Q Xᵀ/√d) at every real pair."""
    import shatter.attention.triton_kernel  # noqa: F401 (registers shatter::mixing_fwd)
    from shatter.attention.projection import gather_projections

    B, L, d, n, bias, lengths, sigmoid = CASES[case]
    L = length or L
    Q, X, V, c, mask, table = _inputs(B, L, d, n, bias, lengths, device=DEVICE)
    P = gather_projections(Q, V, c)
    _, Z, _ = torch.ops.shatter.mixing_fwd(P.detach(), X.detach(), mask, table, sigmoid)
    want = Q @ X.transpose(-1, -2) / d**0.5
    if c is not None:
        m = table.shape[1] // 2  # table column of j − i = 0
        offsets = (torch.arange(L)[None, :] - torch.arange(L)[:, None] + m).to(table.device)
        want = want + torch.einsum("bih,hij->bij", c, table[:, offsets].to(c))
    assert Z.shape == (B, L, -(-L // 16) * 16)
    torch.testing.assert_close(Z[:, :, :L], want.detach(), rtol=1e-5, atol=1e-5)


class _Counted:
    """A kernel whose launches are recorded, then run."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


class _Refused:
    """A kernel that must not be launched: records the attempt."""

    def __init__(self, launched: list):
        self.launched = launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return lambda *args, **kwargs: None
