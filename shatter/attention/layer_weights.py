"""The weights a block uses that are products of its parameters, made once per forward for every
layer of the encoder in a few batched ops, instead of in each layer.

`layer_weights(blocks)` gives one `LayerWeights(attention, output)` per block:

- `attention`: keyword arguments of the variant's forward (none for most variants);
- `output`: the W^O the block applies to the variant's context (its own `output.weight`, or a
  product of it).

A variant opts in with a classmethod `prepare(blocks) -> list[LayerWeights]`; the others get
their block's W^O unchanged. The single-head partition archs prepare (§3.2-3.3, nn.Linear's
convention: a weight W maps x to x Wᵀ):

    projection  W^P = [W^Q; W^V; R W^Q; 0],  b^P = [b^Q; b^V; R b^Q; 0]
                P = X W^Pᵀ + b^P = [Q | V | c]: c = Q Rᵀ in the same GEMM, zero rows pad c's
                columns to projection_width
    output      W^F = [W^O | W^O V_partᵀ | 0]  (shatter: V_part = R W^V, §3.3)
                W^F = [W^O | 0]                (the others: no A_part V_part term)

The variant's context is [X̄ | A_part | 0] ([B, L, context_width]: A_part's n columns padded with
zeros to a multiple of 16, aligned rows for the kernels and the GEMM), so that W^O applied to it
is X̄ W^Oᵀ + A_part (W^O V_partᵀ)ᵀ = (X̄ + A_part V_part) W^Oᵀ: §3.3's X̄̄ = X̄ + A_part V_part
folded exactly into the output projection's GEMM (16 more columns of K for n <= 16), with no
[T, n] x [n, d] GEMM and no d-wide add. Nothing here is stored: checkpoints keep W^Q, W^V, R and W^O as ever,
and gradients reach them through the batched products.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from shatter.attention.projection import context_width, projection_width


class LayerWeights(NamedTuple):
    attention: dict  # keyword arguments of the variant's forward
    output: torch.Tensor  # the W^O the block applies to the variant's context


def layer_weights(blocks) -> list[LayerWeights]:
    """One LayerWeights per block (all blocks of one variant): the variant's `prepare`, or each
    block's own W^O."""
    prepare = getattr(type(blocks[0].attention), "prepare", None)
    if prepare is None:
        return [LayerWeights({}, block.output.weight) for block in blocks]
    return prepare(blocks)


def _matmul_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast gives matmuls on `device` (`dtype` outside autocast)."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return dtype


def without_autocast(device: torch.device):
    """A region where `device`'s autocast is off (nothing to turn off where it has none)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _stack(modules, name: str) -> torch.Tensor:
    """[K, ...]: the parameter `name` ("query.weight") of every module, stacked."""
    return torch.stack([module.get_parameter(name) for module in modules])


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose gradient is made contiguous in one op: R's gradient sums products
    that leave it transposed, and each layer's slice of it would otherwise be copied into its
    parameter's .grad on its own."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def projection_weights(attention: list, bias: bool):
    """(W^P [K, p, d], b^P [K, p], W^V [K, d, d], R [K, n, d] or None) of K single-head layers
    (module docstring; p = projection_width), in the parameters' dtype: call with autocast
    off. W^V and R are the stacks W^P was made from, for the folded W^O."""
    W_Q, W_V = _stack(attention, "query.weight"), _stack(attention, "value.weight")  # [K, d, d]
    b_Q, b_V = _stack(attention, "query.bias"), _stack(attention, "value.bias")  # [K, d]
    weights, biases, R = [W_Q, W_V], [b_Q, b_V], None
    if hasattr(attention[0], "partition_embeddings"):
        R = _ContiguousGrad.apply(_stack(attention, "partition_embeddings"))  # [K, n, d]
    if bias:  # c = Q Rᵀ = X (R W^Q)ᵀ + R b^Q (§3.3)
        K, n, d = R.shape
        zero = R.new_zeros(())
        pad = projection_width(d, n) - 2 * d - n
        weights += [R @ W_Q, zero.expand(K, pad, d)]
        biases += [(R @ b_Q[..., None]).squeeze(-1), zero.expand(K, pad)]
    return torch.cat(weights, 1), torch.cat(biases, 1), W_V, R


def folded_output(W_O: torch.Tensor, W_V: torch.Tensor, R: torch.Tensor | None, n: int):
    """W^F = [W^O | W^O V_partᵀ | 0] [K, d, context_width] with V_part = R W^V (§3.3), or
    [W^O | 0] with R None; the zero columns meet the context's alignment columns (constants:
    no gradient reaches a parameter through them). In the parameters' dtype: call with autocast
    off."""
    K, d, _ = W_O.shape
    zero = W_O.new_zeros(())
    if R is None:
        return torch.cat([W_O, zero.expand(K, d, context_width(d, n) - d)], 2)
    fold = W_O @ (W_V @ R.transpose(1, 2))  # W^O (R W^Vᵀ)ᵀ = W^O W^V Rᵀ: [K, d, n]
    return torch.cat([W_O, fold, zero.expand(K, d, context_width(d, n) - d - n)], 2)


def low_precision(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in the dtype autocast gives matmuls (unchanged outside autocast): one cast
    for all layers, none in each layer's GEMM."""
    t = tensors[0]
    return [x.to(_matmul_dtype(t.device, t.dtype)) for x in tensors]


def single_head_weights(blocks, bias: bool, value: bool) -> list[LayerWeights]:
    """The single-head layers' W^P, b^P and W^F (module docstring), every layer in one batched
    op each; computed in the parameters' dtype, then cast once to autocast's."""
    attention = [block.attention for block in blocks]
    with without_autocast(blocks[0].output.weight.device):
        W_P, b_P, W_V, R = projection_weights(attention, bias)
        W_O = _stack(blocks, "output.weight")
        W_F = folded_output(W_O, W_V, R if value else None, attention[0].n)
    W_P, b_P, W_F = low_precision(W_P, b_P, W_F)
    return [
        LayerWeights({"projection": (w, b)}, f)
        for w, b, f in zip(W_P.unbind(0), b_P.unbind(0), W_F.unbind(0), strict=True)
    ]


__all__ = [
    "LayerWeights",
    "folded_output",
    "layer_weights",
    "low_precision",
    "projection_weights",
    "single_head_weights",
    "without_autocast",
]
