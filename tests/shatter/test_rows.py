"""`attention_impl: rows` (cuBLAS GEMMs around two Triton row kernels, for GPUs below sm_80) equals
the naive reference (lean.partition_mix_naive with Z0 = Q Xᵀ/√d, autograd through it) in values
and the gradients of Q, X, V and c: for 1h-sigmoid, part-bias/shatter and 1h-softmax, lengths that
are not a multiple of 16, padded keys (a sequence of padding only included), in fp32 and fp16,
with W recomputed (`rows`) and kept (`rows-keep`). In fp16, dW_h = dX̄[h] V[h]ᵀ and the gradients
(which carry dA) stay finite under loss scales up to 2^16.

Without a GPU the row kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
tests/conftest.py); the `gpu` marks run the same cases compiled in the GPU lane.
"""

import pytest
import torch

from shatter.kernels.cost import OP_COSTS, rows_kernels
from tests.shatter.kernel_cases import (
    CASES,
    DEVICE,
    INTERPRET,
    _inputs,
    _reference,
    _rel_err,
    _values_and_grads as values_and_grads,
    assert_equals_naive,
    equality_params,
)

pytest.importorskip("triton", reason="triton has no wheel for this platform")
NAMES = ["X_bar", "A_part", "dQ", "dX", "dV", "dc"]
NO_KERNEL = {  # ops that allocate without a fill or only view: no launch
    "aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided", "aten::detach",
    "aten::_unsafe_view", "prim::device",
}  # fmt: skip


@pytest.fixture(scope="module")
def rows():
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device")
    from shatter.attention import rows

    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("case, dtype", equality_params([torch.float32, torch.float16]))
def test_rows_equals_naive(rows, case, dtype):
    """fp32 against naive within 1e-5; fp16 against naive in fp32 on the same rounded inputs
    within a relative L2 error of 5e-3 per output and gradient (test_triton_kernel's check; under
    the interpreter fp16 on kernel_cases.ROUNDED_CASES)."""
    assert_equals_naive(rows.partition_attention_rows, case, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [False, True], ids=["rows", "rows-keep"])
def test_part_gemms_batched_over_the_sequences_equal_naive(rows, keep):
    """With more sequences than parts (B = 5, n = 4) the part GEMMs run one a part, batched over
    the sequences (rows.batches; CASES have B < n: one a sequence): values and gradients."""
    assert len(rows.batches(5, 4)) == 4 and len(rows.batches(3, 4)) == 3
    inputs = _inputs(5, 18, 32, 4, True, [18, 13, 0, 18, 7], device=DEVICE)
    got = values_and_grads(lambda *a: rows.partition_attention_rows(*a, sigmoid=True, keep=keep), *inputs)  # fmt: skip
    want = values_and_grads(lambda *a: _reference(*a, sigmoid=True), *inputs)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_expanded_output_gradients_are_read_right(rows):
    """A loss such as out.sum() + part.sum() hands the backward expanded gradients (strides 0):
    the gradients still equal the reference's."""
    inputs = _inputs(1, 18, 64, 8, True, [13], device=DEVICE)
    leaves = [t for t in inputs[:4] if t is not None]
    grads = []
    for fn in (rows.partition_attention_rows, _reference):
        out, part = fn(*inputs, sigmoid=True)
        grads.append(torch.autograd.grad(out.sum() + part.sum(), leaves))
    for name, a, b in zip(NAMES[2:], *grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["shatter n=8", "1h-softmax, one sequence all padding"])
