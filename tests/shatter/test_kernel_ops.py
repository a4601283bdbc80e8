"""The Triton attentions as torch.library custom ops: `shatter::mixing_fwd`/`_bwd` (the hybrid
`triton` impl) and `shatter::fused_fwd`/`_bwd` (the `fused` impl) pass torch's op checks (schema,
fake kernels, autograd registration), a dispatch trace on meta tensors sees them by name,
FlopCounterMode counts them with the formulas of shatter/kernels/cost.py, which list every
kernel they launch, and torch.compile runs a model with attention_impl=triton and =fused.

Without a GPU the ops run Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py); torch.compile then uses the aot_eager backend: Dynamo and AOTAutograd trace
the model with fake tensors through the ops' fake kernels, and the compiled graph runs the real
ops. (Inductor's CPU code generation passes too but takes a minute and a half on two cores.)
"""

import os
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from shatter.attention.projection import context_views, context_width, projection_width
from shatter.partition import partition_table
from tests.shatter.shatter_tiny import ids, tiny

pytest.importorskip("triton", reason="triton has no wheel for this platform")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device", allow_module_level=True)

from shatter.attention import triton_kernel  # noqa: E402
from shatter.attention.triton_kernel import partition_attention_triton  # noqa: E402
from shatter.kernels import fused_attention  # noqa: E402
from shatter.kernels.cost import OP_COSTS, family_of, op_totals  # noqa: E402

IMPLS = {
    "triton": (partition_attention_triton, triton_kernel.mixing_fwd, triton_kernel.mixing_bwd),
    "fused": (
        fused_attention.partition_attention_fused,
        fused_attention.fused_fwd,
        fused_attention.fused_bwd,
    ),
}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the arch family whose kernel configurations run here, for the costs: None under the interpreter
FAMILY = family_of(torch.cuda.get_device_capability()) if DEVICE == "cuda" else None


