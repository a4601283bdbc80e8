"""Triton row kernels of the `rows` partition attention (eq. 2, 3, 5 and §3.3), for GPUs whose
Triton has no tensor-core dots (sm_70, sm_75).

Below sm_80 Triton's `tl.dot` becomes FMAs, so these kernels take no products at all: every
product is a cuBLAS GEMM around them (shatter/attention/rows.py), and each kernel only streams
whole rows, elementwise work and row sums in fp32 registers, fp16 (or the input dtype) in and
out. One program holds one row i of one sequence b, all l keys at once:

    s_ij  = z_ij + Σ_h c_ih f_h(j − i)                       (z = Q Xᵀ/√d, c = Q Rᵀ: §3.3)
    sigmoid:  p_ij = sigmoid(s_ij) m_j,  A_ij = p_ij / ‖p_i‖            (eq. 5)
    softmax:  A_ij = softmax over the real keys of s_i                   (1h-softmax)
    W_h[i, j] = A_ij f_h(j − i),   A_part[i, h] = Σ_j W_h[i, j]          (eq. 2-3, §3.3)

`rows_fwd_kernel` writes W [B, n, l, lp] (the n parts' weights, what the GEMMs X̄[h] = W_h V[h]
and dV[h] = W_hᵀ dX̄[h] read) and A_part. `rows_bwd_kernel` takes dW_h = dX̄[h] V[h]ᵀ from
cuBLAS and, with the row whole, recomputes A and forms

    dA_ij  = Σ_h f_h(j − i) (dW_h[i, j] + dA_part[i, h]),   δ_i = Σ_j dA_ij A_ij
    sigmoid: dS_ij = m_j s_ij (1 − s_ij) (dA_ij − A_ij δ_i) / ‖p_i‖      (as lean.PartitionMix)
    softmax: dS_ij = A_ij (dA_ij − δ_i) at real keys
    dc_ih  = Σ_j dS_ij f_h(j − i)

writing dZ = dS/√d in the input dtype (the GEMMs' dQ = dZ X and dX = dZᵀ Q then need no scale)
and dc. No row statistic is stored: each kernel normalises the whole row itself.

f_h(j − i) for the row is the contiguous slice T[h, j − i + m − 1] of the layer's (n, 2m − 1)
table (shatter/partition.py). `tools/kernel_report.py --arch 70` compiles both kernels ahead of
time and checks registers and spills; `ROW_WARPS` sets the warps per row length.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP32_MIN = tl.constexpr(-3.4028234663852886e38)  # padded keys, as multihead.masked_softmax
MAX_ROW = 4096  # keys a program holds in registers (the longest max_len)


def row_warps(block_l: int) -> int:
    """Warps per row program: at most 4 keys of the row per thread (the backward holds about
    six fp32 values per key; 8 keys a thread took 255 registers on sm_70 and 16 spilled), at
    least 4 warps, at most 32 (1,024 threads)."""
    return max(4, min(32, block_l // 128))


@triton.jit
def _row_scores(
    Z, C, Mk, T, b, i, L, T_CENTRE, sz_b, sz_l, sc_b, sc_l, sm_b, st_h,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Row i of sequence b in fp32: s = z + Σ_h c_h f_h(j − i), the pointers of f_0(j − i), the
    in-sequence mask and the key mask m."""
    offs = tl.arange(0, BLOCK_L)
    ok = offs < L
    s = tl.load(Z + b * sz_b + i * sz_l + offs, mask=ok, other=0.0).to(tl.float32)
    f_row = T + T_CENTRE - i + offs  # f_h(j − i) is table column j − i + m − 1
    if HAS_C:  # the partition bias, §3.3
        for h in range(N_PARTS):
            c_h = tl.load(C + b * sc_b + i * sc_l + h).to(tl.float32)
            s += c_h * tl.load(f_row + h * st_h, mask=ok, other=0.0)
    m = tl.load(Mk + b * sm_b + offs, mask=ok, other=0).to(tl.float32)
    return s, f_row, ok, m