def test_kept_weights_give_the_recomputed_results_and_are_saved(rows, case):
    """rows-keep saves W [B, n, L, Lp] for the backward, rows saves no n x l x l tensor; both
    give the same values and gradients."""
    B, L, d, n, bias, lengths, sigmoid = CASES[case]
    inputs = _inputs(B, L, d, n, bias, lengths, device=DEVICE)
    results, saved = {}, {}
    for keep in (False, True):
        largest = []

        def pack(t, largest=largest):
            largest.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn = lambda *a, keep=keep: rows.partition_attention_rows(*a, sigmoid=sigmoid, keep=keep)  # noqa: E731
            results[keep] = values_and_grads(fn, *inputs)
        saved[keep] = max(largest)
    for name, a, b in zip(NAMES, results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    Lp = -(-L // 16) * 16
    assert saved[True] == B * n * L * Lp  # W
    assert saved[False] < B * n * L * Lp  # Z [B, L, Lp] and the projections at most


@pytest.mark.gpu
def test_fp16_gradients_stay_finite_under_loss_scaling(rows, monkeypatch):
    """The base width (d = 768, n = 12; ragged l = 21 with padding), dX̄ as a mean loss over the
    tokens gives it, times a loss scale of 1, 2^8 and 2^16 (one forward, a backward each): dW_h
    (recorded) and every gradient (dQ, dX come from dZ, which carries dA) are finite, and the
    gradients, unscaled, track the fp32 reference."""
    B, L = 2, 21  # rows kernel programs: B x L a launch (seconds each under the interpreter)
    inputs = _inputs(B, L, 768, 12, True, [L, 13], dtype=torch.float16, device=DEVICE)
    seen = []
    grads_of = rows.part_grads

    def recorded(*args, **kwargs):
        seen.append(grads_of(*args, **kwargs).clone())
        return seen[-1]

    monkeypatch.setattr(rows, "part_grads", recorded)
    Q, X, V, c, mask, table = inputs
    out, part = rows.partition_attention_rows(Q, X, V, c, mask, table, sigmoid=True)
    g = torch.Generator().manual_seed(1)
    g_out = torch.randn(out.shape, generator=g) / (B * L)  # d(mean loss)/dX̄ scale
    leaves = [Q, X, V, c]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_out, _ = _reference(*ref_leaves, mask, table)
    want = torch.autograd.grad(ref_out, ref_leaves, g_out.to(ref_out))
    for loss_scale in (1.0, 2.0**8, 2.0**16):
        got = torch.autograd.grad(out, leaves, (g_out * loss_scale).to(out), retain_graph=True)
        assert len(seen) == 1 and torch.isfinite(seen.pop()[..., :L]).all(), f"dW at {loss_scale}"
        for name, a, b in zip(["dQ", "dX", "dV", "dc"], got, want):
            assert torch.isfinite(a).all(), f"{name} at loss scale {loss_scale}"
            err = _rel_err(a.float() / loss_scale, b)
            assert err < 1e-2, f"{name} at loss scale {loss_scale}: {err:.2e}"


@pytest.mark.parametrize("B", [4, 16], ids=["a GEMM a sequence", "a GEMM a part"])
def test_the_costs_price_each_row_kernel_as_traced(rows, B):
    """On fake tensors (no kernel runs): one layer's forward and backward launch exactly the
    kernels shatter.kernels.cost.rows_kernels lists (cuBLAS GEMMs and the two row ops, plus dc's
    copy and the zeroed alignment columns of dP), and OP_COSTS prices each row op by its bytes."""
    from collections import Counter

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from shatter.attention.projection import projection_width
    from shatter.partition import partition_table

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.costs = Counter(), {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket._qualified_op_name)
            if not func.is_view and name not in NO_KERNEL:
                self.ops[name] += 1
            if name in OP_COSTS:
                self.costs.setdefault(name, []).append(OP_COSTS[name](args, kwargs or {}, out))
            return out

    L, d, n = 256, 768, 12
    table = partition_table(n, 1, 3, max_len=L)
    with FakeTensorMode(allow_non_fake_inputs=True):
        P = torch.empty(B, L, projection_width(d, n), dtype=torch.float16, requires_grad=True)
        X = torch.empty(B, L, d, dtype=torch.float16, requires_grad=True)
        mask = torch.ones(B, L, dtype=torch.bool)
        with Launches() as trace:
            out, part = rows.RowsAttention.apply(P, X, mask, table, True, False)
            torch.autograd.backward((out, part), (torch.empty_like(out), torch.empty_like(part)))
    listed = rows_kernels(B, L, d, n)
    gemms = sum(k.kind == "gemm" for k in listed)
    assert trace.ops["aten::baddbmm"] + trace.ops["aten::bmm"] == gemms == 3 * min(B, n) + 3
    assert trace.ops["shatter::rows_fwd"] == 2 and trace.ops["shatter::rows_bwd"] == 1
    assert sum(trace.ops.values()) == len(listed) == 3 * min(B, n) + 8, trace.ops
    by_name = {k.name: k for k in listed}
    fwd, bwd = by_name["rows_fwd: W, A_part"], by_name["rows_bwd: dA, δ, dZ, dc"]
    assert trace.costs["shatter::rows_fwd"] == [[fwd]] * 2
    assert trace.costs["shatter::rows_bwd"] == [[bwd]]
    assert fwd.bytes == (1 + n) * B * L * L * 2 and fwd.kind == bwd.kind == "memory"
    assert len(rows_kernels(B, L, d, n, keep=True)) == len(listed) - 1  # no W again
