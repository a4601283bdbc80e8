"""`attention_impl: chunked`: the single-head partition attention over row blocks, through cuBLAS.

For GPUs that the Triton kernel does not serve (V100, sm_70: Triton emits no tensor-core code
below sm_80) and as a portable fallback. Every product is a `torch.matmul` (cuBLAS in fp16/bf16,
tensor cores), taken over blocks of r query rows against all l keys, so that no l x l score
matrix, and no n x l x l tensor A ⊙ N, is ever stored. For a block of rows i:

    Z    = Q_i X^T / sqrt(d)                                              eq. 5 (K = X, §3.2)
    B_ij = sum_h c_ih f_h(j - i),  c = Q R^T                              §3.3 (part-bias, shatter)
    P    = sigmoid(Z + B) ⊙ m,  A = P / |P_i|    or    A = softmax(Z, keys m)
    X_bar[h]_i  = (A ⊙ N[h])_i V[h]         one matmul batched over the n parts    eq. 2-3
    A_part[i, h] = sum_j (A ⊙ N[h])_ij                                    §3.3, A_part^T

N[h, i, j] = f_h(j - i) for the block's rows is gathered from the layer's (n, 2m - 1) table for
X_bar only; B and A_part (and their gradients) are small matmuls against the table window T in
relative coordinates, B = skew(c T) and A_part = unskew(A) T^T, as `lean` takes them, so that no
[B, r, n, L] broadcast is ever copied.
The 1/√d is applied on the scores GEMM's fp32 accumulator (no scaled copy of Q), and X̄ is written
in the layout of the [B, L, d] context, so that the layer's context is a view of it. The forward
keeps only Q, X, V, c, the mask and one statistic per row: |P_i| (sigmoid) or the
logsumexp of the masked scores (softmax). The backward recomputes each block's A from them and
takes the row term <dL/dA_i, A_i> inside the block, where the rows are whole. Each block's
dL/dZ goes, in the input dtype, into one [B, L, L] buffer, and dQ = dZ X, dX = dZ^T Q are two
GEMMs at the end (cuBLAS accumulates in fp32), instead of d-wide fp32 sums updated per block.

Block size: the largest transient per block is the [B, n, r, l] tensor A ⊙ N (and, in the
backward, dL/d(A ⊙ N)); r is chosen so that it holds at most `BLOCK_ELEMENTS` (16M) elements,
rounded down to a multiple of 16 rows (tensor-core tiles), at least one row. At BERT-base width
(n = 12) with B x l = 32 x 512 that is r = 80; the backward's peak is about three such tensors.
"""

from __future__ import annotations

import math

import torch

from shatter.attention.lean import NORM_EPS, output_grads, skew, table_window, unskew
from shatter.attention.projection import context_views

BLOCK_ELEMENTS = 1 << 24  # transient [B, n, r, L] per row block: at most 16M elements


