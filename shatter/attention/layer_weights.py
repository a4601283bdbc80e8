"""The weights a block uses that are products of its parameters, made once per forward for every
layer of the encoder in a few batched ops, instead of in each layer.

`layer_weights(blocks)` gives one `LayerWeights(attention, output, output_bias)` per block:

- `attention`: keyword arguments of the variant's forward (none for most variants);
- `output`: the W^O the block applies to the variant's context (its own `output.weight`, or a
  product of it);
- `output_bias`: the bias the block adds with it (its own `output.bias`, or None where `output`
  carries it).

A variant opts in with a classmethod `prepare(blocks) -> list[LayerWeights]`; the others get
their block's W^O unchanged. The single-head partition archs prepare (§3.2-3.3, nn.Linear's
convention: a weight W maps x to x Wᵀ):

    projection  W^P = [W^Q; W^V; R W^Q; 0],  b^P = [b^Q; b^V; R b^Q; 0]
                P = X W^Pᵀ + b^P = [Q | V | c]: c = Q Rᵀ in the same GEMM, zero rows pad c's
                columns to projection_width
    output      W^F = [W^O | W^O V_partᵀ | b^O | 0]  (shatter: V_part = R W^V, §3.3)
                W^F = [W^O | 0 | b^O | 0]            (the others: no A_part V_part term)

The variant's context is [X̄ | A_part | 1 | 0] ([B, L, context_width]: A_part's n columns, a
column of ones and zeros up to a multiple of 16, aligned rows for the kernels and the GEMM), so
that W^F applied to it is X̄ W^Oᵀ + A_part (W^O V_partᵀ)ᵀ + b^O = (X̄ + A_part V_part) W^Oᵀ +
b^O: §3.3's X̄̄ = X̄ + A_part V_part folded exactly into the output projection's GEMM (16 more
columns of K for n < 16), with no [T, n] x [n, d] GEMM and no d-wide add, and the bias with it:
its gradient is the ones' column of W^F's weight gradient (the GEMM's sum over the tokens, where
a bias added apart has a reduction of its own). Nothing here is stored: checkpoints keep W^Q,
W^V, R, W^O and b^O as ever. The products' gradients are written by hand (`_Assembled`): each
weight is copied once a forward and each gradient is one batched GEMM, where autograd through
stack, cat and bmm copied the weights twice and added each gradient's two paths.

Under torch.compile `layer_weights` runs eagerly (`@eager`, and the autograd Functions here
mark their backward): inductor would copy each parameter of a `cat` with a kernel of its own
(BERT-base's fused QKV: 72 launches a forward, each layer's W^Q, W^K, W^V and their biases),
where CUDA's eager `cat` copies them in one. Each Function returns every layer's weights as views and takes their gradients back as
they are, so that nothing between it and the layers runs in autograd's own nodes.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from shatter.attention.projection import context_width, projection_width
from shatter.eager import eager, eager_region


class LayerWeights(NamedTuple):
    attention: dict  # keyword arguments of the variant's forward
    output: torch.Tensor  # the W^O the block applies to the variant's context
    output_bias: torch.Tensor | None  # the bias it adds (None: `output` carries it)


@eager
def layer_weights(blocks) -> list[LayerWeights]:
    """One LayerWeights per block (all blocks of one variant): the variant's `prepare`, or each
    block's own W^O."""
    prepare = getattr(type(blocks[0].attention), "prepare", None)
    if prepare is None:
        return [LayerWeights({}, block.output.weight, block.output.bias) for block in blocks]
    return prepare(blocks)


# Devices with autocast, asked without a call: torch 2.11's Dynamo cannot trace
# torch.amp.is_autocast_available (a graph break in every layer's forward, whose resumed frame
# then recompiles each step until the recompile limit)
AUTOCAST_DEVICES = ("cuda", "cpu")


def has_autocast(kind: str) -> bool:
    return kind in AUTOCAST_DEVICES or torch.amp.is_autocast_available(kind)


def matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast gives matmuls of `t` (its own outside autocast)."""
    kind = t.device.type
    if has_autocast(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


def without_autocast(device: torch.device):
    """A region where `device`'s autocast is off (nothing to turn off where it has none)."""
    if has_autocast(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _params(modules, name: str) -> list[torch.Tensor]:
    """The parameter `name` ("query.weight") of every module."""
    return [module.get_parameter(name) for module in modules]


def _interleaved(per_layer: list[list[torch.Tensor]], K: int) -> torch.Tensor:
    """[K, rows, ...]: each layer's pieces stacked along their first dimension, every layer's in
    one cat (one copy of each piece)."""
    pieces = [t for layer in per_layer for t in layer]
    out = torch.cat(pieces, 0)
    return out.view(K, -1, *out.shape[1:])


class _Interleaved(torch.autograd.Function):
    """`_interleaved` in `dtype`, as K per-layer views; each piece's gradient is its rows of its
    layer's gradient (a view: no kernel where `dtype` is the pieces' own)."""

    @staticmethod
    def forward(ctx, K: int, dtype: torch.dtype, *pieces):
        per = len(pieces) // K
        out = _interleaved([pieces[k * per : (k + 1) * per] for k in range(K)], K).to(dtype)
        ctx.rows, ctx.dtype = [p.shape[0] for p in pieces], pieces[0].dtype
        return tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        with eager_region():
            per = len(ctx.rows) // len(grads)
            out = []
            for k, g in enumerate(grads):
                out += g.to(ctx.dtype).split(ctx.rows[k * per : (k + 1) * per], 0)
        return (None, None, *out)


def interleaved(per_layer: list[list[torch.Tensor]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each layer's pieces (tensors alike past their first dimension) stacked along it, in
    `dtype`, all layers in one cat (`_Interleaved`): one tensor per layer."""
    pieces = [t for layer in per_layer for t in layer]
    return list(_Interleaved.apply(len(per_layer), dtype, *pieces))


class _Assembled(torch.autograd.Function):
    """(W^P [p, d], b^P [p], W^F [d, context_width] when given) of each of K single-head layers
    (module docstring) in `dtype`, as views, with the gradients written by hand. Through stack,
    cat and bmm, autograd copied each weight twice forward and added each gradient's two paths
    in a d x d-wide add; here the weights are copied once, and each gradient is one
    (b)addbmm. `shape` is (K, n, bias, value, has W^O); `params` the layers' W^Q, b^Q, W^V, b^V,
    then R (where it is used: with the bias, or the value term and W^O), then W^O and b^O (when
    given), K of each, computed in their own dtype."""

    @staticmethod
    def forward(ctx, shape, dtype, *params):
        K, n, bias, value, has_output = shape
        W_Q, b_Q, W_V, b_V = (params[i * K : (i + 1) * K] for i in range(4))
        rest = params[4 * K :]
        uses_r = _uses_r(*shape[2:])
        outputs = [rest[-2 * K : -K], rest[-K:]] if has_output else []  # W^O, b^O
        stacked = _stacked(([rest[:K]] if uses_r else []) + outputs)  # R, W^O, b^O: one cat
        R = stacked[0] if uses_r else None
        d = W_Q[0].shape[0]
        zero = _zeros(W_Q[0], K, n, bias, value, has_output)
        W_P, b_P = _projection_forward(W_Q, b_Q, W_V, b_V, R if bias else None, K, zero)
        VR = W_P[:, d : 2 * d] @ R.transpose(1, 2) if value and has_output else None  # [K, d, n]
        W_F = _output_forward(*stacked[-2:], VR, n, zero) if has_output else None
        ctx.shape, ctx.d, ctx.dtype = shape, d, W_Q[0].dtype
        ctx.save_for_backward(R, W_P, b_P, W_F, VR)
        made = [W_P, b_P] + ([W_F] if has_output else [])
        return tuple(view for t in made for view in t.to(dtype).unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        K = ctx.shape[0]
        with eager_region():
            stacked = [torch.stack(grads[i : i + K]).to(ctx.dtype) for i in range(0, len(grads), K)]
            return (None, None, *_assembled_grads(ctx, *stacked, *[None] * (3 - len(stacked))))


def _assembled_grads(ctx, dW_P, db_P, dW_F) -> list[torch.Tensor]:
    """The parameters' gradients of `_Assembled` (its `params` order) from those of its
    stacked W^P, b^P and W^F (dW_F None without W^O)."""
    K, n, bias, value, has_output = ctx.shape
    R, W_P, b_P, W_F, VR = ctx.saved_tensors
    d = ctx.d
    dW_Q, dW_V, db_Q, db_V = dW_P[:, :d], dW_P[:, d : 2 * d], db_P[:, :d], db_P[:, d : 2 * d]
    dR = None
    if bias:  # c's rows: R W^Q and R b^Q (§3.3)
        dRW, dRb = dW_P[:, 2 * d : 2 * d + n], db_P[:, 2 * d : 2 * d + n, None]
        dW_Q = torch.baddbmm(dW_Q, R.transpose(1, 2), dRW)
        db_Q = torch.baddbmm(db_Q[..., None], R.transpose(1, 2), dRb)[..., 0]
        dR = torch.baddbmm(torch.bmm(dRW, W_P[:, :d].transpose(1, 2)), dRb, b_P[:, None, :d])
    dW_O = db_O = None
    if has_output:
        db_O = dW_F[..., d + n].contiguous()  # the ones' column: one copy for all layers
        dW_O = dW_F[..., :d]
        if value:  # W^O V_partᵀ = W^O (W^V Rᵀ)
            dfold = dW_F[..., d : d + n]
            dW_O = torch.baddbmm(dW_O, dfold, VR.transpose(1, 2))
            dVR = torch.bmm(W_F[..., :d].transpose(1, 2), dfold)
            dW_V = torch.baddbmm(dW_V, dVR, R)
            dR = _plus(dR, dVR.transpose(1, 2), W_P[:, d : 2 * d])
        dW_O = dW_O.contiguous()  # one copy for all layers, none per parameter
    grads = [dW_Q, db_Q, dW_V, db_V] + [g for g in (dR, dW_O, db_O) if g is not None]
    return [g for grad in grads for g in grad.unbind(0)]


def _uses_r(bias: bool, value: bool, has_output: bool) -> bool:
    """Whether R enters the products: in c's rows (the bias), or in W^F's fold (the value term)."""
    return bias or (value and has_output)


def _plus(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a b (batched), or a b where nothing has accumulated yet."""
    return torch.bmm(a, b) if acc is None else torch.baddbmm(acc, a, b)


def _stacked(groups: list) -> list[torch.Tensor]:
    """Each group of K like tensors stacked ([K, ...]), every group in one cat (one launch)."""
    if not groups:
        return []
    flat = torch.cat([t.reshape(-1) for group in groups for t in group])
    out, at = [], 0
    for group in groups:
        size = len(group) * group[0].numel()
        out.append(flat[at : at + size].view(len(group), *group[0].shape))
        at += size
    return out


def _zeros(like: torch.Tensor, K: int, n: int, bias: bool, value: bool, has_output: bool):
    """One zero fill for both products' padding (`_projection_forward`'s rows of W^P and b^P,
    `_output_forward`'s columns of W^F): the cats only read it, so one buffer serves both."""
    d = like.shape[0]
    rows = (projection_width(d, n) - 2 * d) * (d + 1) if bias else 0
    width = max(context_width(d, n) - d - n - 1, 0 if value else n)  # W^F's widest zero block
    cols = K * d * width if has_output else 0
    return like.new_zeros(max(rows, cols)) if max(rows, cols) else like.new_empty(0)


def _projection_forward(W_Q, b_Q, W_V, b_V, R, K: int, zero) -> tuple[torch.Tensor, torch.Tensor]:
    """(W^P, b^P) of the module docstring: the layers' W^Q and W^V copied once into W^P, then
    R W^Q and R b^Q written into c's rows by their batched GEMMs (`out=`: cuBLAS writes the
    strided rows in place, no copy; R None: no c rows). Every piece of the cats is contiguous
    (the zero rows, views of `zero`, too): CUDA's cat copies them all in one launch only then."""
    d = W_Q[0].shape[0]
    if R is None:
        W_P = _interleaved([[q, v] for q, v in zip(W_Q, W_V)], K)
        return W_P, _interleaved([[q, v] for q, v in zip(b_Q, b_V)], K)
    n = R.shape[1]
    pad = projection_width(d, n) - 2 * d
    zero_W, zero_b = zero[: pad * d].view(pad, d), zero[pad * d : pad * (d + 1)]
    W_P = _interleaved([[q, v, zero_W] for q, v in zip(W_Q, W_V)], K)
    b_P = _interleaved([[q, v, zero_b] for q, v in zip(b_Q, b_V)], K)
    c = slice(2 * d, 2 * d + n)  # c = Q Rᵀ = X (R W^Q)ᵀ + R b^Q (§3.3)
    torch.bmm(R, W_P[:, :d], out=W_P[:, c])
    torch.bmm(R, b_P[:, :d, None], out=b_P[:, c, None])
    return W_P, b_P


def _output_forward(W_O, b_O, VR: torch.Tensor | None, n: int, zero) -> torch.Tensor:
    """W^F = [W^O | W^O V_partᵀ | b^O | 0] [K, d, context_width] with V_partᵀ = W^V Rᵀ = VR, or
    [W^O | 0 | b^O | 0] with VR None (the zeros are views of `zero`): b^O meets the context's
    column of ones, the zeros its other alignment columns."""
    K, d, _ = W_O.shape
    fold = W_O @ VR if VR is not None else zero[: K * d * n].view(K, d, n)
    pad = context_width(d, n) - d - n - 1
    return torch.cat([W_O, fold, b_O[..., None], zero[: K * d * pad].view(K, d, pad)], 2)


def assembled_weights(attention: list, outputs: list | None, bias: bool, value: bool, dtype):
    """([W^P [p, d]] * K, [b^P [p]] * K, [W^F [d, context_width]] * K or None without `outputs`)
    of K single-head layers (`attention`, their `output` Linears), computed in the parameters'
    dtype (call with autocast off), given in `dtype`. `bias`: c's rows in W^P (R W^Q, R b^Q);
    `value`: W^F's fold."""
    names = ["query.weight", "query.bias", "value.weight", "value.bias"]
    params = [p for name in names for p in _params(attention, name)]
    if _uses_r(bias, value, outputs is not None):
        params += _params(attention, "partition_embeddings")
    if outputs is not None:
        params += _params(outputs, "weight") + _params(outputs, "bias")
    K = len(attention)
    shape = (K, attention[0].n, bias, value, outputs is not None)
    views = _Assembled.apply(shape, dtype, *params)
    W_P, b_P, W_F = (list(views[i : i + K]) for i in range(0, 3 * K, K))
    return W_P, b_P, (W_F or None)


def single_head_weights(blocks, bias: bool, value: bool) -> list[LayerWeights]:
    """The single-head layers' W^P, b^P and W^F (module docstring), every layer in one batched
    op each; computed in the parameters' dtype, given in autocast's (one cast for all layers)."""
    attention = [block.attention for block in blocks]
    weight = blocks[0].output.weight
    dtype = matmul_dtype(weight)  # autocast's, asked before it is turned off
    with without_autocast(weight.device):
        W_P, b_P, W_F = assembled_weights(attention, [b.output for b in blocks], bias, value, dtype)
    return [
        LayerWeights({"projection": (w, b)}, f, None)  # b^O is in W^F (module docstring)
        for w, b, f in zip(W_P, b_P, W_F, strict=True)
    ]


__all__ = [
    "LayerWeights",
    "assembled_weights",
    "interleaved",
    "layer_weights",
    "matmul_dtype",
    "single_head_weights",
    "without_autocast",
]
