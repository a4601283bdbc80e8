"""The fused Triton partition attention behind `attention_impl="triton"` (eq. 2, 3, 5, §3.3).

`partition_attention_triton(Q, X, V, c, mask, table, sigmoid)` computes what
`lean.partition_mix_lean(Q Xᵀ/√d, c, V, mask, table, sigmoid)` computes, without ever forming an
L x L tensor: the kernels (shatter/kernels/partition_attention.py) recompute score tiles from Q
and X. `sigmoid=True` is eq. 5's L2-normalised sigmoid (1h-sigmoid, part-bias, shatter),
`sigmoid=False` the masked softmax of 1h-softmax. It saves Q, X, V, c, the mask, O(B·L) row
statistics (ρ = 1/‖p‖, or the softmax's maximum and log-sum) and, as FlashAttention-2 does, its
two outputs, from which the backward pass takes the row term δ.

Inputs: Q, X [B, L, d]; V [B, n, L, d/n]; c = Q Rᵀ [B, L, n] or None (1h-sigmoid); mask [B, L]
(1 token, 0 padding); table [n, 2 max_len - 1] (shatter/partition.py). fp16, bf16 or fp32 (fp32
dots in full IEEE precision); n even in 4..16; d ≤ 1024 and divisible by n; L ≤ max_len.
CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import math

import torch
import triton

from shatter.attention.lean import NORM_EPS
from shatter.kernels.partition_attention import (
    INTERPRET,
    MAX_CHUNK,
    MAX_D_CHUNKS,
    MAX_PARTS,
    partition_bwd_dq_kernel,
    partition_bwd_dv_kernel,
    partition_bwd_dx_kernel,
    partition_fwd_kernel,
)


def kernel_meta(d: int, n: int, dtype: torch.dtype) -> dict:
    """The shape-derived compile-time constants the kernels share (tools/kernel_report.py too)."""
    return {
        "N_PARTS": n,
        "BLOCK_K": max(16, triton.next_power_of_2(d // n)),
        "PREC": "ieee" if dtype == torch.float32 else "tf32",
        "NP": max(16, triton.next_power_of_2(n)),
        "DCH": min(MAX_CHUNK, max(16, triton.next_power_of_2(d))),
    }


def _check(Q, X, V, c, mask, table):
    B, L, d = Q.shape
    n = table.shape[0]
    max_len = (table.shape[1] + 1) // 2
    problems = [
        (X.shape != Q.shape, f"X has shape {tuple(X.shape)}, Q {tuple(Q.shape)}"),
        (n % 2 or not 4 <= n <= MAX_PARTS, f"n = {n} parts; the kernel takes an even n in 4..16"),
        (d % n, f"d = {d} is not divisible by n = {n}"),
        (d > MAX_CHUNK * MAX_D_CHUNKS, f"d = {d} exceeds the kernel's {MAX_CHUNK * MAX_D_CHUNKS}"),
        (tuple(V.shape) != (B, n, L, d // n), f"V has shape {tuple(V.shape)}, not {(B, n, L, d // n)}"),
        (c is not None and tuple(c.shape) != (B, L, n), f"c has shape {tuple(c.shape) if c is not None else None}"),
        (tuple(mask.shape) != (B, L), f"mask has shape {tuple(mask.shape)}, not {(B, L)}"),
        (L > max_len, f"sequence length {L} exceeds the table's max_len {max_len}"),
        (Q.dtype not in (torch.float16, torch.bfloat16, torch.float32), f"dtype {Q.dtype}"),
        (not INTERPRET and not Q.is_cuda, "CPU tensors need TRITON_INTERPRET=1"),
    ]  # fmt: skip
    for bad, what in problems:
        if bad:
            raise ValueError(
                f"partition_attention_triton: {what} (shatter/attention/triton_kernel.py)"
            )


def _normalisers(ss, mx, sigmoid: bool):
    """From the two sides' statistics [B, 2, L]: the row statistics [2, B, L] the backward pass
    takes (ρ = 1/‖p‖ twice, or the row maximum and log Σ_j exp(z_ij − max)) and each side's
    output factor [B, 2, L]."""
    if sigmoid:  # ρ_i = 1 / ‖p_i‖ from the two halves of Σ_j p_ij² (eq. 5)
        rho = ss.sum(1).sqrt_().clamp_min_(NORM_EPS).reciprocal_()
        return rho.expand(2, *rho.shape), rho[:, None, :].expand_as(ss)
    top = mx.amax(1)  # softmax: Σ_j exp(z_ij - top_i) = Σ_sides ss exp(mx - top)
    w = torch.exp(mx - top[:, None])
    total = (ss * w).sum(1)
    return torch.stack([top, total.log()]), w / total[:, None]


class PartitionAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, X, V, c, mask_BL, table, scale, sigmoid):
        B, L, d = Q.shape
        n = table.shape[0]
        Q, X = Q.contiguous(), X.contiguous()
        V = V if V.stride(-1) == 1 else V.contiguous()
        c = c.contiguous() if c is not None else None
        mask32 = mask_BL.to(torch.float32).contiguous()
        table = table.contiguous()
        cc = c if c is not None else Q
        out = torch.empty(B, n, L, d // n, device=Q.device, dtype=torch.float32)
        part = torch.empty(B, L, n, device=Q.device, dtype=torch.float32)
        ss = torch.empty(B, 2, L, device=Q.device, dtype=torch.float32)
        mx = torch.empty_like(ss) if not sigmoid else ss  # the softmax's per-side maximum
        meta = kernel_meta(d, n, Q.dtype)
        grid = lambda META: (triton.cdiv(L, META["BLOCK_M"]), 2 * B)  # noqa: E731
        partition_fwd_kernel[grid](
            Q, X, V, cc, mask32, table, out, part, ss, mx,
            Q.stride(0), Q.stride(1), X.stride(0), X.stride(1),
            V.stride(0), V.stride(1), V.stride(2), cc.stride(0), cc.stride(1), table.stride(0),
            out.stride(0), out.stride(1), out.stride(2), part.stride(0), part.stride(1),
            L, triton.next_power_of_2(L), d, d // n, (table.shape[1] - 1) // 2, scale,
            HAS_C=c is not None, N_PARTS=n, BLOCK_K=meta["BLOCK_K"], PREC=meta["PREC"],
            SIGMOID=sigmoid,
        )  # fmt: skip
        stat, factor = _normalisers(ss, mx, sigmoid)
        # the kernel's outputs are unnormalised, each side's parts relative to its own factor
        half = n // 2
        out = out.view(B, 2, half, L, d // n).mul_(factor[:, :, None, :, None])
        part = part.view(B, L, 2, half).mul_(factor.transpose(1, 2)[..., None])
        out = out.view(B, n, L, d // n).to(Q.dtype)
        part = part.view(B, L, n).to(Q.dtype)
        ctx.save_for_backward(Q, X, V, c, mask32, table, stat, out, part)
        ctx.scale, ctx.sigmoid = scale, sigmoid
        return out, part

    @staticmethod
    def backward(ctx, g_out, g_part):
        Q, X, V, c, mask32, table, stat, out, part = ctx.saved_tensors
        B, L, d = Q.shape
        n = table.shape[0]
        g_out = torch.zeros_like(out) if g_out is None else g_out.to(Q.dtype).contiguous()
        g_part = torch.zeros_like(part) if g_part is None else g_part.to(Q.dtype).contiguous()
        # δ_i = Σ_j dA_ij A_ij = Σ_h ⟨dX̄[h]_i, X̄[h]_i⟩ + ⟨dA_part_i, A_part_i⟩
        delta = (g_out.float() * out.float()).sum((1, 3)) + (g_part.float() * part.float()).sum(2)
        meta = kernel_meta(d, n, Q.dtype)
        cc = c if c is not None else Q
        common = dict(
            L=L, L_KEY=triton.next_power_of_2(L), D_MODEL=d, K_PART=d // n,
            T_CENTRE=(table.shape[1] - 1) // 2, scale=ctx.scale, HAS_C=c is not None,
            N_PARTS=n, BLOCK_K=meta["BLOCK_K"], PREC=meta["PREC"], SIGMOID=ctx.sigmoid,
        )  # fmt: skip
        strides = (Q.stride(0), Q.stride(1), X.stride(0), X.stride(1), cc.stride(0), cc.stride(1))
        gQ = gX = gV = gc = None
        need_q, need_x, need_v, need_c = ctx.needs_input_grad[:4]
        if need_v:
            gV = torch.empty(B, n, L, d // n, device=Q.device, dtype=Q.dtype)
            grid = lambda META: (triton.cdiv(L, META["BLOCK_N"]), 2 * B)  # noqa: E731
            partition_bwd_dv_kernel[grid](
                Q, X, cc, mask32, table, stat[0], stat[1], g_out, gV,
                *strides, table.stride(0), gV.stride(0), gV.stride(1), gV.stride(2), **common,
            )  # fmt: skip
        for key_major, needed in ((False, need_q or need_c), (True, need_x)):
            if not needed:
                continue
            g = torch.empty_like(Q)
            dc = torch.empty(B, L, n, device=Q.device, dtype=Q.dtype) if c is not None else Q
            block = "BLOCK_N" if key_major else "BLOCK_M"
            grid = lambda META, block=block: (triton.cdiv(L, META[block]), B)  # noqa: E731
            kernel = partition_bwd_dx_kernel if key_major else partition_bwd_dq_kernel
            kernel[grid](
                Q, X, V, cc, mask32, table, stat[0], stat[1], delta, g_out, g_part, g, dc,
                *strides[:4], V.stride(0), V.stride(1), V.stride(2), *strides[4:],
                table.stride(0), g_out.stride(0), g_out.stride(1), g_out.stride(2),
                g_part.stride(0), g_part.stride(1), g.stride(0), g.stride(1),
                KEY_MAJOR=key_major, NP=meta["NP"], DCH=meta["DCH"],
                NUM_DC=triton.cdiv(d, meta["DCH"]), **common,
            )  # fmt: skip
            if key_major:
                gX = g
            else:
                gQ, gc = g, (dc if c is not None else None)
        return gQ, gX, gV, gc, None, None, None, None


def partition_attention_triton(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid: bool):
    """(X_bar [B, n, L, d/n], A_part [B, L, n]) as `lean.partition_mix_lean` gives them for
    Z0 = Q Xᵀ/√d; the 1h-sigmoid arch passes c = None."""
    _check(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table)
    scale = 1.0 / math.sqrt(Q_BLD.shape[-1])
    return PartitionAttentionTriton.apply(
        Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, scale, bool(sigmoid)
    )
