"""config.ffn_impl: the FFN with GELU in its GEMMs' epilogues (shatter/kernels/gelu_linear.py,
`triton`) equals nn.Linear, F.gelu, nn.Linear (`torch`) in values and every gradient: the custom
ops against the eager ops they replace, the FFN, and whole models of both kinds of arch, eager
and compiled. Without a GPU the kernels run Triton's interpreter (tests/conftest.py)."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shatter.config import ModelConfig
from shatter.ffn import feed_forward, ffn_choice
from tests.shatter.shatter_tiny import ids, tiny

pytest.importorskip("triton", reason="triton has no wheel for this platform")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device", allow_module_level=True)

from shatter.kernels import gelu_linear  # noqa: E402
from shatter.kernels.cost import FFN_ROW_TILE, OP_COSTS, op_totals  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the kernels' fp32 dots against the CPU's (summation order only); bf16 and fp16: a unit
# or two in the last place of the rounded outputs
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


def _new(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("M,K,N", [(37, 24, 40), (64, 32, 48), (5, 16, 16)])
def test_ops_equal_the_eager_ops_they_replace(M, K, N, dtype):
    """linear_gelu = (addmm, gelu); linear_gelu_bwd = (mm, gelu_backward, and the sums over the
    rows of dh and of the gradient), with M, K and N off the interpreter's 16-wide tiles and the
    gradient in a strided view."""
    x, w, b = _new(M, K, dtype=dtype), _new(N, K, dtype=dtype, scale=0.3), _new(N, dtype=dtype)
    h, g = torch.ops.shatter.linear_gelu(x, w, b)
    want_h = F.linear(x, w, b)
    torch.testing.assert_close(h, want_h, **TOL[dtype])
    torch.testing.assert_close(g, F.gelu(want_h), **TOL[dtype])
    w_out = _new(K, N, dtype=dtype, scale=0.3)
    dy = _new(M, 2 * K, dtype=dtype)[:, ::2]  # every other column: a strided gradient
    dh, sums = torch.ops.shatter.linear_gelu_bwd(dy, w_out, want_h)
    db, db_out = sums.split([N, K])
    want_dh = torch.ops.aten.gelu_backward(dy @ w_out, want_h)
    torch.testing.assert_close(dh, want_dh, **TOL[dtype])
    # the bias gradient sums the kernel's own rounded dh (a low-precision dh may be off by a unit
    # in the last place, and its sum over the rows cancels to small values)
    torch.testing.assert_close(db, dh.float().sum(0).to(dtype), **TOL[dtype])
    torch.testing.assert_close(db_out, dy.float().sum(0).to(dtype), **TOL[dtype])
    assert dh.dtype == db.dtype == db_out.dtype == dtype
    assert db.shape == (N,) and db_out.shape == (K,)


def test_without_a_backward_h_is_not_written():
    """Evaluation and inference (no input needs a gradient): GELU(h) alone is written (h comes
    back empty, its bytes out of the op's cost), the same values."""
    x, w, b = _new(20, 16, dtype=torch.float32), _new(32, 16, dtype=torch.float32), _new(32, dtype=torch.float32)  # fmt: skip
    h, g = torch.ops.shatter.linear_gelu(x, w, b, False)
    assert h.shape == (20, 0)
    torch.testing.assert_close(g, F.gelu(F.linear(x, w, b)), **TOL[torch.float32])
    costs = [op_totals(OP_COSTS["shatter::linear_gelu"]((x, w, b, k), {}, None))[1] for k in (True, False)]  # fmt: skip
    assert costs[0] - costs[1] == 20 * 32 * 4
    layers = torch.nn.Linear(16, 32).to(DEVICE), torch.nn.Linear(32, 16).to(DEVICE)
    with _Record() as record, torch.no_grad():
        y = feed_forward(x.to(DEVICE), *layers, "triton")
    torch.testing.assert_close(
        y, feed_forward(x.to(DEVICE), *layers, "torch"), **TOL[torch.float32]
    )
    assert record.shapes["linear_gelu"] == [(20, 0), (20, 32)]  # h not written


def test_ops_pass_torch_s_op_checks():
    x, w, b = _new(20, 16, dtype=torch.float32), _new(32, 16, dtype=torch.float32), _new(32, dtype=torch.float32)  # fmt: skip
    torch.library.opcheck(torch.ops.shatter.linear_gelu.default, (x, w, b))
    dy, w_out = _new(20, 16, dtype=torch.float32), _new(16, 32, dtype=torch.float32)
    h = F.linear(x, w, b)
    torch.library.opcheck(torch.ops.shatter.linear_gelu_bwd.default, (dy, w_out, h))


def _ffn(impl, dtype, frozen=False):
    torch.manual_seed(0)
    ffn_in, ffn_out = torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)
    ffn_in, ffn_out = ffn_in.to(DEVICE, dtype), ffn_out.to(DEVICE, dtype)
    for p in (*ffn_in.parameters(), *ffn_out.parameters()):
        p.requires_grad_(not frozen)
    x = _new(3, 7, 24, dtype=dtype).requires_grad_()
    y = feed_forward(x, ffn_in, ffn_out, impl)
    y.backward(_new(*y.shape, dtype=dtype, seed=1))
    grads = [x.grad] + [p.grad for p in (*ffn_in.parameters(), *ffn_out.parameters())]
    return y, grads