@triton.jit
def _row_weights(s, m, ok, SIGMOID: tl.constexpr):
    """(A, g) of the row: A as the module doc, g with dS = g ⊙ (dA − A δ) (sigmoid) or
    dS = g ⊙ (dA − δ) (softmax)."""
    if SIGMOID:
        sig = tl.sigmoid(s)
        p = tl.where(ok, sig * m, 0.0)
        rho = 1.0 / tl.maximum(tl.sqrt(tl.sum(p * p, 0)), 1e-12)
        a = p * rho
        g = rho * m * sig * (1.0 - sig)
    else:  # a row without a real key gets uniform weights, as masked_softmax
        logit = tl.where(ok, tl.where(m > 0, s, FP32_MIN), float("-inf"))
        e = tl.exp(logit - tl.max(logit, 0))
        a = e / tl.sum(e, 0)
        g = tl.where(m > 0, a, 0.0)
    return a, g


@triton.jit
def rows_fwd_kernel(
    Z, C, Mk, T, W, AP, sz_b, sz_l, sc_b, sc_l, sm_b, st_h, sw_b, sw_h, sw_l, sa_b, sa_l,
    L, T_CENTRE,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, SIGMOID: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Program (row i, sequence b): W[b, h, i, :] = A_i ⊙ f_h(· − i) for every part h, in W's
    dtype, and A_part[b, i, h] = Σ_j of it (fp32 sums)."""
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s, f_row, ok, m = _row_scores(
        Z, C, Mk, T, b, i, L, T_CENTRE, sz_b, sz_l, sc_b, sc_l, sm_b, st_h,
        HAS_C, N_PARTS, BLOCK_L,
    )  # fmt: skip
    a, _ = _row_weights(s, m, ok, SIGMOID)
    w_row = W + b * sw_b + i * sw_l + tl.arange(0, BLOCK_L)
    for h in range(N_PARTS):
        w = a * tl.load(f_row + h * st_h, mask=ok, other=0.0)
        tl.store(w_row + h * sw_h, w.to(W.dtype.element_ty), mask=ok)
        tl.store(AP + b * sa_b + i * sa_l + h, tl.sum(w, 0).to(AP.dtype.element_ty))


@triton.jit
def rows_bwd_kernel(
    Z, C, Mk, T, DW, DAP, DZ, DC, sz_b, sz_l, sc_b, sc_l, sm_b, st_h, sw_b, sw_h, sw_l,
    sp_b, sp_l, sdc_b, sdc_l, L, T_CENTRE, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, SIGMOID: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """Program (row i, sequence b): dA, δ, dS of the row from DW = dX̄[h] V[h]ᵀ (W's strides
    sw_*) and DAP = dA_part; DZ = dS · scale (Z's strides, Z's dtype) and DC = dc."""
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    s, f_row, ok, m = _row_scores(
        Z, C, Mk, T, b, i, L, T_CENTRE, sz_b, sz_l, sc_b, sc_l, sm_b, st_h,
        HAS_C, N_PARTS, BLOCK_L,
    )  # fmt: skip
    a, g = _row_weights(s, m, ok, SIGMOID)
    offs = tl.arange(0, BLOCK_L)
    dw_row = DW + b * sw_b + i * sw_l + offs
    da = tl.zeros([BLOCK_L], dtype=tl.float32)
    for h in range(N_PARTS):  # dA = Σ_h f_h ⊙ (dW_h + dA_part[:, h])
        f = tl.load(f_row + h * st_h, mask=ok, other=0.0)
        dw = tl.load(dw_row + h * sw_h, mask=ok, other=0.0).to(tl.float32)
        dap = tl.load(DAP + b * sp_b + i * sp_l + h).to(tl.float32)
        da += f * (dw + dap)
    delta = tl.sum(da * a, 0)
    if SIGMOID:
        ds = g * (da - a * delta)
    else:
        ds = g * (da - delta)
    ds = tl.where(ok, ds, 0.0)
    tl.store(DZ + b * sz_b + i * sz_l + offs, (ds * scale).to(DZ.dtype.element_ty), mask=ok)
    if HAS_C:  # dc_ih = Σ_j dS_ij f_h(j − i)
        for h in range(N_PARTS):
            f = tl.load(f_row + h * st_h, mask=ok, other=0.0)
            tl.store(DC + b * sdc_b + i * sdc_l + h, tl.sum(ds * f, 0).to(DC.dtype.element_ty))
