"""The single-head layer's projections P = x [W^Q; W^V; R W^Q]^T (one GEMM: c = Q R^T exactly,
since K = X, §3.2-3.3), the views every impl takes of P's columns, and the context it returns.
Their own module: the impls registry and the Triton layer both use them."""

from __future__ import annotations

import torch


def projection_width(d: int, n: int, bias: bool = True) -> int:
    """Columns of the layer's projections P = [Q | V | c]: 2d, plus, with the partition bias, c's
    n columns padded with zeros to a multiple of 16, so that P's rows (and V's and c's, which the
    Triton kernels read) stay aligned for vector loads."""
    return 2 * d + (-(-n // 16) * 16 if bias else 0)


def projection_views(P: torch.Tensor, d: int, n: int):
    """(Q [B, L, d], V [B, n, L, d/n], c [B, L, n] or None): views of P's columns, no copy; one
    split, so that autograd gathers their gradients into dP with one cat."""
    Q, V, *c = P.split([d, d, P.shape[-1] - 2 * d] if P.shape[-1] > 2 * d else [d, d], -1)
    return Q, V.unflatten(-1, (n, d // n)).transpose(1, 2), c[0][..., :n] if c else None


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
    return -(-L // 16) * 16


def parts_layout(B: int, L: int, n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """A new [B, n, L, k] tensor stored as [B, L, n, k]: X̄ (and dV) in the layout of the
    [B, L, d] context (and of V as single_head.py views it), so that no transpose copies it."""
    return like.new_empty(B, L, n, k).transpose(1, 2)


def context(x_bar: torch.Tensor, a_part: torch.Tensor, v_part: torch.Tensor | None):
    """The layer's context [B, L, d]: X̄'s parts side by side (eq. 3; a view when X̄ is stored
    in that layout), plus A_part V_part (§3.3) when `v_part` [n, d] is given."""
    B, n, L, k = x_bar.shape
    out = x_bar.transpose(1, 2).reshape(B, L, n * k)
    return out if v_part is None else out + a_part @ v_part


__all__ = [
    "context",
    "gather_projections",
    "padded",
    "parts_layout",
    "projection_views",
    "projection_width",
]
