"""Memory-lean partition mixing for the single-head archs (issue 3 §5).

The naive form of eq. 5 (and §3.3) broadcasts the single score matrix A (l x l) against the
constant partition mask N (n x l x l) into the tensor A[h] = A ⊙ N[h] and keeps it for the
backward pass: as much memory as BERT's n heads. But A's scores are single-headed, so the
backward pass only needs the l x l pre-activation scores Z0 = Q X^T / sqrt(d); everything
else is recomputed:

    Z    = Z0 + B,        B[i, :] = sum_h (Q R^T)[i, h] N[h, i, :]          (§3.3, part-bias)
    A    = normalize2(sigmoid(Z) ⊙ m)   or   softmax(Z, keys m)              (eq. 5 / 1h-softmax)
    X_bar[h] = (A ⊙ N[h]) V[h]                                              (eq. 2 with eq. 5)
    A_part[h, i] = sum_j (A ⊙ N[h])[i, j]                                   (§3.3, A_part^T)

N is never stored: it is indexed per call from the layer's (n, 2 max_len - 1) table, and the
products are taken one part at a time, so the largest transient is a few l x l matrices.
`tests/shatter/test_lean.py` checks this against the naive reference, forward and gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from shatter.partition import partition_mask

NORM_EPS = 1e-12  # as F.normalize


def scores_with_bias(Z0: torch.Tensor, c: Optional[torch.Tensor], N: torch.Tensor) -> torch.Tensor:
    """Z = Z0 + B with B[b, i, j] = sum_h c[b, i, h] N[h, i, j] (c = Q R^T; §3.3)."""
    if c is None:
        return Z0
    Z = Z0.clone()
    for h in range(N.shape[0]):
        Z.addcmul_(c[:, :, h, None], N[h])
    return Z


def activate(Z: torch.Tensor, mask_BL: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """Row-wise attention weights with padded keys at 0: eq. 5's L2-normalised sigmoid (the
    padded keys are zeroed before the normalisation) or a masked softmax."""
    keep = mask_BL[:, None, :]
    if sigmoid:
        P = torch.sigmoid(Z) * keep
        return P / P.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return Z.masked_fill(~keep, torch.finfo(Z.dtype).min).softmax(-1)


class PartitionMix(torch.autograd.Function):
    """(Z0 [B,L,L], c [B,L,n] or None, V [B,n,L,k], mask [B,L], table [n,2m-1]) ->
    (X_bar [B,n,L,k], A_part [B,n,L]); saves only Z0, c, V and the mask."""

    @staticmethod
    def forward(ctx, Z0, c, V, mask_BL, table, sigmoid: bool):
        N = partition_mask(table, Z0.shape[-1]).to(Z0.dtype)
        A = activate(scores_with_bias(Z0, c, N), mask_BL, sigmoid)
        n = N.shape[0]
        out = V.new_empty(V.shape)
        part = Z0.new_empty(Z0.shape[0], n, Z0.shape[1])
        for h in range(n):
            A_h = A * N[h]
            out[:, h] = A_h @ V[:, h]
            part[:, h] = A_h.sum(-1)
        ctx.save_for_backward(Z0, c, V, mask_BL, table)
        ctx.sigmoid = sigmoid
        ctx.set_materialize_grads(False)
        return out, part

    @staticmethod
    def backward(ctx, g_out, g_part):
        Z0, c, V, mask_BL, table = ctx.saved_tensors
        N = partition_mask(table, Z0.shape[-1]).to(Z0.dtype)
        Z = scores_with_bias(Z0, c, N)
        A = activate(Z, mask_BL, ctx.sigmoid)
        gA = torch.zeros_like(A)
        gV = torch.zeros_like(V) if ctx.needs_input_grad[2] else None
        for h in range(N.shape[0]):
            g_h = g_out[:, h] @ V[:, h].transpose(-1, -2) if g_out is not None else torch.zeros_like(A)
            if g_part is not None:
                g_h += g_part[:, h, :, None]
            gA.addcmul_(g_h, N[h])
            if gV is not None and g_out is not None:
                gV[:, h] = (A * N[h]).transpose(-1, -2) @ g_out[:, h]
        dot = (gA * A).sum(-1, keepdim=True)
        if ctx.sigmoid:
            # A = P / |P|, P = sigmoid(Z) ⊙ m: dP = (dA - A <dA, A>) / |P|, dZ = dP ⊙ m ⊙ s (1 - s)
            s = torch.sigmoid(Z)
            norm = (s * mask_BL[:, None, :]).norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
            gZ = (gA - A * dot) / norm * mask_BL[:, None, :] * s * (1 - s)
        else:
            gZ = A * (gA - dot)
        gc = None
        if c is not None and ctx.needs_input_grad[1]:
            gc = torch.stack([(gZ * N[h]).sum(-1) for h in range(N.shape[0])], dim=-1)
        return gZ, gc, gV, None, None, None


def partition_mix_lean(Z0, c, V, mask_BL, table, sigmoid: bool):
    return PartitionMix.apply(Z0, c, V, mask_BL, table, sigmoid)


def partition_mix_naive(Z0, c, V, mask_BL, table, sigmoid: bool):
    """The reference: materialises N and A ⊙ N as [B, n, L, L] and lets autograd keep them."""
    N = partition_mask(table, Z0.shape[-1]).to(Z0.dtype)
    Z = Z0 if c is None else Z0 + torch.einsum("bih,hij->bij", c, N)
    A_BNLL = activate(Z, mask_BL, sigmoid)[:, None] * N[None]
    return A_BNLL @ V, A_BNLL.sum(-1)