def _inputs(device, B=2, L=20, d=32, n=4, bias=True, grad=True):
    g = torch.Generator().manual_seed(0)

    def new(*shape):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)

    Q, X, V = new(B, L, d), new(B, L, d), new(B, n, L, d // n)
    c = new(B, L, n) if bias else None
    mask = torch.ones(B, L, dtype=torch.bool, device=device)
    mask[1, 13:] = False
    table = partition_table(n, 1, 3, max_len=64).to(device)
    return Q, X, V, c, mask, table


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False], ids=["part-bias", "no-bias"])
def test_ops_pass_torch_opcheck(bias):
    Q, X, V, c, mask, table = _inputs(DEVICE, bias=bias)
    B, L, d = Q.shape
    width = projection_width(d, 4, bias)
    P = torch.randn(B, L, width, device=DEVICE, requires_grad=True)
    torch.library.opcheck(
        torch.ops.shatter.mixing_fwd.default,
        (P, X, mask, table, True),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    context, Z, stat = torch.ops.shatter.mixing_fwd(P, X, mask, table, True)
    out, part = context_views(context, 4)
    g_out, g_part = context_views(torch.randn_like(context), 4)
    torch.library.opcheck(
        torch.ops.shatter.mixing_bwd.default,
        (P.detach(), X.detach(), mask, table, Z, stat, out, part, g_out, g_part, True),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.shatter.fused_fwd.default,
        (P, X, mask, table, True),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    context, stat = torch.ops.shatter.fused_fwd(P, X, mask, table, True)
    out, part = context_views(context, 4)
    torch.library.opcheck(
        torch.ops.shatter.fused_bwd.default,
        (P.detach(), X.detach(), mask, table, stat, out, part, g_out, g_part, True),
        test_utils=("test_schema", "test_faketensor"),
    )


class _Names(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append((func.name(), args, kwargs or {}, out))
        return out


def _traced_ops(impl: str):
    Q, X, V, c, mask, table = _inputs("meta")
    with _Names() as trace, FlopCounterMode(display=False) as counter:
        out, part = IMPLS[impl][0](Q, X, V, c, mask, table, True)
        (out.sum() + part.sum()).backward()
    ops = {name: (args, kwargs, o) for name, args, kwargs, o in trace.names if "shatter" in name}
    return ops, {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("impl", IMPLS)
def test_meta_trace_sees_the_ops_and_the_flop_counter_counts_them(impl):
    ops, counts = _traced_ops(impl)
    prefix = "mixing" if impl == "triton" else "fused"
    assert list(ops) == [f"shatter::{prefix}_fwd", f"shatter::{prefix}_bwd"]
    for name, (args, kwargs, o) in ops.items():
        flops, nbytes = op_totals(OP_COSTS[name](args, kwargs, o))
        assert flops > 0 and nbytes > 0
        packet = f"shatter.{name.split('::')[1]}"
        assert counts[packet] == int(flops), (name, counts)
    B, L, d, sweep = 2, 20, 32, 2 * 20 * 21 * 32  # the mixing dots: B L (L+1) d
    fwd = op_totals(OP_COSTS[f"shatter::{prefix}_fwd"](*ops[f"shatter::{prefix}_fwd"]))[0]
    if impl == "triton":  # Z = Q Xᵀ in the row statistics (2 B L L d: sm_80+), the mixing dots
        assert fwd == 2 * B * L * L * d + sweep
    else:  # Q Xᵀ in the row statistics (2 B L L d), again in the mixing for its one group
        # per side (n = 4: sm_90's widest GROUP, 2; 2 sweeps), and the mixing dots
        assert fwd == 2 * B * L * L * d + 2 * 1 * sweep + sweep


def test_fused_saves_no_score_matrix():
    """What the fused forward keeps for the backward is O(l) per row: no [B, l, l] tensor."""
    ops, _ = _traced_ops("fused")
    _, _, outputs = ops["shatter::fused_fwd"]
    context = (2, 20, context_width(32, 4))  # [X̄ | A_part | 1 | 0]
    assert [tuple(t.shape) for t in outputs] == [context, (2, 2, 20)]


TRITON_KERNELS = ("row_stats_kernel", "mix_fwd_kernel", "mix_bwd_dv_kernel", "delta_kernel")
TRITON_KERNELS += ("mix_bwd_dz_kernel",)


class _Launches(TorchDispatchMode):
    """The kernels an op's own implementation launches: its ATen ops that launch one (no views,
    no allocations), and its Triton kernels (counted by `_count_triton`)."""

    FREE = {"empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.kernels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        view = returns and all(r.alias_info and not r.alias_info.is_write for r in returns)
        if func.overloadpacket.__name__ not in self.FREE and not view:
            self.kernels.append(func.name())
        return out


def _count_triton(monkeypatch, launches):
    for name in TRITON_KERNELS:
        kernel = getattr(triton_kernel, name)

        class Counted:  # one launch, the interpreter's own tensor ops unseen
            def __getitem__(self, grid, _kernel=kernel, _name=name):
                def launch(*args, **kwargs):
                    launches.kernels.append(_name)
                    with _disable_current_modes():
                        return _kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(triton_kernel, name, Counted())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("L", [20, 32], ids=["padded", "aligned"])
def test_op_costs_list_every_kernel_the_ops_launch(monkeypatch, L, impl):
    """OP_COSTS lists one Kernel per kernel each op's implementation launches (its cuBLAS GEMMs,
    its Triton kernels, its copies and fills), with the GEMMs priced as gemm and the Triton
    kernels with dots as custom (the fused impl's row statistics too: they make Q Xᵀ)."""
    _, forward_op, backward_op = IMPLS[impl]
    Q, X, V, c, mask, table = _inputs(DEVICE, L=L, grad=False)
    d, n = X.shape[-1], table.shape[0]
    P = torch.cat([Q, V.transpose(1, 2).flatten(2), c, c.new_zeros(*c.shape[:2], 12)], -1)
    launches = _Launches()
    _count_triton(monkeypatch, launches)
    with launches:
        fwd_out = forward_op._init_fn(P, X, mask, table, True)
    fwd = OP_COSTS[forward_op._qualname]((P, X, mask, table, True), {}, fwd_out, FAMILY)
    assert len(fwd) == len(launches.kernels), (fwd, launches.kernels)
    # the row statistics make Q Xᵀ (sm_80+: the hybrid's Z, the fused impl's sweep)
    assert [k.kind for k in fwd if k.flops] == ["custom", "custom"]
    context, *kept = fwd_out
    out, part = context_views(context, n)
    g_out, g_part = context_views(torch.randn_like(context), n)
    launches.kernels.clear()
    args = (P, X, mask, table, *kept, out, part, g_out, g_part, True)
    torch.full_like(P, float("nan"))  # memory freed at once: what dP may be given
    with launches:
        dP_dX = backward_op._init_fn(*args)
    assert not dP_dX[0][..., 2 * d + n :].any()  # c's alignment columns zeroed by the dZ kernel
    bwd = OP_COSTS[backward_op._qualname](args, {}, dP_dX, FAMILY)
    assert len(bwd) == len(launches.kernels), str(([k.name for k in bwd], launches.kernels))
    assert sorted(k.kind for k in bwd if k.flops) == ["custom", "custom", "gemm", "gemm"]
    assert P.shape[-1] == projection_width(d, n)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_runs_the_model_with_the_impl(impl):
    x = ids(2, 24)
    mask = torch.ones_like(x)
    mask[0, 17:] = 0
    labels = torch.where(x % 3 == 0, x, -100)
    ref, model = (tiny("shatter", attention_impl=name) for name in ("naive", impl))
    want = ref(x, mask, labels)
    want["loss"].backward()
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model, backend=backend)(x, mask, labels)
        got["loss"].backward()
    assert not [w.message for w in caught if "Dynamo" in str(w.message)]  # none leaks to a user
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_inductor_hands_the_ops_the_strided_keys_and_equals_eager_on_a_gpu(impl):
    """On a GPU, inductor compiling a training model with the impl: the keys reach the ops as a
    view of the projection's `[X | 1 | 0]` (`projection.gemm_input`; the ops' `flexible_layout`
    tag lets inductor pass it uncopied), the bias gradients come from the weight-gradient GEMM;
    the loss and every gradient equal the naive impl's, eager, in fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: inductor's Triton code")
    x = ids(2, 24).cuda()
    mask = torch.ones_like(x)
    mask[0, 17:] = 0
    labels = torch.where(x % 3 == 0, x, -100)
    ref, model = (tiny("shatter", attention_impl=name).cuda().train() for name in ("naive", impl))
    want = ref(x, mask, labels)
    want["loss"].backward()
    got = torch.compile(model)(x, mask, labels)
    got["loss"].backward()
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


COPIES = {"aten::clone", "aten::copy_", "aten::_to_copy", "aten::constant_pad_nd", "aten::zeros"}
COPIES |= {"aten::zeros_like", "aten::mul.Tensor", "aten::div.Tensor", "aten::contiguous"}


def test_no_copies_around_the_kernels():
    """A shatter layer's forward and backward at l = 32 (a multiple of 16), traced on meta
    tensors: no scaled Q, no padded keys, no transposed output, dX̄ or dV copied, no zero
    gradient made for the saved Z."""
    model = tiny("shatter", attention_impl="triton")
    attention = model.encoder.layers[0].attention.to("meta")
    x = torch.randn(2, 32, model.config.hidden, device="meta", requires_grad=True)
    mask = torch.ones(2, 32, dtype=torch.bool, device="meta")
    with _Names() as trace:  # grad(), not backward(): no copies into .grad
        torch.autograd.grad(attention(x, mask).sum(), [x, *attention.parameters()])
    names = [name for name, *_ in trace.names]
    assert "shatter::mixing_fwd" in names and "shatter::mixing_bwd" in names
    big = 2 * 32 * 32  # B l min(l, d): activations, not the weight-sized products
    copies = [name for name, _, _, out in trace.names if name in COPIES and out.numel() >= big]
    assert not copies, copies


def test_the_host_path_s_constants_are_triton_s():
    """pow2 (plain Python on every call's host path) is triton.next_power_of_2, and kernel_meta's
    cached constants come back as a fresh dict each call."""
    import triton

    from shatter.kernels import launch

    assert [launch.pow2(x) for x in range(0, 3000)] == [
        triton.next_power_of_2(x) for x in range(0, 3000)
    ]
    meta = triton_kernel.kernel_meta(768, 12, torch.bfloat16)
    meta["BLOCK_K"] = -1
    assert triton_kernel.kernel_meta(768, 12, torch.bfloat16)["BLOCK_K"] == 64
