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

import math
import os

import pytest
import torch

from shatter.attention.lean import partition_mix_naive
from shatter.partition import partition_table

pytest.importorskip("triton", reason="triton has no wheel for this platform")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it without a GPU
DEVICE = "cpu" if INTERPRET else "cuda"


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


def _inputs(B, L, d, n, bias, lengths, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    new = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    Q, X = new(B, L, d), new(B, L, d)
    V = new(B, L, d).view(B, L, n, d // n).transpose(1, 2)  # [B, n, L, d/n] as single_head.py
    c = new(B, L, n) if bias else None
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    table = partition_table(n, 1, 3, max_len=max(64, L), device=device)
    return Q, X, V, c, mask, table


def _reference(Q, X, V, c, mask, table, sigmoid=True):
    Z0 = Q @ X.transpose(-1, -2) / math.sqrt(Q.shape[-1])
    return partition_mix_naive(Z0, c, V, mask, table, sigmoid)


def _values_and_grads(fn, Q, X, V, c, mask, table):
    out, part = fn(Q, X, V, c, mask, table)
    g = torch.Generator().manual_seed(1)
    g_out = torch.randn(out.shape, generator=g).to(out)
    g_part = torch.randn(part.shape, generator=g).to(part)
    leaves = [t for t in (Q, X, V, c) if t is not None]
    grads = torch.autograd.grad((out * g_out).sum() + (part * g_part).sum(), leaves)
    return [out, part, *grads]


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative L2 error
CASES = {  # B, L, d, n, bias, key lengths, sigmoid: L not a multiple of the 16-wide block
    "1h-sigmoid, one sequence all padding": (3, 20, 32, 4, False, [20, 13, 0], True),
    "part-bias n=12, d=48": (1, 20, 48, 12, True, [14], True),
    "shatter n=8": (1, 18, 64, 8, True, [18], True),
    "shatter n=16, d/n=4": (1, 17, 64, 16, True, [11], True),
    "1h-softmax, one sequence all padding": (3, 20, 32, 4, False, [20, 13, 0], False),
    "softmax with the part bias, n=12": (1, 20, 48, 12, True, [14], False),
}


@pytest.mark.gpu  # also a GPU-lane case (`-m gpu`): compiled there
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_naive(kernel, case, dtype):
    """fp32 against naive within 1e-5; fp16 and bf16 against naive in fp32 on the same rounded
    inputs within a relative L2 error of 5e-3 and 3e-2 per output and gradient."""
    assert_equals_naive(kernel, case, dtype)


def assert_equals_naive(impl, case: str, dtype: torch.dtype) -> None:
    """`impl` (the impls' common signature) on CASES[case] in `dtype` against the naive
    reference: values and gradients (see test_kernel_equals_naive)."""
    B, L, d, n, bias, lengths, sigmoid = CASES[case]
    inputs = _inputs(B, L, d, n, bias, lengths, dtype=dtype, device=DEVICE)
    got = _values_and_grads(lambda *a: impl(*a, sigmoid=sigmoid), *inputs)
    if dtype != torch.float32:
        leaves = [
            t.detach().float().requires_grad_() if t is not None else None for t in inputs[:4]
        ]
        inputs = (*leaves, *inputs[4:])
    want = _values_and_grads(lambda *a: _reference(*a, sigmoid=sigmoid), *inputs)
    names = ["X_bar", "A_part", "dQ", "dX", "dV", "dc"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == dtype, f"{case}: {name} is {a.dtype}"
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case}: {name} differs")
        else:
            assert _rel_err(a, b) < TOLERANCE[dtype], f"{case} {name}: {_rel_err(a, b):.2e}"


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
    inputs = _inputs(2, 509, 768, 12, bias, [509, 300], dtype=dtype, device="cuda")
    got = _values_and_grads(lambda *a: _impl(impl)(*a, sigmoid=sigmoid), *inputs)
    Q, X, V, c, mask, table = inputs
    as32 = [t.detach().float().requires_grad_() if t is not None else None for t in (Q, X, V, c)]
    want = _values_and_grads(lambda *a: _reference(*a, sigmoid=sigmoid), *as32, mask, table)
    for name, a, b in zip(["X_bar", "A_part", "dQ", "dX", "dV", "dc"], got, want):
        assert _rel_err(a, b) < TOLERANCE[dtype], f"{dtype} {name}: {_rel_err(a, b):.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if "n=" in c])
def test_two_programs_per_side_equal_naive(kernel, case, monkeypatch):
    """GROUP = 2 (sm_80's configurations: a side's n/2 parts in groups of 2, one program each)
    gives the naive reference's values and gradients too."""
    if not INTERPRET:
        pytest.skip("the compiled kernels tune over their own configurations")
    from shatter.kernels import partition_mixing as pm

    for tuned in (pm.mix_fwd_kernel, pm.mix_bwd_dv_kernel):
        monkeypatch.setattr(tuned, "configs", [pm._cfg(16, 16, 1, 1, group=2)])
        monkeypatch.setattr(tuned, "cache", {})
    B, L, d, n, bias, lengths, sigmoid = CASES[case]
    inputs = _inputs(B, L, d, n, bias, lengths)
    got = _values_and_grads(lambda *a: kernel(*a, sigmoid=sigmoid), *inputs)
    want = _values_and_grads(lambda *a: _reference(*a, sigmoid=sigmoid), *inputs)
    for name, a, b in zip(["X_bar", "A_part", "dQ", "dX", "dV", "dc"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{case}: {name} differs")
