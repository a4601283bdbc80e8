"""Memory-lean partition mixing for the single-head archs.

The naive form of eq. 5 (and §3.3) broadcasts the single score matrix A (l x l) against the
constant partition mask N (n x l x l) into the tensor A[h] = A ⊙ N[h] and keeps it for the
backward pass: as much memory as BERT's n heads. But the scores are single-headed, so the
backward pass only needs the l x l pre-activation scores Z0 = Q X^T / sqrt(d); everything
else is recomputed:

    Z    = Z0 + B,        B[i, :] = sum_h (Q R^T)[i, h] N[h, i, :]          (§3.3, part-bias)
    A    = normalize2(sigmoid(Z) ⊙ m)   or   softmax(Z, keys m)              (eq. 5 / 1h-softmax)
    X_bar[h] = (A ⊙ N[h]) V[h]                                              (eq. 2 with eq. 5)
    A_part[i, h] = sum_j (A ⊙ N[h])[i, j]                                   (§3.3, A_part^T)

N[h, i, j] = f_h(j - i) is Toeplitz, so every sum over h or j against it is a small matmul
with the (n, 2l - 1) table T in relative coordinates: B = skew(c T) and A_part = unskew(A) T^T,
where skew maps G[i, r] to G[i, j - i + l - 1] as a zero-copy strided view (the Transformer-XL
"relative shift"). Only X_bar needs A ⊙ N[h] itself; it is formed in chunks of parts, each
chunk one batched matmul, and freed at once. N is indexed from the layer's table chunk by
chunk, never stored whole. `tests/shatter/test_model_lean.py` checks this against the naive reference.
"""

from __future__ import annotations

import torch

from shatter.attention.multihead import masked_softmax
from shatter.attention.projection import context_views
from shatter.partition import partition_mask

NORM_EPS = 1e-12  # as F.normalize
CHUNK_ELEMENTS = 1 << 24  # transient A ⊙ N[h0:h1] per chunk: at most 16M floats (64 MB fp32)


