"""Fused Triton kernels for the single-head partition attention (eq. 2, 3, 5 and §3.3).

With K = X (the keys ARE the hidden states, §3.2), z_ij = Q_i·X_j/√d, the part bias
b_ij = Σ_h c_ih f_h(j−i) (c = Q Rᵀ, part-bias and shatter, §3.3) and the key mask m,

    p_ij      = sigmoid(z_ij + b_ij) m_j,         ρ_i = 1 / ‖p_i‖                    (eq. 5)
    X̄[h]_i    = ρ_i Σ_j p_ij f_h(j−i) V[h]_j                                         (eq. 2-3)
    A_part_ih = ρ_i Σ_j p_ij f_h(j−i)                                                (§3.3)

f_h(j−i) is gathered from the layer's constant table (shatter/partition.py). Parts 0..n/2−1 vanish
left of the diagonal and parts n/2..n−1 right of it (the appendix's mirror halves), so the
forward pass runs one program per (row block, side): it visits only that side's key blocks and
keeps n/2 accumulators of [BLOCK_M, d/n] — one score tile (a d-wide contraction) serves all of
them, and there is no running maximum (a sigmoid needs none). Each side also sums its own p²
(the diagonal counted once, on the right); the two halves of ‖p_i‖² and the unnormalised outputs
(fp32) are combined by one O(B·L·d) elementwise step.

The softmax of the 1h-softmax ablation (SIGMOID=False) runs the same programs with an online
softmax per side: p_ij = exp(z_ij + b_ij − M_i^side) with the side's running maximum, the
accumulators rescaled when it grows; the combining step weighs the sides by exp(M^side − M).
Padded keys take the fp32 minimum as multihead.masked_softmax fills them, so a row without a
real key is uniform over the sequence as there.

The backward pass recomputes the tiles from Q, X, V, c, the mask and ρ (saved, O(B·L); the
softmax saves each row's maximum and log-sum). With
δ_i = Σ_j dA_ij A_ij = Σ_h ⟨dX̄[h]_i, X̄[h]_i⟩ + ⟨dA_part_i, A_part_i⟩ from the forward outputs
(FlashAttention-2's D = rowsum(dO∘O)) and dA_ij = Σ_h f_h(j−i) (⟨dX̄[h]_i, V[h]_j⟩ + dA_part_ih):

    dp_ij = ρ_i (dA_ij − A_ij δ_i),   dZ_ij = dp_ij m_j s_ij (1 − s_ij)     (as lean.PartitionMix)
    softmax: dZ_ij = A_ij (dA_ij − δ_i) at real keys
    dQ = dZ X / √d,   dX = dZᵀ Q / √d (X as key only),   dc_ih = Σ_j dZ_ij f_h(j−i),
    dV[h]_j = Σ_i A_ij f_h(j−i) dX̄[h]_i.

Three kernels: dQ and dc (row-major), dX (key-major; the same kernel with KEY_MAJOR), and dV
(key-major, one program per side like the forward). Nothing of size L² is stored.

The d-wide dQ/dX accumulators are NUM_DC chunks of DC ≤ 256 columns, so d ≤ 4·256 = 1024.
n ∈ {4, 6, ..., 16} (n/2 ≤ 8 unrolled accumulators). `tools/kernel_report.py` compiles every
autotune configuration ahead of time for sm_80/sm_90 and checks shared memory, spills and tensor
cores. Under TRITON_INTERPRET=1 (CPU tests) only one small configuration is tuned over.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_PARTS = 16  # n/2 <= 8 unrolled per-part accumulators
MAX_CHUNK = 256  # columns per dQ/dX accumulator chunk
MAX_D_CHUNKS = 4  # dQ/dX accumulators: at most 4 chunks, so d <= 1024


def _cfg(block_m, block_n, block_d, warps, stages, archs=(80, 90), acts=("sigmoid", "softmax")):
    """An autotune configuration, the arch families (80: sm_80..89, 90: sm_90+) and the
    activations it is for."""
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
    config = triton.Config(meta, num_warps=warps, num_stages=stages)
    config.archs, config.acts = archs, acts
    return config


INTERPRET_CONFIGS = [_cfg(16, 16, 16, 1, 1)]
# Each configuration compiles, for the arch families and activations it names, at d=768/n=12 and
# d=1024/n=16 in bf16 and fp16 within shared memory, without spills and with tensor-core
# instructions: checked by tools/kernel_report.py (docs/benchmarks.md), which also found the ones
# left out. Larger tiles spill: the d-wide score contraction plus n/2 part (or d-wide) fp32
# accumulators leave few registers, and sm_80's mma.sync keeps more of them live than wgmma.
SIGMOID_ONLY = ("sigmoid",)
FWD_CONFIGS = [
    _cfg(16, 32, 64, 4, 2),
    _cfg(32, 64, 64, 8, 2, archs=(90,), acts=SIGMOID_ONLY),
    _cfg(16, 64, 64, 4, 2, archs=(90,), acts=SIGMOID_ONLY),
    _cfg(32, 32, 64, 8, 2, archs=(80,)),
    _cfg(32, 64, 32, 8, 2, archs=(80,), acts=SIGMOID_ONLY),
]
DV_CONFIGS = [
    _cfg(16, 64, 64, 8, 2, archs=(90,)),
    _cfg(32, 64, 32, 8, 2, archs=(90,)),
    _cfg(32, 64, 64, 16, 2, archs=(90,), acts=SIGMOID_ONLY),
    _cfg(16, 32, 64, 8, 1, archs=(80,)),
    _cfg(16, 16, 64, 8, 2, archs=(80,)),
]
DQ_CONFIGS = [_cfg(16, 32, 64, 8, 2), _cfg(16, 16, 64, 4, 2, archs=(90,))]
DX_CONFIGS = [
    _cfg(32, 16, 64, 8, 2),
    _cfg(64, 16, 64, 8, 2, archs=(90,)),
    _cfg(64, 16, 64, 8, 2, archs=(80,), acts=SIGMOID_ONLY),
]
AUTOTUNE_KEY = ["L_KEY", "D_MODEL", "N_PARTS", "HAS_C", "SIGMOID"]


def arch_family(capability: tuple[int, int]) -> int:
    return 90 if capability[0] >= 9 else 80


def _for_this_call(configs, named_args, **kwargs):
    family = arch_family(torch.cuda.get_device_capability())
    act = "sigmoid" if kwargs["SIGMOID"] else "softmax"
    return [c for c in configs if family in c.archs and act in c.acts]


def _autotune(configs):
    if INTERPRET:
        return triton.autotune(configs=INTERPRET_CONFIGS, key=AUTOTUNE_KEY)
    prune = {"early_config_prune": _for_this_call}
    return triton.autotune(configs=configs, key=AUTOTUNE_KEY, prune_configs_by=prune)


# ------------------------------------------------------------------------------------ tiles


@triton.jit
def _part_range(i0, j0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_PARTS: tl.constexpr):
    """The parts that can be non-zero on the tile rows i0.., keys j0..: only the right half
    (0..n/2-1) strictly right of the diagonal, only the left half strictly left of it."""
    lo = tl.where(j0 + BLOCK_N - 1 < i0, N_PARTS // 2, 0)
    hi = tl.where(j0 > i0 + BLOCK_M - 1, N_PARTS // 2, N_PARTS)
    return lo, hi


@triton.jit
def _score_tile(
    Q, X, C, Mk, T, b, i0, j0, L, D_MODEL, T_CENTRE, scale,
    sq_b, sq_l, sx_b, sx_l, sc_b, sc_l, st_h,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """z + b on the tile (eq. 5's argument), the table column of j - i, the in-sequence mask and
    the key mask m."""
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    col_ok = offs_n < L
    q_rows = Q + b * sq_b + offs_m * sq_l
    x_rows = X + b * sx_b + offs_n * sx_l
    z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D_MODEL, BLOCK_D):
        dd = d0 + offs_d
        d_ok = dd < D_MODEL
        q = tl.load(q_rows[:, None] + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        x = tl.load(x_rows[:, None] + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        z = tl.dot(q, tl.trans(x), z, input_precision=PREC)  # Q X^T
    z = z * scale  # / sqrt(d)
    ok = row_ok[:, None] & col_ok[None, :]
    col = offs_n[None, :] - offs_m[:, None] + T_CENTRE  # f_h(j - i) is table column j-i+m-1
    if HAS_C:  # b_ij = sum_h c_ih f_h(j - i), §3.3
        lo, hi = _part_range(i0, j0, BLOCK_M, BLOCK_N, N_PARTS)
        for h in range(lo, hi):
            f = tl.load(T + h * st_h + col, mask=ok, other=0.0).to(tl.float32)
            c_h = tl.load(C + b * sc_b + offs_m * sc_l + h, mask=row_ok, other=0.0)
            z += c_h.to(tl.float32)[:, None] * f
    m = tl.load(Mk + b * L + offs_n, mask=col_ok, other=0.0)
    return z, col, ok, m


@triton.jit
def _softmax_logits(z, m):
    """Padded keys at the fp32 minimum, as multihead.masked_softmax fills them."""
    return tl.where(m[None, :] > 0, z, -3.4028234663852886e38)


@triton.jit
def _weights(z, m, ok, stat, stat2, SIGMOID: tl.constexpr):
    """The attention weights A on the tile, from the row statistics (sigmoid: stat = ρ = 1/‖p‖;
    softmax: stat = the row's maximum, stat2 = log Σ_j exp(z_ij − max), apart so that a row with
    no real key keeps its uniform weights in fp32), and g with dZ = g ⊙ (dA − A δ) (sigmoid: A = p ρ,
    p = s m, so g = ρ m s (1 − s)) or dZ = g ⊙ (dA − δ) (softmax: g = A at real keys)."""
    if SIGMOID:
        s = tl.sigmoid(z)
        a = tl.where(ok, s * m[None, :], 0.0) * stat[:, None]
        g = (stat[:, None] * m[None, :]) * (s * (1.0 - s))
    else:
        a = tl.where(ok, tl.exp((_softmax_logits(z, m) - stat[:, None]) - stat2[:, None]), 0.0)
        g = tl.where(m[None, :] > 0, a, 0.0)
    return a, g


@triton.jit
def _fwd_part(
    acc, a_sum, p, alpha, f_ptr, col, ok, v_ptrs, v_ok, SIGMOID: tl.constexpr, PREC: tl.constexpr
):
    """One part h: acc += (p ⊙ f_h) V[h], a_sum += rowsum(p ⊙ f_h); the softmax first rescales
    both to the new running maximum (alpha)."""
    if not SIGMOID:
        acc = acc * alpha[:, None]
        a_sum = a_sum * alpha
    w = p * tl.load(f_ptr + col, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    return tl.dot(w.to(v.dtype), v, acc, input_precision=PREC), a_sum + tl.sum(w, 1)


@triton.jit
def _dv_part(acc, a, f_ptr, col, ok, do_ptrs, do_ok, PREC: tl.constexpr):
    """One part h: dV[h] += (A ⊙ f_h)^T dX̄[h]."""
    w = a * tl.load(f_ptr + col, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=do_ok, other=0.0)
    return tl.dot(tl.trans(w).to(do.dtype), do, acc, input_precision=PREC)


@triton.jit
def _chunk_dot(acc, w, rows_ptr, rows_ok, d0, D_MODEL, DC: tl.constexpr, PREC: tl.constexpr):
    """acc += w @ Y[:, d0:d0+DC] for the rows of Y at rows_ptr."""
    dd = d0 + tl.arange(0, DC)
    y = tl.load(
        rows_ptr[:, None] + dd[None, :], mask=rows_ok[:, None] & (dd < D_MODEL)[None, :], other=0.0
    )
    return tl.dot(w.to(y.dtype), y, acc, input_precision=PREC)


@triton.jit
def _chunk_store(ptr_rows, rows_ok, acc, d0, D_MODEL, scale, DC: tl.constexpr):
    dd = d0 + tl.arange(0, DC)
    ptrs = ptr_rows[:, None] + dd[None, :]
    val = (acc * scale).to(ptr_rows.dtype.element_ty)
    tl.store(ptrs, val, mask=rows_ok[:, None] & (dd < D_MODEL)[None, :])


# ---------------------------------------------------------------------------------- kernels


@_autotune(FWD_CONFIGS)
@triton.jit
def partition_fwd_kernel(
    Q, X, V, C, Mk, T, OUT, AP, SS, MX,
    sq_b, sq_l, sx_b, sx_l, sv_b, sv_h, sv_l, sc_b, sc_l, st_h, so_b, so_h, so_l, sa_b, sa_l,
    L, L_KEY, D_MODEL, K_PART, T_CENTRE, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch × side): unnormalised X̄ and A_part of the side's n/2 parts
    (fp32) and the side's share of the normaliser: Σ p² (sigmoid) or, softmax, Σ exp(z − MX)
    with MX the side's running maximum (online softmax)."""
    HALF: tl.constexpr = N_PARTS // 2
    b = (tl.program_id(1) // 2).to(tl.int64)
    side = tl.program_id(1) % 2  # 0: keys j >= i, parts 0..n/2-1; 1: j <= i, parts n/2..n-1
    i0 = tl.program_id(0) * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    h0 = side * HALF
    acc0 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    ap0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    ap1, ap2, ap3, ap4, ap5, ap6, ap7 = ap0, ap0, ap0, ap0, ap0, ap0, ap0
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo = tl.where(side == 0, (i0 // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(side == 0, L, tl.minimum(L, i0 + BLOCK_M))
    for j0 in range(lo, hi, BLOCK_N):
        z, col, ok, m = _score_tile(
            Q, X, C, Mk, T, b, i0, j0, L, D_MODEL, T_CENTRE, scale,
            sq_b, sq_l, sx_b, sx_l, sc_b, sc_l, st_h,
            HAS_C, N_PARTS, PREC, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        offs_n = j0 + tl.arange(0, BLOCK_N)
        rel = offs_n[None, :] - offs_m[:, None]
        mine = tl.where(side == 0, rel >= 0, rel < 0)  # the diagonal counted once, on the right
        if SIGMOID:  # p = sigmoid(z + b) m, eq. 5
            p = tl.where(ok, tl.sigmoid(z) * m[None, :], 0.0)
            ss += tl.sum(tl.where(mine, p * p, 0.0), 1)
            alpha = ss  # unused
        else:  # p = exp(z + b - MX) over the side's keys, the diagonal included
            here = ok & tl.where(side == 0, rel >= 0, rel <= 0)
            zf = tl.where(here, _softmax_logits(z, m), float("-inf"))
            mx_new = tl.maximum(mx, tl.max(zf, 1))
            mx_safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)
            alpha = tl.exp(mx - mx_safe)
            p = tl.exp(zf - mx_safe[:, None])
            ss = ss * alpha + tl.sum(tl.where(mine, p, 0.0), 1)
            mx = mx_new
        v_ptrs = V + b * sv_b + h0 * sv_h + offs_n[:, None] * sv_l + offs_k[None, :]
        v_ok = (offs_n < L)[:, None] & (offs_k < K_PART)[None, :]
        f_ptr = T + h0 * st_h
        acc0, ap0 = _fwd_part(acc0, ap0, p, alpha, f_ptr, col, ok, v_ptrs, v_ok, SIGMOID, PREC)
        acc1, ap1 = _fwd_part(
            acc1, ap1, p, alpha, f_ptr + st_h, col, ok, v_ptrs + sv_h, v_ok, SIGMOID, PREC
        )
        if HALF > 2:
            acc2, ap2 = _fwd_part(acc2, ap2, p, alpha, f_ptr + 2 * st_h, col, ok, v_ptrs + 2 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
        if HALF > 3:
            acc3, ap3 = _fwd_part(acc3, ap3, p, alpha, f_ptr + 3 * st_h, col, ok, v_ptrs + 3 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
        if HALF > 4:
            acc4, ap4 = _fwd_part(acc4, ap4, p, alpha, f_ptr + 4 * st_h, col, ok, v_ptrs + 4 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
        if HALF > 5:
            acc5, ap5 = _fwd_part(acc5, ap5, p, alpha, f_ptr + 5 * st_h, col, ok, v_ptrs + 5 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
        if HALF > 6:
            acc6, ap6 = _fwd_part(acc6, ap6, p, alpha, f_ptr + 6 * st_h, col, ok, v_ptrs + 6 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
        if HALF > 7:
            acc7, ap7 = _fwd_part(acc7, ap7, p, alpha, f_ptr + 7 * st_h, col, ok, v_ptrs + 7 * sv_h, v_ok, SIGMOID, PREC)  # fmt: skip
    row_ok = offs_m < L
    o_ptrs = OUT + b * so_b + h0 * so_h + offs_m[:, None] * so_l + offs_k[None, :]
    o_ok = row_ok[:, None] & (offs_k < K_PART)[None, :]
    a_ptrs = AP + b * sa_b + offs_m * sa_l + h0
    tl.store(o_ptrs, acc0, mask=o_ok)
    tl.store(a_ptrs, ap0, mask=row_ok)
    tl.store(o_ptrs + so_h, acc1, mask=o_ok)
    tl.store(a_ptrs + 1, ap1, mask=row_ok)
    if HALF > 2:
        tl.store(o_ptrs + 2 * so_h, acc2, mask=o_ok)
        tl.store(a_ptrs + 2, ap2, mask=row_ok)
    if HALF > 3:
        tl.store(o_ptrs + 3 * so_h, acc3, mask=o_ok)
        tl.store(a_ptrs + 3, ap3, mask=row_ok)
    if HALF > 4:
        tl.store(o_ptrs + 4 * so_h, acc4, mask=o_ok)
        tl.store(a_ptrs + 4, ap4, mask=row_ok)
    if HALF > 5:
        tl.store(o_ptrs + 5 * so_h, acc5, mask=o_ok)
        tl.store(a_ptrs + 5, ap5, mask=row_ok)
    if HALF > 6:
        tl.store(o_ptrs + 6 * so_h, acc6, mask=o_ok)
        tl.store(a_ptrs + 6, ap6, mask=row_ok)
    if HALF > 7:
        tl.store(o_ptrs + 7 * so_h, acc7, mask=o_ok)
        tl.store(a_ptrs + 7, ap7, mask=row_ok)
    tl.store(SS + (b * 2 + side) * L + offs_m, ss, mask=row_ok)
    if not SIGMOID:
        tl.store(MX + (b * 2 + side) * L + offs_m, mx, mask=row_ok)


@_autotune(DV_CONFIGS)
@triton.jit
def partition_bwd_dv_kernel(
    Q, X, C, Mk, T, STAT, STAT2, DO, DV,
    sq_b, sq_l, sx_b, sx_l, sc_b, sc_l, st_h, sd_b, sd_h, sd_l,
    L, L_KEY, D_MODEL, K_PART, T_CENTRE, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (key block, batch × side): dV[h] = Σ_i (A ⊙ f_h)ᵀ dX̄[h] for the side's parts;
    dO and dV share the [B, n, L, d/n] strides sd_*."""
    HALF: tl.constexpr = N_PARTS // 2
    b = (tl.program_id(1) // 2).to(tl.int64)
    side = tl.program_id(1) % 2  # 0: parts 0..n/2-1 (rows i <= j); 1: n/2..n-1 (i >= j)
    j0 = tl.program_id(0) * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h0 = side * HALF
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    lo = tl.where(side == 0, 0, (j0 // BLOCK_M) * BLOCK_M)
    hi = tl.where(side == 0, tl.minimum(L, j0 + BLOCK_N), L)
    for i0 in range(lo, hi, BLOCK_M):
        z, col, ok, m = _score_tile(
            Q, X, C, Mk, T, b, i0, j0, L, D_MODEL, T_CENTRE, scale,
            sq_b, sq_l, sx_b, sx_l, sc_b, sc_l, st_h,
            HAS_C, N_PARTS, PREC, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        offs_m = i0 + tl.arange(0, BLOCK_M)
        stat = tl.load(STAT + b * L + offs_m, mask=offs_m < L, other=0.0)
        stat2 = tl.load(STAT2 + b * L + offs_m, mask=offs_m < L, other=0.0)
        a, g = _weights(z, m, ok, stat, stat2, SIGMOID)
        do_ptrs = DO + b * sd_b + h0 * sd_h + offs_m[:, None] * sd_l + offs_k[None, :]
        do_ok = (offs_m < L)[:, None] & (offs_k < K_PART)[None, :]
        f_ptr = T + h0 * st_h
        acc0 = _dv_part(acc0, a, f_ptr, col, ok, do_ptrs, do_ok, PREC)
        acc1 = _dv_part(acc1, a, f_ptr + st_h, col, ok, do_ptrs + sd_h, do_ok, PREC)
        if HALF > 2:
            acc2 = _dv_part(acc2, a, f_ptr + 2 * st_h, col, ok, do_ptrs + 2 * sd_h, do_ok, PREC)
        if HALF > 3:
            acc3 = _dv_part(acc3, a, f_ptr + 3 * st_h, col, ok, do_ptrs + 3 * sd_h, do_ok, PREC)
        if HALF > 4:
            acc4 = _dv_part(acc4, a, f_ptr + 4 * st_h, col, ok, do_ptrs + 4 * sd_h, do_ok, PREC)
        if HALF > 5:
            acc5 = _dv_part(acc5, a, f_ptr + 5 * st_h, col, ok, do_ptrs + 5 * sd_h, do_ok, PREC)
        if HALF > 6:
            acc6 = _dv_part(acc6, a, f_ptr + 6 * st_h, col, ok, do_ptrs + 6 * sd_h, do_ok, PREC)
        if HALF > 7:
            acc7 = _dv_part(acc7, a, f_ptr + 7 * st_h, col, ok, do_ptrs + 7 * sd_h, do_ok, PREC)
    dv_ptrs = DV + b * sd_b + h0 * sd_h + offs_n[:, None] * sd_l + offs_k[None, :]
    dv_ok = (offs_n < L)[:, None] & (offs_k < K_PART)[None, :]
    ty = DV.dtype.element_ty
    tl.store(dv_ptrs, acc0.to(ty), mask=dv_ok)
    tl.store(dv_ptrs + sd_h, acc1.to(ty), mask=dv_ok)
    if HALF > 2:
        tl.store(dv_ptrs + 2 * sd_h, acc2.to(ty), mask=dv_ok)
    if HALF > 3:
        tl.store(dv_ptrs + 3 * sd_h, acc3.to(ty), mask=dv_ok)
    if HALF > 4:
        tl.store(dv_ptrs + 4 * sd_h, acc4.to(ty), mask=dv_ok)
    if HALF > 5:
        tl.store(dv_ptrs + 5 * sd_h, acc5.to(ty), mask=dv_ok)
    if HALF > 6:
        tl.store(dv_ptrs + 6 * sd_h, acc6.to(ty), mask=dv_ok)
    if HALF > 7:
        tl.store(dv_ptrs + 7 * sd_h, acc7.to(ty), mask=dv_ok)


@triton.jit
def _bwd_dqdx(
    Q, X, V, C, Mk, T, STAT, STAT2, DELTA, DO, DAP, G, DC,
    sq_b, sq_l, sx_b, sx_l, sv_b, sv_h, sv_l, sc_b, sc_l, st_h, sd_b, sd_h, sd_l, sa_b, sa_l,
    sg_b, sg_l,
    L, L_KEY, D_MODEL, K_PART, T_CENTRE, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, KEY_MAJOR: tl.constexpr, NP: tl.constexpr, DCH: tl.constexpr,
    NUM_DC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row-major (KEY_MAJOR=False): G = dQ and DC = dc for a row block over all key blocks.
    Key-major: G = dX for a key block over all row blocks. G is [B, L, d] (strides sg_*); the
    d-wide accumulator is NUM_DC chunks of DCH columns. DO is dX̄ [B, n, L, d/n] (sd_*), DAP is
    dA_part [B, L, n] (sa_*)."""
    b = tl.program_id(1).to(tl.int64)
    fixed = tl.program_id(0) * (BLOCK_N if KEY_MAJOR else BLOCK_M)
    step: tl.constexpr = BLOCK_M if KEY_MAJOR else BLOCK_N
    rows: tl.constexpr = BLOCK_N if KEY_MAJOR else BLOCK_M
    g0 = tl.zeros([rows, DCH], dtype=tl.float32)
    g1, g2, g3 = g0, g0, g0
    dc = tl.zeros([BLOCK_M, NP], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for t0 in range(0, L, step):
        i0 = t0 if KEY_MAJOR else fixed
        j0 = fixed if KEY_MAJOR else t0
        z, col, ok, m = _score_tile(
            Q, X, C, Mk, T, b, i0, j0, L, D_MODEL, T_CENTRE, scale,
            sq_b, sq_l, sx_b, sx_l, sc_b, sc_l, st_h,
            HAS_C, N_PARTS, PREC, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        offs_m = i0 + tl.arange(0, BLOCK_M)
        offs_n = j0 + tl.arange(0, BLOCK_N)
        row_ok = offs_m < L
        col_ok = offs_n < L
        stat = tl.load(STAT + b * L + offs_m, mask=row_ok, other=0.0)
        stat2 = tl.load(STAT2 + b * L + offs_m, mask=row_ok, other=0.0)
        a, g = _weights(z, m, ok, stat, stat2, SIGMOID)
        delta = tl.load(DELTA + b * L + offs_m, mask=row_ok, other=0.0)
        do_ptrs = DO + b * sd_b + offs_m[:, None] * sd_l + offs_k[None, :]
        v_ptrs = V + b * sv_b + offs_n[:, None] * sv_l + offs_k[None, :]
        k_ok = (offs_k < K_PART)[None, :]
        da = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        lo, hi = _part_range(i0, j0, BLOCK_M, BLOCK_N, N_PARTS)
        for h in range(lo, hi):  # dA = Σ_h f_h ⊙ (dX̄[h] V[h]ᵀ + dA_part[:, h])
            f = tl.load(T + h * st_h + col, mask=ok, other=0.0).to(tl.float32)
            do = tl.load(do_ptrs + h * sd_h, mask=row_ok[:, None] & k_ok, other=0.0)
            v = tl.load(v_ptrs + h * sv_h, mask=col_ok[:, None] & k_ok, other=0.0)
            dap = tl.load(DAP + b * sa_b + offs_m * sa_l + h, mask=row_ok, other=0.0)
            g_w = tl.dot(do, tl.trans(v), input_precision=PREC) + dap.to(tl.float32)[:, None]
            da += f * g_w
        if SIGMOID:  # dP = (dA - A δ) ρ, dZ = dP m s (1 - s)  (as lean.PartitionMix)
            dz = g * (da - a * delta[:, None])
        else:  # dZ = A (dA - δ)
            dz = g * (da - delta[:, None])
        dz = tl.where(ok, dz, 0.0)
        if KEY_MAJOR:  # dX_j += Σ_i dZ_ij Q_i
            w = tl.trans(dz)
            y_rows = Q + b * sq_b + offs_m * sq_l
            y_ok = row_ok
        else:  # dQ_i += Σ_j dZ_ij X_j
            w = dz
            y_rows = X + b * sx_b + offs_n * sx_l
            y_ok = col_ok
            if HAS_C:  # dc_ih += Σ_j dZ_ij f_h(j - i)
                parts = tl.arange(0, NP)[None, :]
                for h in range(lo, hi):
                    f = tl.load(T + h * st_h + col, mask=ok, other=0.0).to(tl.float32)
                    dc += tl.where(parts == h, tl.sum(dz * f, 1)[:, None], 0.0)
        g0 = _chunk_dot(g0, w, y_rows, y_ok, 0, D_MODEL, DCH, PREC)
        if NUM_DC > 1:
            g1 = _chunk_dot(g1, w, y_rows, y_ok, DCH, D_MODEL, DCH, PREC)
        if NUM_DC > 2:
            g2 = _chunk_dot(g2, w, y_rows, y_ok, 2 * DCH, D_MODEL, DCH, PREC)
        if NUM_DC > 3:
            g3 = _chunk_dot(g3, w, y_rows, y_ok, 3 * DCH, D_MODEL, DCH, PREC)
    offs_out = fixed + tl.arange(0, rows)
    out_ok = offs_out < L
    g_rows = G + b * sg_b + offs_out * sg_l
    _chunk_store(g_rows, out_ok, g0, 0, D_MODEL, scale, DCH)
    if NUM_DC > 1:
        _chunk_store(g_rows, out_ok, g1, DCH, D_MODEL, scale, DCH)
    if NUM_DC > 2:
        _chunk_store(g_rows, out_ok, g2, 2 * DCH, D_MODEL, scale, DCH)
    if NUM_DC > 3:
        _chunk_store(g_rows, out_ok, g3, 3 * DCH, D_MODEL, scale, DCH)
    if not KEY_MAJOR:
        if HAS_C:
            parts = tl.arange(0, NP)[None, :]
            dc_ptrs = DC + b * L * N_PARTS + offs_out[:, None] * N_PARTS + parts
            dc_ok = out_ok[:, None] & (parts < N_PARTS)
            tl.store(dc_ptrs, dc.to(DC.dtype.element_ty), mask=dc_ok)


# one kernel, two autotuned launchers: the row-major dQ/dc and key-major dX programs have
# different register budgets
partition_bwd_dq_kernel = _autotune(DQ_CONFIGS)(_bwd_dqdx)
partition_bwd_dx_kernel = _autotune(DX_CONFIGS)(_bwd_dqdx)
