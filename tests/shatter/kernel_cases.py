"""The Triton attentions' equality cases and helpers, shared by tests/shatter/test_triton_kernel.py
(`triton`, `fused`) and tests/shatter/test_rows.py (`rows`): inputs, the naive reference (lean.
partition_mix_naive on Z0 = Q Xᵀ/√d, autograd through it), values and gradients, tolerances."""

import math
import os

import pytest
import torch

from shatter.attention.lean import partition_mix_naive
from shatter.partition import partition_table

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py sets it without a GPU
DEVICE = "cpu" if INTERPRET else "cuda"


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

# Under the interpreter (CPU seconds a case) fp32 takes every case and the 16-bit dtypes two each:
# between them sigmoid and softmax, with and without the part bias, and a sequence of padding only
# in each dtype (the dtype changes the loads', stores' and dots' types, not the branches a case
# takes). Compiled (the GPU lane), every case in every dtype.
ROUNDED_CASES = {
    torch.float16: ("1h-sigmoid, one sequence all padding", "softmax with the part bias, n=12"),
    torch.bfloat16: ("1h-softmax, one sequence all padding", "shatter n=8"),
}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def equality_params(dtypes) -> list:
    """The (case, dtype) parameters of the equality tests in `dtypes`, ids "case-fp16"."""
    return [
        pytest.param(case, dtype, id=f"{case}-{DTYPE_IDS[dtype]}")
        for dtype in dtypes
        for case in CASES
        if not INTERPRET or dtype == torch.float32 or case in ROUNDED_CASES[dtype]
    ]


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
