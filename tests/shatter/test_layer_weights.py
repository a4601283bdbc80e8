"""§3.3's A_part V_part folded into W^O, and the single-head layers' weight products made once
per forward for every layer (shatter/attention/layer_weights.py), equal the layer as it was
written before: X̄̄ = X̄ + A_part V_part, then W^O, with R W^Q and R W^V made in every layer.
`_unfolded_block` below keeps that formulation as the reference."""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from shatter.attention import impls
from shatter.attention.layer_weights import assembled_weights, layer_weights
from shatter.attention.projection import (
    ProjectWithKeys,
    context_views,
    context_width,
    gather_projections,
    new_context,
    projection_views,
    projection_width,
)
from shatter.partition import partition_table
from tests.shatter.shatter_tiny import ids, tiny

SINGLE_HEAD = ["1h-softmax", "1h-sigmoid", "part-bias", "shatter"]
# fp32: the two formulations round differently (one sum of d + n products against two)
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fold_equals_x_bar_plus_a_part_v_part(dtype):
    """[X̄ | A_part | 1 | 0] [W^O | W^O V_partᵀ | b^O | 0]ᵀ = (X̄ + A_part V_part) W^Oᵀ + b^O,
    V_part = R W^V (weight only): values, and the gradients of W^O, b^O, R, W^V, X̄ and
    A_part."""
    T = 37
    g = torch.Generator().manual_seed(0)
    block = tiny("shatter").to(dtype).encoder.layers[0]
    att = block.attention
    d, n = att.query.weight.shape[0], att.n
    x_bar, a_part = (torch.randn(T, k, generator=g, dtype=dtype).requires_grad_() for k in (d, n))
    g_y = torch.randn(T, d, generator=g, dtype=dtype)
    W_O, b_O, W_V, R = block.output.weight, block.output.bias, att.value.weight, att.partition_embeddings  # fmt: skip
    leaves = (W_O, b_O, R, W_V, x_bar, a_part)
    want = F.linear(x_bar + a_part @ F.linear(R, W_V), W_O, b_O)  # §3.3, then W^O
    W_F = assembled_weights([att], [block.output], True, True, dtype)[2][0]
    ones = torch.ones(T, 1, dtype=dtype)
    context = F.pad(torch.cat([x_bar, a_part, ones], -1), (0, context_width(d, n) - d - n - 1))
    got = F.linear(context, W_F)
    torch.testing.assert_close(got, want, **TOL[dtype])
    grads = [torch.autograd.grad((y * g_y).sum(), leaves) for y in (got, want)]
    for name, a, b in zip(("W^O", "b^O", "R", "W^V", "X̄", "A_part"), *grads, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=name)


def _plain_weights(attention, outputs, bias: bool, value: bool):
    """The module docstring's W^P, b^P and W^F of each layer in plain autograd ops, layer by
    layer: the reference for assembled_weights."""
    W_P, b_P, W_F = [], [], []
    for att, out in zip(attention, outputs, strict=True):
        d, n = att.query.weight.shape[0], att.n
        w, b = [att.query.weight, att.value.weight], [att.query.bias, att.value.bias]
        if bias:
            R, pad = att.partition_embeddings, projection_width(d, n) - 2 * d - n
            w += [R @ att.query.weight, R.new_zeros(pad, d)]
            b += [R @ att.query.bias, R.new_zeros(pad)]
        W_P.append(torch.cat(w))
        b_P.append(torch.cat(b))
        fold = out.weight @ (att.value.weight @ att.partition_embeddings.T) if value else None
        f = [out.weight, out.weight.new_zeros(d, n) if fold is None else fold, out.bias[:, None]]
        width = sum(t.shape[1] for t in f)
        W_F.append(F.pad(torch.cat(f, 1), (0, context_width(d, n) - width)))
    return torch.stack(W_P), torch.stack(b_P), torch.stack(W_F)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", SINGLE_HEAD)
def test_assembled_weights_equal_the_plain_ops(arch, dtype):
    """W^P, b^P and W^F of three layers, assembled with hand-written gradients, equal the plain
    ops layer by layer: values, and the gradient of every parameter (W^Q, b^Q, W^V, b^V, R,
    W^O, b^O) under random cotangents; the single layer's (W^P, b^P) too."""
    model = tiny(arch, layers=3).to(dtype)
    blocks = list(model.encoder.layers)
    attention, outputs = [b.attention for b in blocks], [b.output for b in blocks]
    kind = type(attention[0])
    flags = (kind.partition_bias, kind.partition_value)
    params = [p for p in model.encoder.layers.parameters()]
    with torch.no_grad():  # biases too (they start at zero): R b^Q's gradient reaches R
        for p, seed in zip(params, range(100, 200)):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) / 4)
    got = [torch.stack(t) for t in assembled_weights(attention, outputs, *flags, dtype)]
    want = _plain_weights(attention, outputs, *flags)
    g = torch.Generator().manual_seed(4)
    cotangents = [torch.randn(t.shape, generator=g, dtype=dtype) for t in want]
    for name, a, b in zip(("W^P", "b^P", "W^F"), got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=name)

    def grads(outs):
        loss = sum((o * c).sum() for o, c in zip(outs, cotangents, strict=True))
        return torch.autograd.grad(loss, params, allow_unused=True)

    names = [name for name, _ in model.encoder.layers.named_parameters()]
    for name, a, b in zip(names, grads(got), grads(want), strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **TOL[dtype], msg=name)
    alone = attention[1].projection()
    for name, a, b in zip(("W^P", "b^P"), alone, (want[0][1], want[1][1]), strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"{name} of one layer")