@pytest.mark.parametrize("dtype", list(TOL))
def test_feed_forward_equals_torch_s_in_values_and_every_gradient(dtype):
    (got, got_g), (want, want_g) = _ffn("triton", dtype), _ffn("torch", dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])
    rtol, atol = TOL[dtype]["rtol"], TOL[dtype]["atol"]
    for name, g, w in zip(("x", "W_in", "b_in", "W_out", "b_out"), got_g, want_g):
        # sums over the tokens of values a unit in the last place apart: atol at their scale
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * w.abs().max(), msg=name)


class _Record(TorchDispatchMode):
    """The ATen and custom ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.ops, self.shapes = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple) else (out,)
        self.shapes[self.ops[-1]] = [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]
        return out


def test_a_frozen_ffn_makes_only_the_input_s_gradient():
    """With the weights frozen the backward runs the fused kernel and one GEMM for dx, and makes
    no weight gradient nor a sum of its own (seen failing without `needs_input_grad`)."""
    with _Record() as record:
        _, grads = _ffn("triton", torch.float32, frozen=True)
    _, want = _ffn("torch", torch.float32)
    assert grads[1:] == [None] * 4
    torch.testing.assert_close(grads[0], want[0], **TOL[torch.float32])
    backward = record.ops[record.ops.index("addmm") + 1 :]  # after the forward's output GEMM
    gemms = [op for op in backward if op in ("mm", "addmm", "bmm", "matmul")]
    assert "linear_gelu_bwd" in backward and gemms == ["mm"] and "sum" not in backward


@pytest.mark.parametrize("arch", ["bert", "shatter"])
def test_models_train_the_same_with_either_impl(arch):
    """A model of either kind (multi-head, single-head) with ffn_impl triton and torch: the same
    loss and every parameter's gradient, under the same state dict."""
    x = ids(2, 12)
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    labels = torch.where(x % 3 == 0, x, -100)
    results = []
    for impl in ("triton", "torch"):
        model = tiny(arch, ffn_impl=impl, dropout=0.0, attention_dropout=0.0).to(DEVICE)
        out = model(x.to(DEVICE), mask.to(DEVICE), labels.to(DEVICE))
        out["loss"].backward()
        results.append((out["loss"], {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (want_loss, want_grads) = results
    torch.testing.assert_close(loss, want_loss, **TOL[torch.float32])
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], **TOL[torch.float32], msg=name)


def test_a_compiled_model_runs_the_ops():
    """torch.compile (aot_eager on the CPU: Dynamo and AOTAutograd trace through the ops' fake
    impls, the graph runs the real ops) gives the eager model's loss and gradients."""
    x = ids(2, 8).to(DEVICE)
    labels = torch.where(x % 3 == 0, x, -100)
    results = []
    for compiled in (True, False):
        model = tiny("bert", ffn_impl="triton", dropout=0.0, attention_dropout=0.0).to(DEVICE)
        if compiled:
            model.compile(backend="aot_eager" if DEVICE == "cpu" else "inductor", fullgraph=False)
        loss = model(x, None, labels)["loss"]
        loss.backward()
        results.append((loss, model.encoder.layers[0].ffn_in.weight.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_auto_takes_the_epilogues_on_tensor_core_gpus_in_half_precision():
    assert ffn_choice((9, 0), torch.bfloat16) == ffn_choice((8, 0), torch.float16) == "triton"
    assert ffn_choice((7, 0), torch.float16) == "torch"  # no tensor-core dots below sm_80
    assert ffn_choice((9, 0), torch.float32) == "torch"  # fp32: cuBLAS (TF32 as torch says)
    assert ModelConfig(arch="bert").ffn_impl == "auto"
    with pytest.raises(ValueError, match="unknown ffn_impl 'cublas'"):
        ModelConfig(arch="bert", ffn_impl="cublas")


def test_costs_count_one_gemm_and_the_epilogue_s_bytes():
    """The ops' costs: the GEMM's FLOPs, and bytes with h and GELU(h) written once (forward), h
    read and dh written once plus the column sums (backward): no extra [M, N] pass."""
    M, K, N, e = 4096, 768, 3072, 2
    x, w = torch.empty(M, K, dtype=torch.bfloat16), torch.empty(N, K, dtype=torch.bfloat16)
    flops, nbytes = op_totals(OP_COSTS["shatter::linear_gelu"]((x, w, torch.empty(N)), {}, None))
    assert flops == 2 * M * N * K
    assert nbytes == (M * K + N * K + N + 2 * M * N) * e
    dy, w_out, h = torch.empty(M, K, dtype=torch.bfloat16), torch.empty(K, N, dtype=torch.bfloat16), torch.empty(M, N, dtype=torch.bfloat16)  # fmt: skip
    flops, nbytes = op_totals(OP_COSTS["shatter::linear_gelu_bwd"]((dy, w_out, h), {}, None))
    sums = M // FFN_ROW_TILE * (N + K) * 4  # dh's and dy's column sums: no pass over dy of its own
    assert flops == 2 * M * N * K
    assert nbytes == (M * K + K * N + 2 * M * N) * e + 2 * sums + (N + K) * e
    assert FFN_ROW_TILE == max(c.kwargs["BLOCK_M"] for c in gelu_linear.CONFIGS)
    assert {c.kwargs["BLOCK_M"] for c in gelu_linear.CONFIGS} == {FFN_ROW_TILE}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compiled_kernels_equal_fp32_at_base_shape(dtype):
    """d = 768, 4d = 3072, 4,090 tokens (a ragged last row tile), on a GPU (sm_80+), the compiled
    kernels' outputs and every gradient against the same FFN in fp32 on the same (rounded)
    inputs, relative to each tensor's scale."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs a CUDA device of compute capability >= 8.0")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would not be compiled")
    torch.manual_seed(0)
    ffn_in, ffn_out = torch.nn.Linear(768, 3072).cuda(), torch.nn.Linear(3072, 768).cuda()
    x, dy = torch.randn(2, 2045, 768, device="cuda"), torch.randn(2, 2045, 768, device="cuda")
    results = []
    for impl, kind in (("triton", dtype), ("torch", torch.float32)):
        layers = [m.to(kind) for m in (ffn_in, ffn_out)]
        xi = x.to(dtype).to(kind).requires_grad_()
        y = feed_forward(xi, *layers, impl)
        y.backward(dy.to(dtype).to(kind))
        params = [p for m in layers for p in m.parameters()]
        results.append([y, xi.grad, *(p.grad for p in params)])
        for p in params:
            p.grad = None
    for name, got, want in zip(("y", "x", "W_in", "b_in", "W_out", "b_out"), *results):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, f"{dtype} {name}: relative error {err:.2e}"


def test_triton_forced_where_it_cannot_run_ends_in_one_line(monkeypatch):
    """On the CPU without Triton's interpreter, or on a GPU below sm_80, a forced `triton` is
    refused with the fix, before any kernel is launched."""
    from shatter import ffn

    layers = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    monkeypatch.setattr(gelu_linear, "INTERPRET", False)
    with pytest.raises(ValueError, match="not on cpu; fix: set ffn_impl to auto or torch"):
        feed_forward(torch.randn(2, 8), *layers, "triton")
    monkeypatch.setattr(ffn, "capability", lambda index: (7, 0))
    with pytest.raises(ValueError, match="this one is sm_70; fix: set ffn_impl to auto or torch"):
        ffn._require_tensor_cores(torch.device("cuda", 0))
    assert feed_forward(torch.randn(2, 8), *layers, "torch").shape == (2, 8)