def block_rows(B: int, n: int, L: int) -> int:
    """Rows per block so that a [B, n, r, L] tensor stays within BLOCK_ELEMENTS elements."""
    r = max(1, min(L, BLOCK_ELEMENTS // max(1, B * n * L)))
    return r - r % 16 if r >= 32 else r


def _parts(table: torch.Tensor, i0: int, i1: int, L: int, dtype: torch.dtype) -> torch.Tensor:
    """N[:, i0:i1, :] = f_h(j - i) for the block's rows: [n, r, L]."""
    m = (table.shape[1] + 1) // 2
    j = torch.arange(L, device=table.device)
    i = torch.arange(i0, i1, device=table.device)
    return table[:, j[None, :] - i[:, None] + m - 1].to(dtype)


def _scores(Q, X, c, T, i0, i1, scale):
    """Z + B for rows i0:i1 in T's dtype (float32 or wider): [B, r, L]."""
    # the 1/√d on the GEMM's fp32 accumulator: no scaled copy of Q, no fp16 overflow
    Q = Q[:, i0:i1]
    Z = torch.baddbmm(Q.new_empty(()).expand(*Q.shape[:2], X.shape[1]), Q, X.transpose(-1, -2), beta=0.0, alpha=scale)  # fmt: skip
    Z = Z.to(T.dtype)
    if c is not None:  # B_ij = sum_h c_ih f_h(j - i) = skew(c T), §3.3
        Z += skew(c[:, i0:i1].to(T.dtype) @ T, i0)
    return Z


def _weights(S, keep, stat, sigmoid: bool):
    """A from the scores and the saved row statistic (|P_i| or logsumexp)."""
    if sigmoid:
        return torch.sigmoid(S) * keep / stat[..., None]
    return torch.exp(S - stat[..., None]) * keep


class ChunkedPartitionAttention(torch.autograd.Function):
    """(Q [B,L,d], X [B,L,d], V [B,n,L,k], c [B,L,n] or None, mask [B,L], table [n,2m-1],
    sigmoid, out) -> (X_bar [B,n,L,k], A_part [B,L,n]), or with the context `out` [B, L, context_width]
    given, `out` holding both (projection.context_views); saves Q, X, V, c, the mask and [B, L]
    row statistics."""

    @staticmethod
    def forward(ctx, Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
        B, L, d = Q.shape
        n = V.shape[1]
        acc = torch.promote_types(Q.dtype, torch.float32)  # pointwise work and statistics
        scale = 1.0 / math.sqrt(d)
        keep = mask_BL[:, None, :].to(acc)
        Xq = X.to(Q.dtype)  # the matmul dtype (a no-op unless the caller mixes precisions)
        Vc = V.contiguous()  # once: a strided V would be copied by every block's matmul
        T = table_window(table, L, acc)
        x_bar, part = _outputs(V, out)
        stat = torch.empty(B, L, dtype=acc, device=Q.device)
        with torch.autocast(Q.device.type, enabled=False):
            for i0 in range(0, L, r := block_rows(B, n, L)):
                i1 = min(L, i0 + r)
                S = _scores(Q, Xq, c, T, i0, i1, scale)
                if sigmoid:  # eq. 5: padded keys zeroed before the L2 normalisation
                    s = stat[:, i0:i1] = (torch.sigmoid(S) * keep).norm(dim=-1).clamp_min(NORM_EPS)
                else:  # a row with no real key (a sequence of padding only) gets A = 0
                    s = S.masked_fill(keep == 0, -math.inf).logsumexp(-1)
                    s = stat[:, i0:i1] = s.masked_fill(s == -math.inf, 0.0)
                A = _weights(S, keep, s, sigmoid)
                del S
                N = _parts(table, i0, i1, L, V.dtype)
                AN = A.to(V.dtype)[:, None] * N[None]  # A ⊙ N[h]: [B, n, r, L]
                x_bar[:, :, i0:i1] = AN @ Vc
                del AN
                part[:, i0:i1] = unskew(A, i0) @ T.t()  # A_part = unskew(A) T^T
        ctx.save_for_backward(Q, X, V, c, mask_BL, table, stat)
        ctx.sigmoid, ctx.wide = sigmoid, out is not None
        ctx.set_materialize_grads(False)
        if out is None:
            return x_bar, part
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        Q, X, V, c, mask_BL, table, stat = ctx.saved_tensors
        B, L, d = Q.shape
        n = V.shape[1]
        g_out, g_part = output_grads(grads, ctx.wide, n)
        acc = stat.dtype
        scale = 1.0 / math.sqrt(d)
        keep = mask_BL[:, None, :].to(acc)
        Xq = X.to(Q.dtype)
        Vc = V.contiguous()
        T = table_window(table, L, acc)
        need_q, need_x, need_v, need_c = ctx.needs_input_grad[:4]
        gV = (
            torch.zeros(V.shape, dtype=acc, device=V.device)
            if need_v and g_out is not None
            else None
        )
        gc = torch.empty(B, L, n, dtype=acc, device=Q.device) if c is not None and need_c else None
        gZ = torch.empty(B, L, L, dtype=Q.dtype, device=Q.device) if need_q or need_x else None
        if g_out is not None:
            g_out = g_out.contiguous()  # autograd may hand in an expanded or transposed view
        with torch.autocast(Q.device.type, enabled=False):
            for i0 in range(0, L, r := block_rows(B, n, L)):
                i1 = min(L, i0 + r)
                S = _scores(Q, Xq, c, T, i0, i1, scale)
                A = _weights(S, keep, stat[:, i0:i1], ctx.sigmoid)
                # dL/dA = sum_h N[h] ⊙ (g_out[h] V[h]^T) + skew(g_part T) (A_part's term)
                if g_out is not None:
                    N = _parts(table, i0, i1, L, acc)
                    if gV is not None:
                        AN = A.to(V.dtype)[:, None] * N[None].to(V.dtype)
                        gV += AN.transpose(-1, -2) @ g_out[:, :, i0:i1]
                        del AN
                    G = (g_out[:, :, i0:i1] @ Vc.transpose(-1, -2)).to(acc)
                    gA = G.mul_(N).sum(1)
                    del G, N
                else:
                    gA = torch.zeros_like(A)
                if g_part is not None:
                    gA += skew(g_part[:, i0:i1].to(acc) @ T, i0)
                dot = (gA * A).sum(-1, keepdim=True)  # the row term; rows are whole in a block
                if ctx.sigmoid:  # A = P/|P|: dP = (dA - A <dA, A>)/|P|, dS = dP ⊙ m ⊙ s(1 - s)
                    s = torch.sigmoid(S)
                    gS = (gA - A * dot).div_(stat[:, i0:i1, None]).mul_(keep).mul_(s * (1 - s))
                else:
                    gS = A * (gA - dot)
                if gc is not None:  # dL/dc_ih = sum_j dS_ij f_h(j - i) = unskew(dS) T^T
                    gc[:, i0:i1] = unskew(gS, i0) @ T.t()
                if gZ is not None:
                    gZ[:, i0:i1] = gS.mul_(scale)
        gQ = gZ @ Xq if need_q else None  # dQ = dZ X / sqrt(d)
        gX = gZ.transpose(-1, -2) @ Q if need_x else None  # dX = dZ^T Q / sqrt(d) (keys)

        def cast(g, like):
            return None if g is None else g.to(like.dtype)

        return cast(gQ, Q), cast(gX, X), cast(gV, V), cast(gc, c), None, None, None, None


def _outputs(V: torch.Tensor, out: torch.Tensor | None):
    """(X̄, A_part) to write: views of the context `out`, or X̄ stored as [B, L, n, d/n] (the
    context [B, L, d] is a view of it) and its own A_part."""
    if out is not None:
        return context_views(out, V.shape[1])
    B, n, L, k = V.shape
    return V.new_empty(B, L, n, k).transpose(1, 2), V.new_empty(B, L, n)


def partition_attention_chunked(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    """(X̄, A_part); with the context `out` given, written into it (their views in `out`)."""
    if out is None:
        return ChunkedPartitionAttention.apply(Q, X, V, c, mask_BL, table, sigmoid)
    out = ChunkedPartitionAttention.apply(Q, X, V, c, mask_BL, table, sigmoid, out)
    return context_views(out, V.shape[1])
