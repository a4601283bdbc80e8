"""Triton mixing kernels of the hybrid partition attention (eq. 2, 3, 5 and §3.3).

The single head makes the score matrix one l x l matrix per sequence, so the d-wide products are
plain cuBLAS GEMMs outside these kernels (shatter/attention/triton_kernel.py): Z = Q Xᵀ/√d before
them, dQ = dZ X and dX = dZᵀ Q after them. What is left here is memory-bound and 64 wide: with
the part bias b_ij = Σ_h c_ih f_h(j−i) (c = Q Rᵀ, §3.3) and the key mask m,

    p_ij      = sigmoid(z_ij + b_ij) m_j,   ρ_i = 1 / ‖p_i‖,   A_ij = ρ_i p_ij       (eq. 5)
    softmax:  A_ij = exp(z_ij + b_ij − M_i − log Σ_j exp(z_ij + b_ij − M_i))      (1h-softmax)
    X̄[h]_i    = Σ_j A_ij f_h(j−i) V[h]_j,   A_part_ih = Σ_j A_ij f_h(j−i)      (eq. 2-3, §3.3)

f_h(j−i) is gathered from the layer's constant table (shatter/partition.py). Parts 0..n/2−1 vanish
left of the diagonal and parts n/2..n−1 right of it (the appendix's mirror halves).

Forward: `row_stats_kernel` (one program per row block) sweeps the scores once for ρ (or the
row maximum and log-sum) and writes z + b into Z, so that the kernels after it read eq. 5's
argument as it is and make b nowhere else: from sm_80 it makes Z's tiles itself (Q Xᵀ/√d over d
on chip, the GEMM cuBLAS would run, with the statistics and the bias in its epilogue:
`family.z_inside`); below sm_80 it reads cuBLAS's Z and, with the bias, writes z + b back. Then
`mix_fwd_kernel` (one program per row block, side and group of parts) sweeps that
side's keys with one accumulator of [BLOCK_M, d/n] per part of its group (64-wide dots) and writes
X̄ and A_part normalised, in the input dtype. A group's GROUP parts come from the autotune
configuration (`usable`): all n/2 parts of the side where their accumulators fit the registers
without spills (sm_90 at n = 12: the side's Z tiles read once), else fewer.

Backward, with δ_i = Σ_j dA_ij A_ij = Σ_h ⟨dX̄[h]_i, X̄[h]_i⟩ + ⟨dA_part_i, A_part_i⟩ from the
saved outputs (`delta_kernel`, FlashAttention-2's preprocess) and
dA_ij = Σ_h f_h(j−i) (⟨dX̄[h]_i, V[h]_j⟩ + dA_part_ih):

    sigmoid: dS_ij = ρ_i m_j s_ij (1 − s_ij) (dA_ij − A_ij δ_i)          (as lean.PartitionMix)
    softmax: dS_ij = A_ij (dA_ij − δ_i) at real keys
    dc_ih = Σ_j dS_ij f_h(j−i),   dV[h]_j = Σ_i A_ij f_h(j−i) dX̄[h]_i

`mix_bwd_dv_kernel` (key block, side and group, as the forward) gives dV; `mix_bwd_dz_kernel` (row
block) gives dc and writes dZ = dS/√d in the input dtype: the 1/√d of Z's GEMM applied before the
rounding keeps fp16 values no larger than the dQ and dX that the GEMMs make from them.

Every kernel that reads scores takes them from one of two sources (the compile-time RECOMPUTE,
`_score_tile`): the saved Z, which holds z + b (the hybrid `triton` impl), or tiles of Q Xᵀ/√d
made on chip from Q and the keys X over d in BLOCK_D steps, b added on chip (`_qx_tile`; the
`fused` impl, shatter/kernels/fused_attention.py, in which Z never reaches HBM and dZ holds
dS/√d).

Each kernel's sweep over key (or row) tiles is a loop with no loop inside it wherever Z is read:
Triton software-pipelines only such a loop (the next tile's loads in flight as cp.async while
this tile's dots run as asynchronous wgmma). On an H200 the sweeps that had a loop over the bias's
parts inside them ran at 2-8% of the tensor peak, their loads and dots in series. So b is made
once (above) and a program's parts are unrolled; in the dZ kernel the loop over a tile's parts
is the innermost one, pipelined across parts. `tools/bench/kernel_report.py` fails a dot kernel with no
cp.async.

n ∈ {4, 6, ..., 16} (at most 8 unrolled accumulators). `tools/bench/kernel_report.py` compiles every
autotune configuration ahead of time for sm_80/sm_90 and checks shared memory, spills and tensor
cores. Under TRITON_INTERPRET=1 (CPU tests) one small configuration is tuned over.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shatter.kernels.family import family_of
from shatter.kernels.launch import INTERPRET, pow2

INTERPRETING = tl.constexpr(INTERPRET)
MAX_PARTS = 16  # n/2 <= 8 unrolled per-part accumulators
FP32_MIN = tl.constexpr(-3.4028234663852886e38)  # padded keys, as multihead.masked_softmax


def _cfg(block_m, block_n, warps, stages, archs=(80, 90), group=None, sources=(False, True)):
    """An autotune configuration and the arch families it is for (70: below sm_80, where the
    dots are FMAs and only Z is read; 80: sm_80..89, 90: sm_90+);
    `group` (forward and dV kernels): the parts of a side that one program takes; `sources`:
    the RECOMPUTE values it serves (False: Z read from HBM, True: Q Xᵀ recomputed on chip)."""
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    if group is not None:
        meta["GROUP"] = group
    config = triton.Config(meta, num_warps=warps, num_stages=stages)
    config.archs = archs
    config.sources = sources
    return config


# Checked by tools/bench/kernel_report.py (docs/benchmarks.md) within shared memory, without spills and
# with tensor-core instructions, at every configuration in every variant it serves (HAS_C,
# sigmoid/softmax, l = 512 and 509, d = 768/n = 12 and d = 1024/n = 16, bf16 and fp16), under
# the GPU image's Triton and the CPU's. The forward and dV kernels hold one [BLOCK, d/n] fp32
# accumulator per part of their GROUP. The autotuner times every GROUP that divides a side's n/2
# parts (`usable`): on sm_90 up to all 6 of a side at n = 12 (the side's Z tiles read once, but
# one program an SM, 16 keys a step) down to 2 over 64-key tiles; at n = 16 the forward up to 4
# (the dV kernel 2: 4 spilled 8 bytes under Triton 3.9); sm_80 (mma.sync, more registers per
# accumulator) 2. GROUP 1 only where no wider group serves n (n = 10 and 14; below sm_90 n = 6):
# its program takes part h0 alone, the kernels' second part being under `GROUP > 1` (h0 + 1
# would be the other side's part, or past the table and the context's last one). Below sm_80
# (family 70: V100, T4) the dots are FMAs, whose operands sit in registers: smaller tiles,
# GROUP 2, only Z read (no tensor-core instruction expected).
# the statistics kernel makes Z's tiles on chip on sm_80+ (Q Xᵀ/√d over d, `z_inside`; the
# fused impl's sweep, which writes nothing) and reads cuBLAS's Z below sm_80
STATS_CONFIGS = [  # sm_90's M64 N128 w4 spilled 96-128 bytes under 3.6
    _cfg(128, 64, 8, 2, archs=(90,), sources=(True,)),
    _cfg(128, 16, 8, 2, archs=(70,), sources=(False,)),  # N64 and N32 spilled 8 bytes at l = 509
    _cfg(128, 32, 8, 2, archs=(80,), sources=(True,)),  # N64 spilled 8 bytes (3.6)
]
FWD_CONFIGS = [
    _cfg(64, 16, 8, 2, archs=(90,), group=6),
    _cfg(64, 32, 8, 2, archs=(90,), group=4),
    _cfg(64, 32, 8, 2, archs=(90,), group=3),
    _cfg(64, 64, 8, 2, archs=(90,), group=2),  # N64 G3 spilled 16-80 B, N64 w4 G2 72-240 B
    _cfg(64, 32, 8, 2, archs=(80,), group=2),
    _cfg(64, 32, 8, 2, archs=(70,), group=2, sources=(False,)),  # M64 N32 w4 spilled 928 bytes
    _cfg(64, 32, 8, 2, archs=(70,), group=1, sources=(False,)),
    _cfg(64, 32, 4, 2, group=1),
]
DV_CONFIGS = [
    _cfg(64, 32, 8, 2, archs=(90,), group=6, sources=(False,)),
    _cfg(32, 64, 8, 2, archs=(90,), group=6, sources=(True,)),  # M64 N32 spilled recomputing
    _cfg(64, 32, 8, 2, archs=(90,), group=3),
    _cfg(64, 64, 8, 2, archs=(90,), group=2),
    _cfg(32, 64, 4, 2, archs=(80,), group=2),  # M64 N64 w8 spilled 8-24 bytes at l = 509 (3.6)
    _cfg(32, 64, 8, 2, archs=(70,), group=2, sources=(False,)),  # M64 N32 w8 spilled 592 bytes
    _cfg(32, 64, 8, 2, archs=(70,), group=1, sources=(False,)),
    _cfg(64, 32, 4, 2, group=1),
]
DELTA_CONFIGS = [_cfg(64, 16, 4, 1, archs=(70, 80, 90))]
DZ_CONFIGS = [  # sm_90's M64 N64 w4 and M64 N128 w8 spilled under 3.6
    _cfg(64, 64, 8, 2, archs=(90,)),
    _cfg(64, 64, 8, 2, archs=(80,), sources=(True,)),  # M32 N32 w4 spilled 16 B (3.9)
    # reading Z: M64 N64 w8, M64 N32 w8 and M32 N64 w4 spilled 8-24 B
    _cfg(32, 32, 4, 2, archs=(80,), sources=(False,)),
    _cfg(32, 32, 8, 1, archs=(70,), sources=(False,)),  # sm_70's M64 N64 w8 spilled 2.7 KB
]
# every compile-time constant that changes the code: a kernel is keyed on those it takes
AUTOTUNE_KEY = ["L_KEY", "N_PARTS", "HAS_C", "SIGMOID", "BLOCK_K", "PREC", "NP", "RECOMPUTE", "BLOCK_D", "DELTA_INSIDE", "KEEP"]  # fmt: skip
ACC_COLUMNS = 384  # fp32 accumulator columns of a program's group: 6 parts of 64


def usable(configs, n: int, block_k: int, family: int | None = None, recompute=False) -> list:
    """The configurations for an arch family (None: any) and score source (`recompute`) that
    serve n parts of BLOCK_K: those whose GROUP divides a side's n/2 parts and fits ACC_COLUMNS,
    the largest GROUP first (the one the cost model prices). The
    autotuner times them all: on an H200 the widest group alone (sm_90's M64 N16 G6: one
    program an SM at 244 registers, 16 keys a step) ran the forward at 2-8% of the tensor peak,
    so narrower groups over wider key tiles (more programs, fewer serial steps) compete."""
    mine = [c for c in configs if (family is None or family in c.archs) and recompute in c.sources]
    group = {c: c.kwargs.get("GROUP", 0) for c in mine}
    fit = [c for c in mine if not group[c] or (n // 2 % group[c] == 0 and group[c] * block_k <= ACC_COLUMNS)]  # fmt: skip
    if any(group[c] > 1 for c in fit):  # GROUP 1 only where no wider group serves n
        fit = [c for c in fit if group[c] != 1]
    return sorted(fit, key=lambda c: -group[c])  # stable: the list's order within a group


def block_k(d: int, n: int) -> int:
    """BLOCK_K, the accumulator width of a part's d/n values (at least 16: tl.dot's minimum)."""
    return max(16, pow2(d // n))


def _for_this_call(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    family = None if INTERPRET else family_of(torch.cuda.get_device_capability())
    block_k = args.get("BLOCK_K", 16)  # the kernels without GROUP take no BLOCK_K
    return usable(configs, args["N_PARTS"], block_k, family, args.get("RECOMPUTE", False))


def _autotune(configs, restore=()):
    """triton.autotune over `configs`, pruned to those that serve the call's arch and n (under
    the interpreter: 16 x 16 tiles, all of a side's parts in one program), keyed on the
    AUTOTUNE_KEY constants that the kernel takes. `restore`: the arguments a kernel writes in
    place, copied before each timed run and put back after it (the timing runs a kernel many
    times, Triton 3.6 even with one configuration left)."""

    def wrap(fn):
        key = [name for name in AUTOTUNE_KEY if name in fn.arg_names]
        if INTERPRET:
            groups = range(MAX_PARTS // 2, 0, -1) if "GROUP" in configs[0].kwargs else [None]
            configs_ = [_cfg(16, 16, 1, 1, group=g) for g in groups]
        tune = dict(key=key, prune_configs_by={"early_config_prune": _for_this_call})
        if restore:
            tune["restore_value"] = list(restore)
        if INTERPRET:
            return triton.autotune(configs=configs_, do_bench=_untimed, **tune)(fn)
        return triton.autotune(configs=configs, **tune)(fn)

    return wrap


def _untimed(kernel_call, quantiles):
    """The interpreter's "timing": its pruning leaves one configuration, so there is nothing to
    choose. Triton before 3.9 times even a single configuration, through a GPU driver that the
    interpreter on a CPU does not have ("0 active drivers")."""
    return [0.0] * len(quantiles)


# ------------------------------------------------------------------------------------ tiles


@triton.jit
def _part_range(i0, j0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_PARTS: tl.constexpr):
    """The parts that can be non-zero on the tile rows i0.., keys j0..: only the right half
    (0..n/2-1) at or right of the diagonal, only the left half at or left of it."""
    lo = tl.where(j0 + BLOCK_N - 1 < i0, N_PARTS // 2, 0)
    hi = tl.where(j0 > i0 + BLOCK_M - 1, N_PARTS // 2, N_PARTS)
    return lo, hi


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """acc + a b in fp32. Under the interpreter, bf16 operands are widened first: Triton's
    interpreter multiplies bf16 dots on their raw 16-bit patterns (as integers)."""
    if INTERPRETING:
        if a.dtype == tl.bfloat16:
            a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _qx_tile(
    Q, X, b, i0, j0, L, D, scale, sq_b, sq_l, sx_b, sx_l, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """z = Q_i X_jᵀ · scale on the tile in fp32 (eq. 5's Z = Q Xᵀ/√d), over d in BLOCK_D steps:
    recomputed on chip, never stored."""
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * sq_b + offs_m[:, None] * sq_l + offs_d[None, :]
    x_ptrs = X + b * sx_b + offs_n[None, :] * sx_l + offs_d[:, None]  # Xᵀ: [BLOCK_D, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = d0 + offs_d < D
        q = tl.load(q_ptrs + d0, mask=(offs_m < L)[:, None] & d_ok[None, :], other=0.0)
        x = tl.load(x_ptrs + d0, mask=d_ok[:, None] & (offs_n < L)[None, :], other=0.0)
        acc = _dot(q, x, acc, PREC)
    return acc * scale


@triton.jit
def _score_tile(
    Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, KEEP: tl.constexpr = False,
):  # fmt: skip
    """z + b on the tile in fp32 (eq. 5's argument), the table column of j − i, the in-sequence
    mask and the key mask m. z is made on chip with RECOMPUTE from Q (passed as Z, strides sz_*)
    and the keys X (sx_*), and b added; else it is read from Z (already / √d, strides sz_*),
    which holds z + b after the row statistics' sweep: with KEEP (that sweep, which writes
    z + b for the kernels after it: `_kept`) b is added here to the z it reads."""
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    row_ok = offs_m < L
    col_ok = offs_n < L
    ok = row_ok[:, None] & col_ok[None, :]
    z_ptrs = Z + b * sz_b + offs_m[:, None] * sz_l + offs_n[None, :]
    if RECOMPUTE:
        z = _qx_tile(Z, X, b, i0, j0, L, D, scale, sz_b, sz_l, sx_b, sx_l, BLOCK_M, BLOCK_N, BLOCK_D, PREC)  # fmt: skip
    else:
        z = tl.load(z_ptrs, mask=ok, other=0.0).to(tl.float32)
    col = offs_n[None, :] - offs_m[:, None] + T_CENTRE  # f_h(j - i) is table column j-i+m-1
    if HAS_C and (RECOMPUTE or KEEP):  # b_ij = sum_h c_ih f_h(j - i), §3.3
        lo, hi = _part_range(i0, j0, BLOCK_M, BLOCK_N, N_PARTS)
        for h in range(lo, hi):
            f = tl.load(T + h * st_h + col, mask=ok, other=0.0)
            c_h = tl.load(C + b * sc_b + offs_m * sc_l + h, mask=row_ok, other=0.0)
            z += c_h.to(tl.float32)[:, None] * f
    m = tl.load(Mk + b * L + offs_n, mask=col_ok, other=0).to(tl.float32)  # bool or int as is
    return z, col, ok, m


@triton.jit
def _weights(z, m, ok, stat, stat2, SIGMOID: tl.constexpr):
    """A on the tile from the row statistics (sigmoid: stat = ρ; softmax: stat = the row maximum,
    stat2 = log Σ_j exp(z_ij − max), apart so that a row with no real key keeps its uniform
    weights), and g with dS = g ⊙ (dA − A δ) (sigmoid: g = ρ m s (1 − s)) or dS = g ⊙ (dA − δ)
    (softmax: g = A at real keys)."""
    if SIGMOID:
        s = tl.sigmoid(z)
        a = tl.where(ok, s * m[None, :], 0.0) * stat[:, None]
        g = (stat[:, None] * m[None, :]) * (s * (1.0 - s))
    else:
        logit = tl.where(m[None, :] > 0, z, FP32_MIN)
        a = tl.where(ok, tl.exp((logit - stat[:, None]) - stat2[:, None]), 0.0)
        g = tl.where(m[None, :] > 0, a, 0.0)
    return a, g


@triton.jit
def _program_parts(N_PARTS: tl.constexpr, GROUP: tl.constexpr):
    """(batch, side, first part) of a program whose second grid axis is batch × side × group:
    side 0 holds parts 0..n/2-1 (keys j >= i), side 1 parts n/2..n-1 (j <= i)."""
    groups: tl.constexpr = N_PARTS // 2 // GROUP
    pid = tl.program_id(1)
    b = (pid // (2 * groups)).to(tl.int64)
    side = (pid // groups) % 2
    return b, side, side * (N_PARTS // 2) + (pid % groups) * GROUP


@triton.jit
def _load_stats(STAT, STAT2, b, i0, L, BLOCK_M: tl.constexpr):
    """The row statistics the weights take."""
    offs_m = i0 + tl.arange(0, BLOCK_M)
    stat = tl.load(STAT + b * L + offs_m, mask=offs_m < L, other=0.0)
    stat2 = tl.load(STAT2 + b * L + offs_m, mask=offs_m < L, other=0.0)
    return stat, stat2


@triton.jit
def _fwd_part(acc, a_sum, a, f_ptr, col, ok, v_ptrs, v_ok, PREC: tl.constexpr):
    """One part h: acc += (A ⊙ f_h) V[h], a_sum += rowsum(A ⊙ f_h)."""
    w = a * tl.load(f_ptr + col, mask=ok, other=0.0)
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    return _dot(w.to(v.dtype), v, acc, PREC), a_sum + tl.sum(w, 1)


@triton.jit
def _dv_part(acc, a, f_ptr, col, ok, do_ptrs, do_ok, PREC: tl.constexpr):
    """One part h: dV[h] += (A ⊙ f_h)ᵀ dX̄[h]."""
    w = a * tl.load(f_ptr + col, mask=ok, other=0.0)
    do = tl.load(do_ptrs, mask=do_ok, other=0.0)
    return _dot(tl.trans(w).to(do.dtype), do, acc, PREC)


@triton.jit
def _store_part(o_ptrs, acc, o_ok, a_ptrs, ap, row_ok, r):
    """One part's X̄ and A_part column, each row times its factor r (ρ, or 1)."""
    tl.store(o_ptrs, (acc * r[:, None]).to(o_ptrs.dtype.element_ty), mask=o_ok)
    tl.store(a_ptrs, (ap * r).to(a_ptrs.dtype.element_ty), mask=row_ok)


@triton.jit
def _row_delta(
    OUT, DO, AP, DAP, b, offs_m, offs_k, row_ok, k_ok, so_b, so_h, so_l, sd_b, sd_h, sd_l,
    sa_b, sa_l, sp_b, sp_l, N_PARTS: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """δ_i = Σ_h ⟨dX̄[h]_i, X̄[h]_i⟩ + ⟨dA_part_i, A_part_i⟩ in fp32 for the rows offs_m, from the
    saved outputs (FlashAttention-2's preprocess): OUT's strides so_*, DO's sd_*, AP's sa_*,
    DAP's sp_*."""
    ok = row_ok[:, None] & k_ok
    o_base = OUT + b * so_b + offs_m[:, None] * so_l + offs_k[None, :]
    do_base = DO + b * sd_b + offs_m[:, None] * sd_l + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for h in range(N_PARTS):
        o = tl.load(o_base + h * so_h, mask=ok, other=0.0).to(tl.float32)
        do = tl.load(do_base + h * sd_h, mask=ok, other=0.0).to(tl.float32)
        acc += o * do
    parts = tl.arange(0, NP)
    p_ok = row_ok[:, None] & (parts < N_PARTS)[None, :]
    ap = tl.load(AP + b * sa_b + offs_m[:, None] * sa_l + parts[None, :], mask=p_ok, other=0.0)
    dap = tl.load(DAP + b * sp_b + offs_m[:, None] * sp_l + parts[None, :], mask=p_ok, other=0.0)
    return tl.sum(acc, 1) + tl.sum(ap.to(tl.float32) * dap.to(tl.float32), 1)


@triton.jit
def _kept(ZO, z, ok, b, i0, j0, szo_b, szo_l, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """z + b of the tile written into ZO (strides szo_*) in its dtype, for every kernel after the
    row statistics' sweep; returned as written (rounded), so that the statistics are of the
    scores those kernels read."""
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    kept = z.to(ZO.dtype.element_ty)
    tl.store(ZO + b * szo_b + offs_m[:, None] * szo_l + offs_n[None, :], kept, mask=ok)
    return kept.to(tl.float32)


@triton.jit
def _squares(
    Z, X, C, Mk, T, b, i0, j_lo, j_hi, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D,
    scale, ZO, szo_b, szo_l, HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    KEEP: tl.constexpr = False,
):  # fmt: skip
    """Σ_j p_ij² over the key tiles from j_lo to j_hi (eq. 5: padded keys zeroed before the L2
    normalisation), in fp32 for the rows of the block at i0; with KEEP z + b written into ZO
    (`_kept`)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        z, col, ok, m = _score_tile(
            Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D,
            scale, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D, PREC, KEEP,
        )  # fmt: skip
        if KEEP:
            z = _kept(ZO, z, ok, b, i0, j0, szo_b, szo_l, BLOCK_M, BLOCK_N)
        p = tl.where(ok, tl.sigmoid(z) * m[None, :], 0.0)
        ss += tl.sum(p * p, 1)
    return ss


@triton.jit
def _fill_alignment(AP, b, sa_b, sa_l, offs_m, L, AP_COLS, N_PARTS: tl.constexpr,
                    BLOCK_M: tl.constexpr, NP: tl.constexpr):  # fmt: skip
    """The AP_COLS − n <= NP columns that follow A_part in the context
    (projection.context_width): a column of ones, for the folded W^O's bias column, then
    zeros, for its zero columns."""
    cols = N_PARTS + tl.arange(0, NP)
    pad_ptrs = AP + b * sa_b + offs_m[:, None] * sa_l + cols[None, :]
    pad_ok = (offs_m < L)[:, None] & (cols < AP_COLS)[None, :]
    ones = tl.zeros([BLOCK_M, NP], dtype=tl.float32) + (cols == N_PARTS)[None, :].to(tl.float32)
    tl.store(pad_ptrs, ones.to(AP.dtype.element_ty), mask=pad_ok)


@triton.jit
def _rho(ss):
    return 1.0 / tl.maximum(tl.sqrt(ss), 1e-12)


# ---------------------------------------------------------------------------------- kernels


@_autotune(STATS_CONFIGS, restore=("ZO",))  # ZO may be Z itself, written in place
@triton.jit
def row_stats_kernel(
    Z, X, C, Mk, T, STAT, STAT2, ZO, sz_b, sz_l, sx_b, sx_l, szo_b, szo_l, sc_b, sc_l, st_h, L,
    L_KEY, T_CENTRE, D, scale, HAS_C: tl.constexpr, N_PARTS: tl.constexpr, SIGMOID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr, KEEP: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch): ρ = 1/‖p‖ (sigmoid; STAT2 unused) or the row maximum and
    log Σ exp(z − max) (softmax, online over the key blocks); with KEEP, z + b written into ZO
    for the kernels after it (`_kept`): Z made here on chip (RECOMPUTE, the hybrid's Z on
    sm_80+: `z_inside`), or read from cuBLAS's Z with the bias added and written back in place
    (ZO = Z)."""
    b = tl.program_id(1).to(tl.int64)
    i0 = tl.program_id(0) * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < L
    if SIGMOID:
        ss = _squares(
            Z, X, C, Mk, T, b, i0, 0, L, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h,
            D, scale, ZO, szo_b, szo_l, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D,
            PREC, KEEP,
        )  # fmt: skip
        tl.store(STAT + b * L + offs_m, _rho(ss), mask=row_ok)
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        mx = tl.full([BLOCK_M], FP32_MIN, dtype=tl.float32)
        for j0 in range(0, L, BLOCK_N):
            z, col, ok, m = _score_tile(
                Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h,
                D, scale, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D, PREC, KEEP,
            )  # fmt: skip
            if KEEP:
                z = _kept(ZO, z, ok, b, i0, j0, szo_b, szo_l, BLOCK_M, BLOCK_N)
            logit = tl.where(m[None, :] > 0, z, FP32_MIN)
            logit = tl.where(ok, logit, float("-inf"))
            mx_new = tl.maximum(mx, tl.max(logit, 1))
            ss = ss * tl.exp(mx - mx_new) + tl.sum(tl.exp(logit - mx_new[:, None]), 1)
            mx = mx_new
        tl.store(STAT + b * L + offs_m, mx, mask=row_ok)
        tl.store(STAT2 + b * L + offs_m, tl.log(tl.where(row_ok, ss, 1.0)), mask=row_ok)


@_autotune(FWD_CONFIGS)
@triton.jit
def mix_fwd_kernel(
    Z, X, C, Mk, T, V, STAT, STAT2, OUT, AP,
    sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, sv_b, sv_h, sv_l, so_b, so_h, so_l, sa_b, sa_l,
    L, L_KEY, K_PART, T_CENTRE, D, scale, AP_COLS,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch × side × group): X̄[h] and A_part[:, h] of GROUP of the side's
    n/2 parts (fewer than n/2 re-read the side's Z); part 0's also fills `_fill_alignment`'s
    columns."""
    b, side, h0 = _program_parts(N_PARTS, GROUP)
    i0 = tl.program_id(0) * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if h0 == 0:  # first, while no accumulator holds registers
        _fill_alignment(AP, b, sa_b, sa_l, offs_m, L, AP_COLS, N_PARTS, BLOCK_M, NP)
    lo = tl.where(side == 0, (i0 // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(side == 0, L, tl.minimum(L, i0 + BLOCK_M))
    stat, stat2 = _load_stats(STAT, STAT2, b, i0, L, BLOCK_M)
    acc0 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    ap0 = tl.zeros([BLOCK_M], dtype=tl.float32)
    ap1, ap2, ap3, ap4, ap5, ap6, ap7 = ap0, ap0, ap0, ap0, ap0, ap0, ap0
    f_ptr = T + h0 * st_h
    for j0 in range(lo, hi, BLOCK_N):
        z, col, ok, m = _score_tile(
            Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D,
            scale, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D, PREC,
        )  # fmt: skip
        a, _ = _weights(z, m, ok, stat, stat2, SIGMOID)
        offs_n = j0 + tl.arange(0, BLOCK_N)
        v_ptrs = V + b * sv_b + h0 * sv_h + offs_n[:, None] * sv_l + offs_k[None, :]
        v_ok = (offs_n < L)[:, None] & (offs_k < K_PART)[None, :]
        acc0, ap0 = _fwd_part(acc0, ap0, a, f_ptr, col, ok, v_ptrs, v_ok, PREC)
        if GROUP > 1:
            acc1, ap1 = _fwd_part(acc1, ap1, a, f_ptr + st_h, col, ok, v_ptrs + sv_h, v_ok, PREC)
        if GROUP > 2:
            acc2, ap2 = _fwd_part(acc2, ap2, a, f_ptr + 2 * st_h, col, ok, v_ptrs + 2 * sv_h, v_ok, PREC)  # fmt: skip
        if GROUP > 3:
            acc3, ap3 = _fwd_part(acc3, ap3, a, f_ptr + 3 * st_h, col, ok, v_ptrs + 3 * sv_h, v_ok, PREC)  # fmt: skip
        if GROUP > 4:
            acc4, ap4 = _fwd_part(acc4, ap4, a, f_ptr + 4 * st_h, col, ok, v_ptrs + 4 * sv_h, v_ok, PREC)  # fmt: skip
        if GROUP > 5:
            acc5, ap5 = _fwd_part(acc5, ap5, a, f_ptr + 5 * st_h, col, ok, v_ptrs + 5 * sv_h, v_ok, PREC)  # fmt: skip
        if GROUP > 6:
            acc6, ap6 = _fwd_part(acc6, ap6, a, f_ptr + 6 * st_h, col, ok, v_ptrs + 6 * sv_h, v_ok, PREC)  # fmt: skip
        if GROUP > 7:
            acc7, ap7 = _fwd_part(acc7, ap7, a, f_ptr + 7 * st_h, col, ok, v_ptrs + 7 * sv_h, v_ok, PREC)  # fmt: skip
    row_ok = offs_m < L
    r = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # the weights' statistics applied already
    o = OUT + b * so_b + h0 * so_h + offs_m[:, None] * so_l + offs_k[None, :]
    o_ok = row_ok[:, None] & (offs_k < K_PART)[None, :]
    a_ptrs = AP + b * sa_b + offs_m * sa_l + h0
    _store_part(o, acc0, o_ok, a_ptrs, ap0, row_ok, r)
    if GROUP > 1:
        _store_part(o + so_h, acc1, o_ok, a_ptrs + 1, ap1, row_ok, r)
    if GROUP > 2:
        _store_part(o + 2 * so_h, acc2, o_ok, a_ptrs + 2, ap2, row_ok, r)
    if GROUP > 3:
        _store_part(o + 3 * so_h, acc3, o_ok, a_ptrs + 3, ap3, row_ok, r)
    if GROUP > 4:
        _store_part(o + 4 * so_h, acc4, o_ok, a_ptrs + 4, ap4, row_ok, r)
    if GROUP > 5:
        _store_part(o + 5 * so_h, acc5, o_ok, a_ptrs + 5, ap5, row_ok, r)
    if GROUP > 6:
        _store_part(o + 6 * so_h, acc6, o_ok, a_ptrs + 6, ap6, row_ok, r)
    if GROUP > 7:
        _store_part(o + 7 * so_h, acc7, o_ok, a_ptrs + 7, ap7, row_ok, r)


@_autotune(DELTA_CONFIGS)
@triton.jit
def delta_kernel(
    OUT, DO, AP, DAP, DELTA, so_b, so_h, so_l, sd_b, sd_h, sd_l, sa_b, sa_l, sp_b, sp_l,
    L, L_KEY, K_PART,
    N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, NP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch): DELTA = δ [B, L] of its rows (`_row_delta`). A launch of its
    own on sm_80 (`delta_inside`); on sm_90 and sm_70 the dZ kernel makes δ in its prologue."""
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < L
    delta = _row_delta(
        OUT, DO, AP, DAP, b, offs_m, offs_k, row_ok, (offs_k < K_PART)[None, :], so_b, so_h,
        so_l, sd_b, sd_h, sd_l, sa_b, sa_l, sp_b, sp_l, N_PARTS, NP, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    tl.store(DELTA + b * L + offs_m, delta, mask=row_ok)


@_autotune(DV_CONFIGS)
@triton.jit
def mix_bwd_dv_kernel(
    Z, X, C, Mk, T, STAT, STAT2, DO, DV,
    sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, sd_b, sd_h, sd_l, sg_b, sg_h, sg_l,
    L, L_KEY, K_PART, T_CENTRE, D, scale,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (key block, batch × side × group): dV[h] = Σ_i (A ⊙ f_h)ᵀ dX̄[h] for GROUP of the
    side's parts (side 0: rows i <= j; side 1: i >= j); dO's [B, n, L, d/n] strides sd_*, dV's
    sg_*."""
    b, side, h0 = _program_parts(N_PARTS, GROUP)
    j0 = tl.program_id(0) * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    lo = tl.where(side == 0, 0, (j0 // BLOCK_M) * BLOCK_M)
    hi = tl.where(side == 0, tl.minimum(L, j0 + BLOCK_N), L)
    f_ptr = T + h0 * st_h
    for i0 in range(lo, hi, BLOCK_M):
        z, col, ok, m = _score_tile(
            Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D,
            scale, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D, PREC,
        )  # fmt: skip
        stat, stat2 = _load_stats(STAT, STAT2, b, i0, L, BLOCK_M)
        a, _ = _weights(z, m, ok, stat, stat2, SIGMOID)
        offs_m = i0 + tl.arange(0, BLOCK_M)
        do = DO + b * sd_b + h0 * sd_h + offs_m[:, None] * sd_l + offs_k[None, :]
        do_ok = (offs_m < L)[:, None] & (offs_k < K_PART)[None, :]
        acc0 = _dv_part(acc0, a, f_ptr, col, ok, do, do_ok, PREC)
        if GROUP > 1:
            acc1 = _dv_part(acc1, a, f_ptr + st_h, col, ok, do + sd_h, do_ok, PREC)
        if GROUP > 2:
            acc2 = _dv_part(acc2, a, f_ptr + 2 * st_h, col, ok, do + 2 * sd_h, do_ok, PREC)
        if GROUP > 3:
            acc3 = _dv_part(acc3, a, f_ptr + 3 * st_h, col, ok, do + 3 * sd_h, do_ok, PREC)
        if GROUP > 4:
            acc4 = _dv_part(acc4, a, f_ptr + 4 * st_h, col, ok, do + 4 * sd_h, do_ok, PREC)
        if GROUP > 5:
            acc5 = _dv_part(acc5, a, f_ptr + 5 * st_h, col, ok, do + 5 * sd_h, do_ok, PREC)
        if GROUP > 6:
            acc6 = _dv_part(acc6, a, f_ptr + 6 * st_h, col, ok, do + 6 * sd_h, do_ok, PREC)
        if GROUP > 7:
            acc7 = _dv_part(acc7, a, f_ptr + 7 * st_h, col, ok, do + 7 * sd_h, do_ok, PREC)
    dv = DV + b * sg_b + h0 * sg_h + offs_n[:, None] * sg_l + offs_k[None, :]
    dv_ok = (offs_n < L)[:, None] & (offs_k < K_PART)[None, :]
    ty = DV.dtype.element_ty
    tl.store(dv, acc0.to(ty), mask=dv_ok)
    if GROUP > 1:
        tl.store(dv + sg_h, acc1.to(ty), mask=dv_ok)
    if GROUP > 2:
        tl.store(dv + 2 * sg_h, acc2.to(ty), mask=dv_ok)
    if GROUP > 3:
        tl.store(dv + 3 * sg_h, acc3.to(ty), mask=dv_ok)
    if GROUP > 4:
        tl.store(dv + 4 * sg_h, acc4.to(ty), mask=dv_ok)
    if GROUP > 5:
        tl.store(dv + 5 * sg_h, acc5.to(ty), mask=dv_ok)
    if GROUP > 6:
        tl.store(dv + 6 * sg_h, acc6.to(ty), mask=dv_ok)
    if GROUP > 7:
        tl.store(dv + 7 * sg_h, acc7.to(ty), mask=dv_ok)


@_autotune(DZ_CONFIGS)
@triton.jit
def mix_bwd_dz_kernel(
    Z, X, C, Mk, T, V, STAT, STAT2, DELTA, DO, DAP, DZ, DC, OUT, AP,
    sz_b, sz_l, sx_b, sx_l, sdz_b, sdz_l, sc_b, sc_l, st_h, sv_b, sv_h, sv_l, sd_b, sd_h, sd_l,
    sp_b, sp_l, sdc_b, sdc_l, so_b, so_h, so_l, sa_b, sa_l, L, L_KEY, K_PART, T_CENTRE, D,
    scale, DC_COLS,
    HAS_C: tl.constexpr, N_PARTS: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    SIGMOID: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RECOMPUTE: tl.constexpr, BLOCK_D: tl.constexpr, DELTA_INSIDE: tl.constexpr,
):  # fmt: skip
    """Program (row block, batch) over all key blocks: DZ = dS · scale (strides sdz_*, the
    input dtype) and, with the part bias, DC = dc [B, L, n] (sdc_*) followed by zeros up to
    DC_COLS <= NP columns (dP's alignment columns after c's). δ [B, L] is read from DELTA
    (`delta_kernel`) or, with DELTA_INSIDE, made here first from the saved outputs OUT X̄
    (so_*) and AP A_part (sa_*) (`_row_delta`); DO is dX̄ [B, n, L, d/n] (sd_*), DAP dA_part
    [B, L, n] (sp_*)."""
    b = tl.program_id(1).to(tl.int64)
    i0 = tl.program_id(0) * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < L
    k_ok = (offs_k < K_PART)[None, :]
    stat, stat2 = _load_stats(STAT, STAT2, b, i0, L, BLOCK_M)
    if DELTA_INSIDE:
        delta = _row_delta(
            OUT, DO, AP, DAP, b, offs_m, offs_k, row_ok, k_ok, so_b, so_h, so_l, sd_b, sd_h,
            sd_l, sa_b, sa_l, sp_b, sp_l, N_PARTS, NP, BLOCK_M, BLOCK_K,
        )  # fmt: skip
    else:
        delta = tl.load(DELTA + b * L + offs_m, mask=row_ok, other=0.0)
    dc = tl.zeros([BLOCK_M, NP], dtype=tl.float32)
    parts = tl.arange(0, NP)[None, :]
    do_ptrs = DO + b * sd_b + offs_m[:, None] * sd_l + offs_k[None, :]
    for j0 in range(0, L, BLOCK_N):
        z, col, ok, m = _score_tile(
            Z, X, C, Mk, T, b, i0, j0, L, T_CENTRE, sz_b, sz_l, sx_b, sx_l, sc_b, sc_l, st_h, D,
            scale, HAS_C, N_PARTS, BLOCK_M, BLOCK_N, RECOMPUTE, BLOCK_D, PREC,
        )  # fmt: skip
        a, g = _weights(z, m, ok, stat, stat2, SIGMOID)
        offs_n = j0 + tl.arange(0, BLOCK_N)
        v_ptrs = V + b * sv_b + offs_n[:, None] * sv_l + offs_k[None, :]
        col_ok = (offs_n < L)[:, None] & k_ok
        da = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        lo, hi = _part_range(i0, j0, BLOCK_M, BLOCK_N, N_PARTS)
        for h in range(lo, hi):  # dA = Σ_h f_h ⊙ (dX̄[h] V[h]ᵀ + dA_part[:, h])
            f = tl.load(T + h * st_h + col, mask=ok, other=0.0)
            do = tl.load(do_ptrs + h * sd_h, mask=row_ok[:, None] & k_ok, other=0.0)
            v = tl.load(v_ptrs + h * sv_h, mask=col_ok, other=0.0)
            dap = tl.load(DAP + b * sp_b + offs_m * sp_l + h, mask=row_ok, other=0.0)
            da += f * (_dot(do, tl.trans(v), None, PREC) + dap.to(tl.float32)[:, None])
        if SIGMOID:
            ds = g * (da - a * delta[:, None])
        else:
            ds = g * (da - delta[:, None])
        ds = tl.where(ok, ds, 0.0)
        if HAS_C:  # dc_ih += Σ_j dS_ij f_h(j - i)
            for h in range(lo, hi):
                f = tl.load(T + h * st_h + col, mask=ok, other=0.0)
                dc += tl.where(parts == h, tl.sum(ds * f, 1)[:, None], 0.0)
        dz_ptrs = DZ + b * sdz_b + offs_m[:, None] * sdz_l + offs_n[None, :]
        tl.store(dz_ptrs, (ds * scale).to(DZ.dtype.element_ty), mask=ok)
    if HAS_C:  # dc, and zeros in the DC_COLS - n alignment columns that follow it in dP
        dc_ptrs = DC + b * sdc_b + offs_m[:, None] * sdc_l + parts
        tl.store(dc_ptrs, dc.to(DC.dtype.element_ty), mask=row_ok[:, None] & (parts < DC_COLS))
