"""The single-head layer's projections P = x [W^Q; W^V; R W^Q]^T (one GEMM: c = Q R^T exactly,
since K = X, §3.2-3.3), the views every impl takes of P's columns, and the layer's context
[X̄ | A_part] that the block's folded W^O reads (shatter/attention/layer_weights.py). Their own
module: the impls registry and the Triton layer both use them."""

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


def new_context(X: torch.Tensor, n: int) -> torch.Tensor:
    """An empty context [B, L, d + n] for X [B, L, d]: X̄'s parts side by side, then A_part."""
    return X.new_empty(*X.shape[:-1], X.shape[-1] + n)


def context_views(out: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(X̄ [B, n, L, d/n], A_part [B, L, n]): views of the context out = [X̄ | A_part] (eq. 3:
    X̄'s part h in columns h d/n .. (h + 1) d/n)."""
    d = out.shape[-1] - n
    return out[..., :d].unflatten(-1, (n, d // n)).transpose(1, 2), out[..., d:]


def write_context(out: torch.Tensor, x_bar: torch.Tensor, a_part: torch.Tensor):
    """X̄ and A_part copied into the context `out` (autograd records the copies): for the impls
    that compute them elsewhere. Returns their views in `out`."""
    n = a_part.shape[-1]
    for i, value in enumerate((x_bar, a_part)):
        context_views(out, n)[i].copy_(value)  # a view made after the previous copy
    return context_views(out, n)


__all__ = [
    "context_views",
    "new_context",
    "projection_views",
    "projection_width",
    "write_context",
]