def table_window(table: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """T[:, r] = f_h(r - (L - 1)) for r in 0..2L-2: the columns of the table that length L uses."""
    m = (table.shape[1] + 1) // 2
    return table[:, m - L : m + L - 1].to(dtype)


def skew(G: torch.Tensor, i0: int = 0) -> torch.Tensor:
    """[B, r, 2L-1] relative -> [B, r, L] absolute view of rows i0..i0+r-1 (all of them when
    r = L, i0 = 0): out[b, t, j] = G[b, t, j - (i0 + t) + L - 1]."""
    G = G.contiguous()
    B, r, W = G.shape
    L = (W + 1) // 2
    # the view starts at G[:, 0, L - 1 - i0]: as_strided keeps the slice's storage offset, which
    # Dynamo cannot read as a number (storage_offset(): a graph break in every layer)
    return G[:, :, L - 1 - i0 :].as_strided((B, r, L), (r * W, W - 1, 1))


def unskew(X: torch.Tensor, i0: int = 0) -> torch.Tensor:
    """[B, r, L] absolute rows i0.. -> [B, r, 2L-1] relative (zeros where j - i is outside)."""
    B, r, L = X.shape
    W = 2 * L - 1
    if L == 1:  # rows W - 1 = 0 apart: G is X
        return X.clone()
    flat = X.new_zeros(B, r * W + L)
    # X[:, t] goes to G[:, t] from column L - 1 - i0 - t: one run of rows W - 1 apart in the
    # flat buffer, written through slices and views (torch.compile cannot functionalize a write
    # through skew's as_strided)
    start = L - 1 - i0
    flat[:, start : start + r * (W - 1)].view(B, r, W - 1)[:, :, :L].copy_(X)
    return flat[:, : r * W].view(B, r, W)


def activate(Z: torch.Tensor, mask_BL: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """Row-wise attention weights with padded keys at 0: eq. 5's L2-normalised sigmoid (the
    padded keys are zeroed before the normalisation) or a masked softmax."""
    if sigmoid:
        P = torch.sigmoid(Z) * mask_BL[:, None, :]
        return P / P.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return masked_softmax(Z, mask_BL)


def _chunks(n: int, B: int, L: int):
    step = max(1, min(n, CHUNK_ELEMENTS // max(1, B * L * L)))
    return [(h, min(n, h + step)) for h in range(0, n, step)]


def _parts(table: torch.Tensor, h0: int, h1: int, L: int, dtype: torch.dtype) -> torch.Tensor:
    """N[h0:h1] for length L, indexed per chunk so that the whole [n, L, L] N never exists at once."""
    return partition_mask(table[h0:h1], L).to(dtype)


def _scores(Z0, c, T):
    return Z0 if c is None else Z0 + skew(c @ T)  # Z0 + B (§3.3)


class PartitionMix(torch.autograd.Function):
    """(Z0 [B,L,L], c [B,L,n] or None, V [B,n,L,k], mask [B,L], table [n,2m-1], sigmoid, out) ->
    (X_bar [B,n,L,k], A_part [B,L,n]), or with the context `out` [B, L, context_width] given, `out`
    holding both (projection.context_views); saves only Z0, c, V and the mask."""

    @staticmethod
    def forward(ctx, Z0, c, V, mask_BL, table, sigmoid: bool, out=None):
        B, L, _ = Z0.shape
        T = table_window(table, L, Z0.dtype)
        A = activate(_scores(Z0, c, T), mask_BL, sigmoid)
        x_bar, part = context_views(out, table.shape[0]) if out is not None else (None, None)
        x_bar = torch.empty_like(V) if x_bar is None else x_bar
        for h0, h1 in _chunks(table.shape[0], B, L):
            x_bar[:, h0:h1] = (A[:, None] * _parts(table, h0, h1, L, Z0.dtype)) @ V[:, h0:h1]
        a_part = unskew(A) @ T.t()
        ctx.save_for_backward(Z0, c, V, mask_BL, table)
        ctx.sigmoid, ctx.wide = sigmoid, out is not None
        ctx.set_materialize_grads(False)
        if out is None:
            return x_bar, a_part
        part.copy_(a_part)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        Z0, c, V, mask_BL, table = ctx.saved_tensors
        g_out, g_part = output_grads(grads, ctx.wide, table.shape[0])
        B, L, _ = Z0.shape
        T = table_window(table, L, Z0.dtype)
        Z = _scores(Z0, c, T)
        A = activate(Z, mask_BL, ctx.sigmoid)
        # the A_part term: dL/dA[i, j] = sum_h g_part[i, h] N[h, i, j] = skew(g_part T)
        gA = skew(g_part @ T).contiguous() if g_part is not None else torch.zeros_like(A)
        gV = torch.zeros_like(V) if g_out is not None and ctx.needs_input_grad[2] else None
        if g_out is not None:
            g_out = g_out.contiguous()  # autograd may hand in an expanded or transposed view
            for h0, h1 in _chunks(table.shape[0], B, L):
                Nh = _parts(table, h0, h1, L, Z0.dtype)
                if gV is not None:
                    gV[:, h0:h1] = (A[:, None] * Nh).transpose(-1, -2) @ g_out[:, h0:h1]
                G = g_out[:, h0:h1] @ V[:, h0:h1].transpose(-1, -2)  # dL/d(A ⊙ N[h]): [B, h, L, L]
                gA += G.mul_(Nh).sum(1)
        dot = (gA * A).sum(-1, keepdim=True)
        if ctx.sigmoid:
            # A = P / |P|, P = sigmoid(Z) ⊙ m: dP = (dA - A <dA, A>) / |P|, dZ = dP ⊙ m ⊙ s (1 - s)
            s = torch.sigmoid(Z)
            keep = mask_BL[:, None, :]
            norm = (s * keep).norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
            gZ = (gA - A * dot).div_(norm).mul_(keep).mul_(s * (1 - s))
        else:
            gZ = A * (gA - dot)
        gc = unskew(gZ) @ T.t() if c is not None and ctx.needs_input_grad[1] else None
        return gZ, gc, gV, None, None, None, None


def output_grads(grads, wide: bool, n: int):
    """(dX̄, dA_part) as autograd hands them in: two, or one for the context [X̄ | A_part]
    (None for an output that reached nothing)."""
    if not wide:
        return grads
    return (None, None) if grads[0] is None else context_views(grads[0], n)


def partition_mix_lean(Z0, c, V, mask_BL, table, sigmoid: bool, out=None):
    """(X̄, A_part); with the context `out` given, written into it (their views in `out`)."""
    if out is None:
        return PartitionMix.apply(Z0, c, V, mask_BL, table, sigmoid, None)
    return context_views(PartitionMix.apply(Z0, c, V, mask_BL, table, sigmoid, out), V.shape[1])


def partition_mix_naive(Z0, c, V, mask_BL, table, sigmoid: bool):
    """The reference: materialises N and A ⊙ N as [B, n, L, L] and lets autograd keep them."""
    N = partition_mask(table, Z0.shape[-1]).to(Z0.dtype)
    Z = Z0 if c is None else Z0 + torch.einsum("bih,hij->bij", c, N)
    A_BNLL = activate(Z, mask_BL, sigmoid)[:, None] * N[None]
    return A_BNLL @ V, A_BNLL.sum(-1).transpose(1, 2)