def _unfolded_attention(att, x, mask, impl):
    """The layer before the fold: P = X [W^Q; W^V; R W^Q; 0]ᵀ + [b^Q; b^V; R b^Q; 0] made in
    the layer, the impl's X̄ and A_part, then X̄ + A_part V_part with V_part = R W^V (§3.3)."""
    d, n = x.shape[-1], att.n
    weights, biases = [att.query.weight, att.value.weight], [att.query.bias, att.value.bias]
    if att.partition_bias:
        R = att.partition_embeddings
        pad = projection_width(d, n) - 2 * d - n
        weights += [R @ att.query.weight, R.new_zeros(pad, d)]
        biases += [R @ att.query.bias, R.new_zeros(pad)]
    P = F.linear(x, torch.cat(weights), torch.cat(biases))
    Q, V, c = projection_views(P, d, n)
    x_bar, a_part = impls.IMPLS[impl](Q, x, V, c, mask, att.exact_partition(), att.sigmoid)
    B, _, L, k = x_bar.shape
    out = x_bar.transpose(1, 2).reshape(B, L, n * k)
    if att.partition_value:
        out = out + a_part @ F.linear(att.partition_embeddings, att.value.weight)
    return out


def _unfolded_encoder(model, x, mask, impl):
    enc = model.encoder
    mask_BL = enc.key_mask(x, mask)
    h = enc.embeddings(x)
    for block in enc.layers:
        h = block.finish(_unfolded_attention(block.attention, h, mask_BL, impl), h)
    return h


def _run(fn, model, g_h):
    h = fn()
    grads = torch.autograd.grad((h * g_h).sum(), list(model.parameters()), allow_unused=True)
    return h, grads


