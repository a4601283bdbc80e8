"""The Triton attention as torch.library custom ops: `shatter::mixing_fwd` and `shatter::mixing_bwd`
pass torch's op checks (schema, fake kernels, autograd registration), a dispatch trace on meta
tensors sees them by name, FlopCounterMode counts them with the formulas of
shatter/kernels/cost.py, and torch.compile runs a model with attention_impl=triton.

Without a GPU the ops run Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py); torch.compile then uses the aot_eager backend: Dynamo and AOTAutograd trace
the model with fake tensors through the ops' fake kernels, and the compiled graph runs the real
ops. (Inductor's CPU code generation passes too but takes a minute and a half on two cores.)
"""

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from shatter.attention.projection import projection_width
from shatter.partition import partition_table
from tests.shatter.shatter_tiny import ids, tiny

pytest.importorskip("triton", reason="triton has no wheel for this platform")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device", allow_module_level=True)

from shatter.attention.triton_kernel import partition_attention_triton  # noqa: E402
from shatter.kernels.cost import OP_COSTS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    out, part, Z, stat = torch.ops.shatter.mixing_fwd(P, X, mask, table, True)
    g_out, g_part = torch.randn_like(out).transpose(1, 2).contiguous().transpose(1, 2), part
    torch.library.opcheck(
        torch.ops.shatter.mixing_bwd.default,
        (P.detach(), X.detach(), mask, table, Z, stat, out, part, g_out, g_part, True),
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


def test_meta_trace_sees_the_ops_and_the_flop_counter_counts_them():
    Q, X, V, c, mask, table = _inputs("meta")
    with _Names() as trace, FlopCounterMode(display=False) as counter:
        out, part = partition_attention_triton(Q, X, V, c, mask, table, True)
        (out.sum() + part.sum()).backward()
    ops = {name: (args, kwargs, o) for name, args, kwargs, o in trace.names if "shatter" in name}
    assert list(ops) == ["shatter::mixing_fwd", "shatter::mixing_bwd"]
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    for name, (args, kwargs, o) in ops.items():
        flops, nbytes = OP_COSTS[name](args, kwargs, o)
        assert flops > 0 and nbytes > 0
        packet = f"shatter.{name.split('::')[1]}"
        assert counts[packet] == int(flops), (name, counts)
    # the forward: Z = Q Xᵀ over Z's padded rows (2 B L Lp d) and the mixing dots (B L (L+1) d)
    fwd = OP_COSTS["shatter::mixing_fwd"](*ops["shatter::mixing_fwd"])[0]
    assert fwd == 2 * 2 * 20 * 32 * 32 + 2 * 20 * 21 * 32


@pytest.mark.slow
def test_torch_compile_runs_the_model_with_the_triton_impl():
    x = ids(2, 24)
    mask = torch.ones_like(x)
    mask[0, 17:] = 0
    labels = torch.where(x % 3 == 0, x, -100)
    ref, model = (tiny("shatter", attention_impl=impl) for impl in ("naive", "triton"))
    want = ref(x, mask, labels)
    want["loss"].backward()
    backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    got = torch.compile(model, backend=backend)(x, mask, labels)
    got["loss"].backward()
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
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
