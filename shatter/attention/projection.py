"""The single-head layer's projections P = x [W^Q; W^V; R W^Q]^T (one GEMM: c = Q R^T exactly,
since K = X, §3.2-3.3), the views every impl takes of P's columns, and the layer's context
[X̄ | A_part | 1 | 0] that the block's folded W^O reads (shatter/attention/layer_weights.py). Their own
module: the impls registry and the Triton layer both use them."""

from __future__ import annotations

import torch


def aligned(n: int) -> int:
    """n rounded up to a multiple of 16 elements: the row widths of the layer's buffers that the
    Triton kernels and cuBLAS read (aligned rows for vector loads and tensor-core GEMMs)."""
    return -(-n // 16) * 16


def projection_width(d: int, n: int, bias: bool = True) -> int:
    """Columns of the layer's projections P = [Q | V | c]: 2d, plus, with the partition bias, c's
    n columns padded with zeros to a multiple of 16, so that P's rows (and V's and c's, which the
    Triton kernels read) stay aligned for vector loads."""
    return 2 * d + (aligned(n) if bias else 0)


def context_width(d: int, n: int) -> int:
    """Columns of the layer's context [X̄ | A_part | 1 | 0]: d, then A_part's n columns, then a
    column of ones and zeros up to a multiple of 16, so that the context's rows (which the
    Triton kernels write and read, and the folded W^O's GEMM reads, layer_weights.py) stay
    aligned. The folded W^O keeps the output bias in the ones' column: its GEMM adds the bias,
    and that column of its weight gradient is the bias gradient (no reduction of its own)."""
    return d + aligned(n + 1)


# Columns appended to a projection's input under torch.compile (`gemm_input`): one of ones, then
# zeros keeping its rows 16-byte aligned (cuBLAS reads them as its leading dimension)
ONES = 8


def gemm_input(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """The input a projection with a bias saves for its weight gradient: compiled, [x | 1 | 0]
    (x with a column of ones and ONES - 1 of zeros; inductor has x's producer, the LayerNorm
    before it, write x into it, and the ones in a small kernel), so that dYᵀ [x | 1 | 0] has
    the bias gradient (dY's column sums) in the ones' column: the GEMM sums it as it goes, where
    the bias gradient apart is a reduction over the tokens of its own; eagerly (a copy there),
    x itself."""
    if not (bias and torch.compiler.is_compiling()):
        return x
    first = torch.arange(ONES, device=x.device) == 0
    return torch.cat([x, first.to(x.dtype).expand(*x.shape[:-1], ONES)], -1)


def project(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b from a `gemm_input` x (its first W.shape[1] columns: strided rows, cuBLAS's
    leading dimension), as [..., p]."""
    x2 = x.reshape(-1, x.shape[-1])[:, : W.shape[1]]
    out = torch.addmm(b, x2, W.t()) if b is not None else x2 @ W.t()
    return out.view(*x.shape[:-1], -1)


def weight_grads(dYs: list[torch.Tensor], x: torch.Tensor, d: int, bias: bool):
    """(dW, db) of `project` from the gradients of its output's column blocks, dYs ([T, p_i]
    each: W's rows, block by block), and its saved `gemm_input` x: one GEMM a block over
    [x | 1 | 0], written side by side (db the ones' column: views, no copy), or dYᵀ x a block
    and dY's column sums."""
    x2 = x.reshape(-1, x.shape[-1])
    both = _joined([dY.t() @ x2 for dY in dYs])
    if x.shape[-1] > d:  # [p, d + ONES]: [dW | db | 0]
        return both[:, :d], both[:, d]
    return both, (_joined([dY.sum(0) for dY in dYs]) if bias else None)


def _joined(blocks: list[torch.Tensor]) -> torch.Tensor:
    """The blocks stacked along their first dimension: one block itself (a cat would copy it)."""
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


class ProjectWithKeys(torch.autograd.Function):
    """(P = X Wᵀ + b, the keys X itself) for the single-head layer, whose keys are its input
    (K = X, §3.2): X's gradient is the keys' gradient plus dP W in one GEMM (β = 1 on the keys'
    gradient, the attention's dX = dSᵀ Q), not a GEMM and then a d-wide add of the two; W's
    and b's gradients are `weight_grads`'."""

    @staticmethod
    def forward(ctx, X, W, b):
        X1 = gemm_input(X, b is not None)
        ctx.save_for_backward(X1, W)
        ctx.has_bias = b is not None
        keys = X1[..., : X.shape[-1]] if X1 is not X else X.view_as(X)  # compiled: X1's view
        return project(X1, W, b), keys

    @staticmethod
    def backward(ctx, dP, g_keys):
        X1, W = ctx.saved_tensors
        d = W.shape[1]
        dP2 = dP.reshape(-1, dP.shape[-1])
        dX = dW = db = None
        if ctx.needs_input_grad[0]:
            dX = dP2 @ W if g_keys is None else torch.addmm(g_keys.reshape(-1, d), dP2, W)
            dX = dX.view(*X1.shape[:-1], d)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dW, db = weight_grads([dP2], X1, d, ctx.has_bias)
        return dX, dW, db


def project_with_keys(X: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None):
    """(P, keys) of ProjectWithKeys."""
    return ProjectWithKeys.apply(X, W, b)


def projection_views(P: torch.Tensor, d: int, n: int):
    """(Q [B, L, d], V [B, n, L, d/n], c [B, L, n] or None): views of P's columns, no copy; one
    split, so that autograd gathers their gradients into dP with one cat."""
    Q, V, *c = P.split([d, d, P.shape[-1] - 2 * d] if P.shape[-1] > 2 * d else [d, d], -1)
    return Q, V.unflatten(-1, (n, d // n)).transpose(1, 2), c[0][..., :n] if c else None


def new_context(X: torch.Tensor, n: int, fill_alignment: bool = True) -> torch.Tensor:
    """A context [B, L, context_width] for X [B, L, d]: X̄'s parts side by side, then A_part
    (both left empty), then its alignment columns, filled (`fill_alignment`): the ones the
    folded W^O's bias column meets, then zeros, so that its zero columns meet zeros, not
    whatever the allocator left (a NaN times 0 is NaN). `fill_alignment` False: the caller's
    kernel writes them itself (no launch of its own)."""
    d = X.shape[-1]
    out = X.new_empty(*X.shape[:-1], context_width(d, n))
    if fill_alignment:
        out[..., d + n + 1 :].zero_()
        out[..., d + n].fill_(1)
    return out


def context_views(out: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X̄ [B, n, L, d/n], A_part [B, L, n]): views of the context out = [X̄ | A_part | 1 | 0]
    (eq. 3: X̄'s part h in columns h d/n .. (h + 1) d/n)."""
    d = out.shape[-1] - aligned(n + 1)
    return out[..., :d].unflatten(-1, (n, d // n)).transpose(1, 2), out[..., d : d + n]


def write_context(out: torch.Tensor, x_bar: torch.Tensor, a_part: torch.Tensor):
    """X̄ and A_part copied into the context `out` (autograd records the copies): for the impls
    that compute them elsewhere. Returns their views in `out`."""
    n = a_part.shape[-1]
    for i, value in enumerate((x_bar, a_part)):
        context_views(out, n)[i].copy_(value)  # a view made after the previous copy
    return context_views(out, n)


def gather_projections(Q: torch.Tensor, V: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """P = [Q | V | c | 0] [B, L, projection_width] from separate Q [B, L, d], V [B, n, L, d/n]
    and c [B, L, n] or None (a copy): for the impls that work on the layer's P, called with the
    impls' common signature."""
    B, L, d = Q.shape
    columns = [Q, V.transpose(1, 2).reshape(B, L, d)]
    if c is not None:
        pad = projection_width(d, c.shape[-1]) - 2 * d - c.shape[-1]
        columns += [c, c.new_zeros(B, L, pad)]
    return torch.cat(columns, -1)


def padded(L: int) -> int:
    """A row length of l x l score buffers: the keys rounded up to a multiple of 16 (aligned rows
    for cuBLAS's tensor-core GEMMs and the kernels' vector loads)."""
    return aligned(L)


def parts_layout(B: int, L: int, n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """A new [B, n, L, k] tensor stored as [B, L, n, k]: X̄ (and dV) in the layout of the
    [B, L, d] context (and of V as single_head.py views it), so that no transpose copies it."""
    return like.new_empty(B, L, n, k).transpose(1, 2)


def context(x_bar: torch.Tensor, a_part: torch.Tensor) -> torch.Tensor:
    """The layer's context [X̄ | A_part | 1 | 0] ([B, L, context_width]) from X̄ [B, n, L, d/n]
    and A_part [B, L, n] computed apart: one cat (its backward only views), for the ops that do
    not write into a context of their own."""
    B, n, L, k = x_bar.shape
    ones = a_part.new_ones(()).expand(B, L, 1)
    zeros = a_part.new_zeros(()).expand(B, L, aligned(n + 1) - n - 1)
    return torch.cat([x_bar.transpose(1, 2).reshape(B, L, n * k), a_part, ones, zeros], -1)


__all__ = [
    "ProjectWithKeys",
    "aligned",
    "context",
    "context_views",
    "context_width",
    "gather_projections",
    "new_context",
    "padded",
    "parts_layout",
    "project_with_keys",
    "projection_views",
    "projection_width",
    "write_context",
]
