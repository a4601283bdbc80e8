"""The hybrid Triton partition attention behind `attention_impl="triton"` (eq. 2, 3, 5, §3.3).

Shatter has one head: the score matrix Z = Q Xᵀ/√d is a single l x l matrix per sequence (B·l²
elements in the input dtype, less than the Q, K, V and O that BERT's flash attention saves), so
the three d-wide products are cuBLAS GEMMs in the input dtype with fp32 accumulation:

    forward    Z = Q Xᵀ/√d                         saved for the backward pass
    backward   dQ = dZ X,   dX_key = dZᵀ Q         dZ = dS/√d, written by the mixing kernel

and only the memory-bound part mixing runs in Triton (shatter/kernels/partition_mixing.py): the
mask, the sigmoid (or 1h-softmax's softmax), the partition bias c·f(j−i), the n/2 parts per side
with 64-wide dots, ‖p‖, and the outputs normalised in the input dtype; the backward pass takes δ
from the saved outputs, then dV and dZ (with dc).

The layer calls `partition_attention_layer(P, X, mask, table, sigmoid)` on its projections
P = [Q | V | c] (projection.projection_views) and gets dP back whole, and the kernels write X̄
and A_part side by side into the layer's context [X̄ | A_part] (the block's folded W^O reads it,
layer_weights.py); the impls' common signature
`partition_attention_triton(Q, X, V, c, mask, table, sigmoid, out=None)` computes what
`lean.partition_mix_lean(Q Xᵀ/√d, c, V, mask, table, sigmoid)` computes. Inputs: Q, X [B, L, d];
V [B, n, L, d/n]; c = Q Rᵀ [B, L, n] or None (1h-sigmoid, 1h-softmax); mask [B, L] (1 token,
0 padding); table [n, 2 max_len − 1] fp32 (shatter/partition.py). bf16 or fp16 on sm_80+ (auto's
choice); fp32 runs too (IEEE dots, for the tests). n even in 4..16, d/n ≤ 128, L ≤ max_len. CUDA
tensors of compute capability ≥ 8.0, or CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

import math

import torch
import torch.nn.functional as F
import triton

from shatter.attention.projection import (
    context_views,
    new_context,
    projection_views,
    projection_width,
    write_context,
)
from shatter.kernels.cost import register_costs
from shatter.kernels.partition_mixing import (
    INTERPRET,
    MAX_PARTS,
    delta_kernel,
    mix_bwd_dv_kernel,
    mix_bwd_dz_kernel,
    mix_fwd_kernel,
    row_stats_kernel,
)


def kernel_meta(d: int, n: int, dtype: torch.dtype) -> dict:
    """The shape-derived compile-time constants the kernels share (tools/bench/kernel_report.py too)."""
    block_k = max(16, triton.next_power_of_2(d // n))
    return {
        "N_PARTS": n,
        "BLOCK_K": block_k,
        "PREC": "ieee" if dtype == torch.float32 else "tf32",
        "NP": max(16, triton.next_power_of_2(n)),
    }


def _check(Q, X, V, c, mask, table):
    B, L, d = Q.shape
    n = table.shape[0]
    max_len = (table.shape[1] + 1) // 2
    problems = [
        (X.shape != Q.shape, f"X has shape {tuple(X.shape)}, Q {tuple(Q.shape)}"),
        (n % 2 or not 4 <= n <= MAX_PARTS, f"n = {n} parts; the kernel takes an even n in 4..16"),
        (d % n or d // n > 128, f"d = {d} is not n = {n} parts of at most 128"),
        (tuple(V.shape) != (B, n, L, d // n), f"V has shape {tuple(V.shape)}, not {(B, n, L, d // n)}"),
        (c is not None and tuple(c.shape) != (B, L, n), f"c has shape {tuple(c.shape) if c is not None else None}"),
        (tuple(mask.shape) != (B, L), f"mask has shape {tuple(mask.shape)}, not {(B, L)}"),
        (L > max_len, f"sequence length {L} exceeds the table's max_len {max_len}"),
        (Q.dtype not in (torch.float16, torch.bfloat16, torch.float32), f"dtype {Q.dtype}"),
        (X.dtype != Q.dtype or V.dtype != Q.dtype, f"Q, X, V dtypes {Q.dtype}, {X.dtype}, {V.dtype} differ"),
        (table.dtype != torch.float32, f"the partition table is {table.dtype}, not float32"),
        (Q.device.type == "cpu" and not INTERPRET, "CPU tensors need TRITON_INTERPRET=1"),
    ]  # fmt: skip
    for bad, what in problems:
        if bad:
            raise ValueError(
                f"partition_attention_triton: {what} (shatter/attention/triton_kernel.py)"
            )


def _grid(L, block, per_batch, half=0):
    """(blocks of L, per_batch programs, times 2 sides × n/2/GROUP groups of parts when a side
    has `half` = n/2 parts)."""

    def grid(META):
        return triton.cdiv(L, META[block]), per_batch * (2 * half // META["GROUP"] if half else 1)

    return grid


def padded(L: int) -> int:
    """Z's row length: the keys rounded up to a multiple of 16 (aligned rows for the GEMMs and the
    kernels' vector loads)."""
    return -(-L // 16) * 16


def _unit(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous (the kernels take every other stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _scores(Q: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Z = Q Xᵀ/√d on cuBLAS [B, L, Lp], the 1/√d applied to the fp32 accumulator (no fp16
    overflow, no scaled copy of Q); keys that are not a multiple of 16 are padded with zeros so
    that Z's rows are aligned."""
    L = X.shape[1]
    X = X if L % 16 == 0 else F.pad(X, (0, 0, 0, -L % 16))
    Z = Q.new_empty(Q.shape[0], L, X.shape[1])
    return torch.baddbmm(Z, Q, X.transpose(-1, -2), beta=0.0, alpha=Q.shape[-1] ** -0.5, out=Z)


@torch.library.custom_op("shatter::mixing_fwd", mutates_args=())
def mixing_fwd(
    P: torch.Tensor, X: torch.Tensor, mask: torch.Tensor, table: torch.Tensor, sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the context [X̄ | A_part] [B, L, d + n] (projection.context_views), Z [B, L, Lp],
    stat [2, B, L] fp32) from the layer's projections P = [Q | V | c]
    (projection.projection_views): the scores GEMM, the row statistics and the mixing forward;
    Z and stat are kept for `mixing_bwd`."""
    B, L, d = X.shape
    n = table.shape[0]
    Q, V, c = projection_views(P, d, n)
    Z = _scores(Q, X)
    cc = c if c is not None else Z  # a placeholder pointer without the bias
    mask32 = mask.to(torch.float32).contiguous()
    stat = torch.empty(2, B, L, device=X.device, dtype=torch.float32)
    meta = kernel_meta(d, n, X.dtype)
    shared = dict(
        L=L, L_KEY=triton.next_power_of_2(L), T_CENTRE=(table.shape[1] - 1) // 2,
        HAS_C=c is not None, N_PARTS=n, SIGMOID=sigmoid,
    )  # fmt: skip
    zs = (Z.stride(0), Z.stride(1), cc.stride(0), cc.stride(1), table.stride(0))
    row_stats_kernel[_grid(L, "BLOCK_M", B)](Z, cc, mask32, table, stat[0], stat[1], *zs, **shared)
    wide = new_context(X, n)
    out, part = context_views(wide, n)
    mix_fwd_kernel[_grid(L, "BLOCK_M", B, n // 2)](  # batch x side x group of parts
        Z, cc, mask32, table, V, stat[0], stat[1], out, part, *zs,
        V.stride(0), V.stride(1), V.stride(2), out.stride(0), out.stride(1), out.stride(2),
        part.stride(0), part.stride(1), K_PART=d // n, BLOCK_K=meta["BLOCK_K"],
        PREC=meta["PREC"], **shared,
    )  # fmt: skip
    return wide, Z, stat


@mixing_fwd.register_fake
def _(P, X, mask, table, sigmoid):
    B, L, d = X.shape
    return (
        new_context(X, table.shape[0]),
        X.new_empty(B, L, padded(L)),
        X.new_empty(2, B, L, dtype=torch.float32),
    )


@torch.library.custom_op("shatter::mixing_bwd", mutates_args=())
def mixing_bwd(
    P: torch.Tensor,
    X: torch.Tensor,
    mask: torch.Tensor,
    table: torch.Tensor,
    Z: torch.Tensor,
    stat: torch.Tensor,
    out: torch.Tensor,
    part: torch.Tensor,
    g_out: torch.Tensor,
    g_part: torch.Tensor,
    sigmoid: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dP, dX) from the saved Z and statistics: dV, δ, then dZ (with dc), in Triton, written
    into dP's columns, then dQ = dZ X into dP and dX = dZᵀ Q in cuBLAS. dX̄ is
    read in whatever strides autograd hands in."""
    B, L, d = X.shape
    n = table.shape[0]
    Q, V, c = projection_views(P, d, n)
    g_out, g_part = _unit(g_out.to(X.dtype)), _unit(g_part.to(X.dtype))
    dP = torch.empty_like(P, memory_format=torch.contiguous_format)
    dP[..., 2 * d + (n if c is not None else 0) :].zero_()  # c's alignment columns: no gradient
    dQ, gV, dc = projection_views(dP, d, n)
    meta = kernel_meta(d, n, X.dtype)
    cc = c if c is not None else Z
    dcc = dc if dc is not None else Z
    mask32 = mask.to(torch.float32).contiguous()
    shared = dict(
        L=L, L_KEY=triton.next_power_of_2(L), HAS_C=c is not None, N_PARTS=n,
        SIGMOID=sigmoid, K_PART=d // n, BLOCK_K=meta["BLOCK_K"],
    )  # fmt: skip
    tables = dict(T_CENTRE=(table.shape[1] - 1) // 2, PREC=meta["PREC"])
    zs = (Z.stride(0), Z.stride(1), cc.stride(0), cc.stride(1), table.stride(0))
    gs = (g_out.stride(0), g_out.stride(1), g_out.stride(2))
    mix_bwd_dv_kernel[_grid(L, "BLOCK_N", B, n // 2)](
        Z, cc, mask32, table, stat[0], stat[1], g_out, gV, *zs, *gs,
        gV.stride(0), gV.stride(1), gV.stride(2), **shared, **tables,
    )  # fmt: skip
    delta = torch.empty(B, L, device=X.device, dtype=torch.float32)
    delta_kernel[_grid(L, "BLOCK_M", B)](
        out, g_out, part, g_part, delta, out.stride(0), out.stride(1), out.stride(2), *gs,
        part.stride(0), part.stride(1), g_part.stride(0), g_part.stride(1), L=L,
        L_KEY=shared["L_KEY"], K_PART=d // n, N_PARTS=n, BLOCK_K=meta["BLOCK_K"], NP=meta["NP"],
    )  # fmt: skip
    dZ = torch.empty_like(Z)  # the padded keys' columns are never read
    mix_bwd_dz_kernel[_grid(L, "BLOCK_M", B)](
        Z, cc, mask32, table, V, stat[0], stat[1], delta, g_out, g_part, dZ, dcc, *zs,
        V.stride(0), V.stride(1), V.stride(2), *gs, g_part.stride(0), g_part.stride(1),
        dcc.stride(0), dcc.stride(1), scale=1.0 / math.sqrt(d), NP=meta["NP"], **shared, **tables,
    )  # fmt: skip
    dS = dZ[:, :, :L]  # dS/√d
    torch.matmul(dS, X, out=dQ)  # cuBLAS: dQ = dS X / √d, into dP's columns
    gX = torch.matmul(dS.transpose(-1, -2), Q)  # dX_key = dSᵀ Q / √d
    return dP, gX


@mixing_bwd.register_fake
def _(P, X, mask, table, Z, stat, out, part, g_out, g_part, sigmoid):
    return torch.empty_like(P, memory_format=torch.contiguous_format), torch.empty_like(X)


def _setup_context(ctx, inputs, output):
    P, X, mask, table, sigmoid = inputs
    wide, Z, stat = output
    ctx.save_for_backward(P, X, mask, table, Z, stat, wide)
    ctx.mark_non_differentiable(Z, stat)  # kept for the backward only
    ctx.set_materialize_grads(False)  # no zero gradients made for Z and stat
    ctx.sigmoid = sigmoid


def _backward(ctx, g_wide, _g_z, _g_stat):
    *saved, wide = ctx.saved_tensors
    n = saved[3].shape[0]
    g_wide = torch.zeros_like(wide) if g_wide is None else g_wide
    grads = context_views(g_wide, n)
    dP, dX = torch.ops.shatter.mixing_bwd(*saved, *context_views(wide, n), *grads, ctx.sigmoid)
    return dP, dX, None, None, None


mixing_fwd.register_autograd(_backward, setup_context=_setup_context)
register_costs(("shatter::mixing_fwd", "shatter::mixing_bwd"))


def partition_attention_triton(
    Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid: bool, out=None
):
    """(X_bar [B, n, L, d/n], A_part [B, L, n]) as `lean.partition_mix_lean` gives them for
    Z0 = Q Xᵀ/√d; the 1h-sigmoid and 1h-softmax archs pass c = None. The impls' common
    signature: Q, V and c are gathered into one P (a copy), and a given context `out` is
    written by a copy; the layer passes its P itself and takes the kernels' own context
    (`partition_attention_layer`)."""
    _check(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table)
    B, L, d = Q_BLD.shape
    columns = [Q_BLD, V_BnLk.transpose(1, 2).reshape(B, L, d)]
    if c_BLn_or_None is not None:
        pad = projection_width(d, table.shape[0]) - 2 * d - c_BLn_or_None.shape[-1]
        columns += [c_BLn_or_None, c_BLn_or_None.new_zeros(B, L, pad)]
    P = torch.cat(columns, -1)
    wide, _, _ = torch.ops.shatter.mixing_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))
    views = context_views(wide, table.shape[0])
    return views if out is None else write_context(out, *views)


def partition_attention_layer(P, X_BLD, mask_BL, table, sigmoid: bool):
    """The layer's context [X̄ | A_part] ([B, L, d + n]) from its projections P = [Q | V | c]
    (no copy of them), written by the kernels."""
    B, L, d = X_BLD.shape
    Q, V, c = projection_views(P, d, table.shape[0])
    _check(Q, X_BLD, V, c, mask_BL, table)
    wide, _, _ = torch.ops.shatter.mixing_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))
    return wide
