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

N[h, i, j] = f_h(j - i) for the block's rows is gathered from the layer's (n, 2m - 1) table.
The forward keeps only Q, X, V, c, the mask and one statistic per row: |P_i| (sigmoid) or the
logsumexp of the masked scores (softmax). The backward recomputes each block's A from them and
takes the row term <dL/dA_i, A_i> inside the block, where the rows are whole.

Block size: the largest transient per block is the [B, n, r, l] tensor A ⊙ N (and, in the
backward, dL/d(A ⊙ N)); r is chosen so that it holds at most `BLOCK_ELEMENTS` (16M) elements,
rounded down to a multiple of 16 rows (tensor-core tiles), at least one row. At BERT-base width
(n = 12) with B x l = 32 x 512 that is r = 80; the backward's peak is about three such tensors.
"""

from __future__ import annotations

import math

import torch

from shatter.attention.lean import NORM_EPS

BLOCK_ELEMENTS = 1 << 24  # transient [B, n, r, l] per row block: at most 16M elements


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


def _scores(Q, X, c, N, i0, i1, scale):
    """Z + B for rows i0:i1 in float32 or wider: [B, r, L]."""
    Z = ((Q[:, i0:i1] * scale) @ X.transpose(-1, -2)).to(N.dtype)  # scaled first: no fp16 overflow
    if c is not None:  # B_ij = sum_h c_ih N[h, i, j]: [B, r, 1, n] @ [r, n, L]
        Z = Z + (c[:, i0:i1, None, :].to(N.dtype) @ N.transpose(0, 1)).squeeze(-2)
    return Z


def _per_part(M, N):
    """sum_j M[b, i, j] N[h, i, j] -> [B, r, n] without a [B, n, r, L] temporary."""
    return (M[:, :, None, :] @ N.permute(1, 2, 0)).squeeze(-2)


def _weights(S, keep, stat, sigmoid: bool):
    """A from the scores and the saved row statistic (|P_i| or logsumexp)."""
    if sigmoid:
        return torch.sigmoid(S) * keep / stat[..., None]
    return torch.exp(S - stat[..., None]) * keep


class ChunkedPartitionAttention(torch.autograd.Function):
    """(Q [B,L,d], X [B,L,d], V [B,n,L,k], c [B,L,n] or None, mask [B,L], table [n,2m-1]) ->
    (X_bar [B,n,L,k], A_part [B,L,n]); saves Q, X, V, c, the mask and [B, L] row statistics."""

    @staticmethod
    def forward(ctx, Q, X, V, c, mask_BL, table, sigmoid: bool):
        B, L, d = Q.shape
        n = V.shape[1]
        acc = torch.promote_types(Q.dtype, torch.float32)  # pointwise work and statistics
        scale = 1.0 / math.sqrt(d)
        keep = mask_BL[:, None, :].to(acc)
        Xq = X.to(Q.dtype)  # the matmul dtype (a no-op unless the caller mixes precisions)
        out = V.new_empty(V.shape)
        part = torch.empty(B, L, n, dtype=V.dtype, device=V.device)
        stat = torch.empty(B, L, dtype=acc, device=Q.device)
        with torch.autocast(Q.device.type, enabled=False):
            for i0 in range(0, L, r := block_rows(B, n, L)):
                i1 = min(L, i0 + r)
                N = _parts(table, i0, i1, L, acc)
                S = _scores(Q, Xq, c, N, i0, i1, scale)
                if sigmoid:  # eq. 5: padded keys zeroed before the L2 normalisation
                    s = stat[:, i0:i1] = (torch.sigmoid(S) * keep).norm(dim=-1).clamp_min(NORM_EPS)
                else:  # a row with no real key (a sequence of padding only) gets A = 0
                    s = S.masked_fill(keep == 0, -math.inf).logsumexp(-1)
                    s = stat[:, i0:i1] = s.masked_fill(s == -math.inf, 0.0)
                A = _weights(S, keep, s, sigmoid)
                AN = A[:, None].to(V.dtype) * N[None].to(V.dtype)  # A ⊙ N[h]: [B, n, r, L]
                out[:, :, i0:i1] = AN @ V
                del AN
                part[:, i0:i1] = _per_part(A, N).to(V.dtype)
        ctx.save_for_backward(Q, X, V, c, mask_BL, table, stat)
        ctx.sigmoid = sigmoid
        ctx.set_materialize_grads(False)
        return out, part

    @staticmethod
    def backward(ctx, g_out, g_part):
        Q, X, V, c, mask_BL, table, stat = ctx.saved_tensors
        B, L, d = Q.shape
        n = V.shape[1]
        acc = stat.dtype
        scale = 1.0 / math.sqrt(d)
        keep = mask_BL[:, None, :].to(acc)
        Xq = X.to(Q.dtype)
        need_q, need_x, need_v, need_c = ctx.needs_input_grad[:4]
        gQ = torch.zeros(Q.shape, dtype=acc, device=Q.device) if need_q else None
        gX = torch.zeros(X.shape, dtype=acc, device=X.device) if need_x else None
        gV = (
            torch.zeros(V.shape, dtype=acc, device=V.device)
            if need_v and g_out is not None
            else None
        )
        gc = torch.zeros(B, L, n, dtype=acc, device=Q.device) if c is not None and need_c else None
        if g_out is not None:
            g_out = g_out.contiguous()  # autograd may hand in an expanded or transposed view
        with torch.autocast(Q.device.type, enabled=False):
            for i0 in range(0, L, r := block_rows(B, n, L)):
                i1 = min(L, i0 + r)
                N = _parts(table, i0, i1, L, acc)
                S = _scores(Q, Xq, c, N, i0, i1, scale)
                A = _weights(S, keep, stat[:, i0:i1], ctx.sigmoid)
                # dL/d(A ⊙ N[h]) = g_out[h] V[h]^T + g_part[:, h] (A_part's term), then times N[h]
                if g_out is not None:
                    G = (g_out[:, :, i0:i1] @ V.transpose(-1, -2)).to(acc)
                    if gV is not None:
                        AN = A[:, None].to(V.dtype) * N[None].to(V.dtype)
                        gV += (AN.transpose(-1, -2) @ g_out[:, :, i0:i1]).to(acc)
                        del AN
                else:
                    G = torch.zeros(B, n, i1 - i0, L, dtype=acc, device=Q.device)
                if g_part is not None:
                    G += g_part[:, i0:i1].transpose(1, 2)[..., None].to(acc)
                gA = G.mul_(N).sum(1)
                del G
                dot = (gA * A).sum(-1, keepdim=True)  # the row term; rows are whole in a block
                if ctx.sigmoid:  # A = P/|P|: dP = (dA - A <dA, A>)/|P|, dS = dP ⊙ m ⊙ s(1 - s)
                    s = torch.sigmoid(S)
                    gS = (gA - A * dot).div_(stat[:, i0:i1, None]).mul_(keep).mul_(s * (1 - s))
                else:
                    gS = A * (gA - dot)
                if gc is not None:  # dL/dc_ih = sum_j dS_ij N[h, i, j]
                    gc[:, i0:i1] = _per_part(gS, N)
                gZ = (gS * scale).to(Q.dtype)
                if gQ is not None:
                    gQ[:, i0:i1] = (gZ @ Xq).to(acc)
                if gX is not None:
                    gX += (gZ.transpose(-1, -2) @ Q[:, i0:i1]).to(acc)

        def cast(g, like):
            return None if g is None else g.to(like.dtype)

        return cast(gQ, Q), cast(gX, X), cast(gV, V), cast(gc, c), None, None, None


def partition_attention_chunked(Q, X, V, c, mask_BL, table, sigmoid: bool):
    return ChunkedPartitionAttention.apply(Q, X, V, c, mask_BL, table, sigmoid)