@pytest.mark.parametrize("impl", ["naive", "lean", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", SINGLE_HEAD)
def test_encoder_equals_the_unfolded_layers(arch, dtype, impl):
    """The encoder (weights made once for both layers, the fold in W^O) against the unfolded
    layers, with padding: X^L and the gradient of every parameter (W^O, R, W^V, W^Q, ...)."""
    model = tiny(arch, attention_impl=impl).to(dtype)
    x = ids(2, 11)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    g_h = torch.randn(2, 11, model.config.hidden, dtype=dtype)
    got = _run(lambda: model.encoder(x, mask), model, g_h)
    want = _run(lambda: _unfolded_encoder(model, x, mask, impl), model, g_h)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    names = [name for name, _ in model.named_parameters()]
    for name, a, b in zip(names, got[1], want[1], strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **TOL[dtype], msg=name)


@pytest.mark.parametrize("arch", SINGLE_HEAD)
def test_a_block_alone_makes_its_own_weights(arch):
    """Block(x, mask) without the encoder's weights equals it with them."""
    model = tiny(arch, attention_impl="lean")
    block = model.encoder.layers[1]
    x = torch.randn(2, 9, model.config.hidden)
    mask = torch.ones(2, 9, dtype=torch.bool)
    shared = layer_weights(list(model.encoder.layers))[1]
    torch.testing.assert_close(block(x, mask), block(x, mask, shared))


def test_parameter_names_and_shapes_are_unchanged():
    """Nothing of the fold is stored: a shatter layer's state is the same tensors as ever, so
    old checkpoints and exports load."""
    model = tiny("shatter")
    d, n = model.config.hidden, model.config.heads
    want = {
        "attention.query.weight": (d, d), "attention.query.bias": (d,),
        "attention.value.weight": (d, d), "attention.value.bias": (d,),
        "attention.partition_embeddings": (n, d), "output.weight": (d, d), "output.bias": (d,),
    }  # fmt: skip
    state = {k: tuple(v.shape) for k, v in model.encoder.layers[0].state_dict().items()}
    assert {k: v for k, v in state.items() if k.startswith(("attention.", "output."))} == want


class _Ops(TorchDispatchMode):
    """(op, input shapes, output shape, phase) of every op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase = [], "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        self.ops.append((func.overloadpacket.__name__, shapes, shape, self.phase))
        return out


def _step_ops(layers: int, B=5, L=16):
    model = tiny("shatter", attention_impl="lean", layers=layers).to("meta").train()
    x = torch.empty(B, L, dtype=torch.long, device="meta")
    with _Ops() as trace:
        loss = model.encoder(x).sum()
        trace.phase = "backward"
        loss.backward()
    return trace.ops


GEMMS = ("mm", "addmm", "bmm", "matmul", "baddbmm")


def test_weight_products_are_made_once_per_step_and_no_a_part_gemm():
    """A training step's trace: no GEMM with an [n, d] operand (A_part V_part and its
    gradients, or a layer's own R W^Q, R W^V), one d-wide add per residual and no other in the
    forward and in the backward (the keys' gradient is taken by the projection's GEMM,
    projection.ProjectWithKeys), and the weight products' ops (stack, cat, bmm) do not grow
    with the number of layers: made once for all."""
    B, L, n, d = 5, 16, 4, 64
    two, three = _step_ops(2), _step_ops(3)
    narrow = {(n, d), (d, n)}  # A_part [T, n] x V_part [n, d], its gradients; R W per layer
    for name, shapes, out, phase in three:
        if name in GEMMS:
            assert not narrow & {*shapes, out}, (name, shapes, out, phase)
    for phase in ("forward", "backward"):
        adds = [o for o in three if o[0] == "add" and o[3] == phase and o[2] == (B, L, d)]
        assert len(adds) == 2 * 3, phase  # the two residuals of each layer

    def prep(ops, layers):  # the batched products: stacks over the layers and what they feed
        return [o for o in ops if o[0] in ("stack", "cat", "bmm") and o[2][0] == layers]

    assert prep(two, 2) and len(prep(two, 2)) == len(prep(three, 3))


def _impl_inputs(dtype=torch.float32, B=2, L=9, d=16, n=4):
    g = torch.Generator().manual_seed(5)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    Q, X, c = leaf(B, L, d), leaf(B, L, d), leaf(B, L, n)
    V = leaf(B, L, d).unflatten(-1, (n, d // n)).transpose(1, 2)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 6:] = False
    return Q, X, V, c, mask, partition_table(n, 1, 3, max_len=16, dtype=dtype)


IMPL_NAMES = ["naive", "lean", "chunked"]
LAYER_NAMES = ["naive", "lean", "chunked"]
if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
    IMPL_NAMES.append("triton")  # Triton's interpreter on CPU tensors (tests/conftest.py)
    LAYER_NAMES += ["triton", "fused", "rows", "rows-keep"]


@pytest.mark.parametrize("impl", LAYER_NAMES)
def test_layer_context_rows_are_aligned_and_padded_with_ones_then_zeros(impl):
    """The layer's context [X̄ | A_part | 1 | 0] that the kernels write and the folded W^O's GEMM
    reads: rows a multiple of 16 elements apart (aligned loads, cuBLAS's aligned operand), the
    alignment columns a column of ones (it meets W^F's b^O) then zeros (W^F's zero columns)."""
    Q, X, V, c, mask, table = _impl_inputs(d=48, n=6)
    P = gather_projections(Q, V, c)
    layer = impls.resolve_layer(impl, X.device, X.dtype)
    context = layer(P.detach(), X.detach(), mask, table, True)
    assert context.shape[-1] == context_width(48, 6) == 64
    assert context.stride(1) % 16 == 0 and context.stride(0) % 16 == 0
    assert (context[..., 48 + 6] == 1).all() and not context[..., 48 + 6 + 1 :].any()


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_every_impl_writes_the_context_it_is_given(impl):
    """impl(..., out=context): X̄ and A_part in the context's columns, as views of it, and the
    gradients through the context equal those of the two returned tensors."""
    Q, X, V, c, mask, table = _impl_inputs()
    leaves = (Q, X, V, c)
    fn = impls.IMPLS[impl]
    x_bar, a_part = fn(Q, X, V, c, mask, table, True)
    out = new_context(X, 4)
    views = fn(Q, X, V, c, mask, table, True, out)
    got_x, got_a = context_views(out, 4)
    torch.testing.assert_close(got_x, x_bar)
    torch.testing.assert_close(got_a, a_part)
    assert all(v.data_ptr() == w.data_ptr() for v, w in zip(views, (got_x, got_a), strict=True))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    gx, ga = context_views(g, 4)
    want = torch.autograd.grad((x_bar * gx).sum() + (a_part * ga).sum(), leaves)
    for name, a, b in zip("QXVc", torch.autograd.grad((out * g).sum(), leaves), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("bias", [True, False])
def test_projection_with_keys_gradients(bias):
    """(P, K) = (X Wᵀ + b, X): X's gradient is dP W plus the keys' gradient, taken in one GEMM;
    also when only P or only K is used."""
    g = torch.Generator().manual_seed(3)
    X, W = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3, 4), (6, 4)))
    b = torch.randn(6, generator=g, dtype=torch.float64) if bias else None
    leaves = [t.requires_grad_() for t in (X, W, b) if t is not None]

    def run(*args):
        return ProjectWithKeys.apply(*args, *([] if bias else [None]))

    assert torch.autograd.gradcheck(run, tuple(leaves))
    assert torch.autograd.gradcheck(lambda *a: run(*a)[0], tuple(leaves))
    assert torch.autograd.gradcheck(lambda *a: run(*a)[1] * 2, tuple(leaves))
