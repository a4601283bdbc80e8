"""The feed-forward network's GELU in the epilogues of its GEMMs (Triton, sm_80+; shatter/ffn.py).

The block's FFN, in every arch: y = GELU(x W_inᵀ + b_in) W_outᵀ + b_out, GELU the exact erf
form. Eagerly, or compiled by inductor, GELU is a kernel of its own each way, which reads and
writes the [T, ffn] activations that the GEMMs around it write and read:

    forward   h = x W_inᵀ + b_in (cuBLAS); g = GELU(h): h read, g written
    backward  dg = dy W_out (cuBLAS); dh = dg GELU'(h): dg and h read, dh written; b_in's
              gradient Σ_t dh: dh read again

Here the GEMMs that make h and dg finish the job in their epilogue, on the fp32 accumulator tile
still on chip:

    linear_gelu      h = x W_inᵀ + b_in and g = GELU(h), both written (the backward's GELU'
                     reads h, W_out's gradient reads g, as eagerly)
    linear_gelu_bwd  dh = (dy W_out) GELU'(h), and for each tile of rows the column sums of dh
                     and of dy, the latter as the GEMM's loop reads dy (b_in's and b_out's
                     gradients: `column_sum_kernel` adds up the tiles' sums)

so each way the [T, ffn] tensors are written once and read once fewer (about 0.3 GB a layer at
base size and 16k tokens), and dy is not read again for b_out's gradient. Values round where
the eager ops round: h to the input dtype before GELU reads it, dg before GELU' multiplies it,
and b_in's gradient sums the rounded dh in fp32.

Tensor-core dots need sm_80+ (Triton emits none below: shatter/ffn.py keeps cuBLAS there).
`tools/bench/kernel_report.py` compiles each configuration for sm_80 and sm_90 and checks shared
memory, spills and tensor-core instructions. Under TRITON_INTERPRET=1 (CPU tests) one small
configuration runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shatter.kernels.cost import FFN_ROW_TILE, register_costs
from shatter.kernels.family import family_of
from shatter.kernels.launch import INTERPRET, fast
from shatter.kernels.partition_mixing import _dot, _untimed

SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/√2: Φ(x) = (1 + erf(x/√2)) / 2
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # φ(x) = exp(-x²/2) / √(2π)


# every GPU configuration's row tile (the interpreter's: 16): the backward's column sums have one
# row per tile of rows (the step model prices as many: cost.FFN_ROW_TILE)
ROW_TILE = 16 if INTERPRET else FFN_ROW_TILE


def _cfg(block_n, block_k, warps, stages, archs, block_m=FFN_ROW_TILE):
    config = triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
        num_warps=warps,
        num_stages=stages,
    )
    config.archs = archs  # the arch families it is for (shatter.kernels.family)
    return config


# the autotuner times those of the GPU's family: each compiles without spills, with cp.async and
# tensor-core dots, under the GPU image's Triton and the CPU's (tools/bench/kernel_report.py;
# N256 on sm_90 and M128 N128 w4 on sm_80 spilled)
CONFIGS = [
    _cfg(128, 64, 8, 3, archs=(90,)),
    _cfg(128, 64, 8, 4, archs=(90,)),
    _cfg(64, 64, 4, 4, archs=(90, 80)),
    _cfg(128, 32, 8, 3, archs=(80,)),
    _cfg(128, 64, 8, 3, archs=(80,)),
]


def _for_this_gpu(configs, named_args, **kwargs):
    family = family_of(torch.cuda.get_device_capability())
    return [c for c in configs if family in c.archs] or configs[-1:]


def _autotune(fn):
    """triton.autotune over the GPU family's CONFIGS, keyed on the weight's shape (N, K) and
    dtype; under the interpreter one small configuration, several tiles a test."""
    if INTERPRET:
        configs = [triton.Config({"BLOCK_M": ROW_TILE, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2})]
        return triton.autotune(configs=configs, key=["N", "K"], do_bench=_untimed)(fn)
    prune = {"early_config_prune": _for_this_gpu}
    return triton.autotune(configs=CONFIGS, key=["N", "K"], prune_configs_by=prune)(fn)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (pid_m, pid_n): GROUP_M row tiles walk the columns together,
    so the weight's tiles are read from L2 by a group rather than from HBM by each program."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot_tile(A, B, sa_m, sa_k, sb_k, sb_n, M, N, K, pid_m, pid_n, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
              A_SUMS=None):  # fmt: skip
    """The fp32 [BLOCK_M, BLOCK_N] tile (pid_m, pid_n) of A B, A [M, K] and B [K, N] in any
    strides, and its row and column indices. Rows and columns past M and N are read wrapped
    (their results are never stored), so only K's tail is masked in the loop. With A_SUMS (a
    pointer to K fp32), the programs of the first column tile also write the sums of A's tile
    rows down each of A's columns there, as the loop reads them."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + (rm % M).to(tl.int64)[:, None] * sa_m + rk[None, :] * sa_k  # past 2^31 elements
    b_ptr = B + rk[:, None] * sb_k + (rn % N)[None, :] * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=rk[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptr, mask=rk[:, None] < K - k0, other=0.0)
        acc = _dot(a, b, acc, PREC)
        if A_SUMS is not None:
            if pid_n == 0:
                inside = tl.where((rm < M)[:, None], a.to(tl.float32), 0.0)
                tl.store(A_SUMS + k0 + rk, tl.sum(inside, 0), mask=rk < K - k0)
        a_ptr += BLOCK_K * sa_k
        b_ptr += BLOCK_K * sb_k
    return acc, rm, rn


@_autotune
@triton.jit
def linear_gelu_kernel(X, W, BIAS, H, G, M, N, K, sx_m, sx_k, sw_n, sw_k, sh_m, sg_m,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PREC: tl.constexpr, KEEP_H: tl.constexpr):  # fmt: skip
    """h = X Wᵀ + b (W [N, K], nn.Linear's layout) and g = GELU(h), both [M, N]; h written only
    with KEEP_H (a backward will read it)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, rm, rn = _dot_tile(X, W, sx_m, sx_k, sw_k, sw_n, M, N, K, pid_m, pid_n, BLOCK_M,
                            BLOCK_N, BLOCK_K, PREC)  # fmt: skip
    acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    h = acc.to(G.dtype.element_ty)
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    rows = rm.to(tl.int64)[:, None]
    if KEEP_H:
        tl.store(H + rows * sh_m + rn[None, :], h, mask=inside)
    hf = h.to(tl.float32)  # GELU reads the rounded h, as the eager op reads it
    g = 0.5 * hf * (1.0 + tl.math.erf(hf * SQRT1_2))
    tl.store(G + rows * sg_m + rn[None, :], g.to(G.dtype.element_ty), mask=inside)


@_autotune
@triton.jit
def linear_gelu_bwd_kernel(DY, W, H, DH, PART, M, N, K, sdy_m, sdy_k, sw_k, sw_n, sh_m, sdh_m,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """dh = (DY W) GELU'(h), W [K, N] (W_out: nn.Linear's [out, in] with out = K), and each
    row tile's column sums of dh and of DY into its row of PART [tiles, N + K] (fp32)."""
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, rm, rn = _dot_tile(DY, W, sdy_m, sdy_k, sw_k, sw_n, M, N, K, pid_m, pid_n, BLOCK_M,
                            BLOCK_N, BLOCK_K, PREC, PART + pid_m * (N + K) + N)  # fmt: skip
    dg = acc.to(DH.dtype.element_ty).to(tl.float32)  # rounded, as the eager GEMM's output
    inside = (rm[:, None] < M) & (rn[None, :] < N)
    rows = rm.to(tl.int64)[:, None]
    h = tl.load(H + rows * sh_m + rn[None, :], mask=inside, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(h * SQRT1_2))
    dh = (dg * (cdf + h * tl.exp(-0.5 * h * h) * INV_SQRT_2PI)).to(DH.dtype.element_ty)
    tl.store(DH + rows * sdh_m + rn[None, :], dh, mask=inside)
    column = tl.sum(tl.where(inside, dh.to(tl.float32), 0.0), axis=0)
    tl.store(PART + pid_m * (N + K) + rn, column, mask=rn < N)


@triton.jit
def column_sum_kernel(PART, OUT, ROWS, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[n] = Σ_r PART[r, n] (PART [ROWS, N] fp32), written in OUT's dtype."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, ROWS, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        mask = (rr[:, None] < ROWS) & (rn[None, :] < N)
        acc += tl.sum(tl.load(PART + rr[:, None] * N + rn[None, :], mask=mask, other=0.0), 0)
    tl.store(OUT + rn, acc.to(OUT.dtype.element_ty), mask=rn < N)


def _prec(dtype: torch.dtype) -> str:
    """tl.dot's precision: fp32 operands as IEEE fp32 (not TF32), as the eager reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _programs(M: int, N: int):
    return lambda meta: (-(-M // meta["BLOCK_M"]) * -(-N // meta["BLOCK_N"]),)


@torch.library.custom_op("shatter::linear_gelu", mutates_args=())
def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, keep_h: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, GELU(h)), h = x weightᵀ + bias: x [M, K], weight [N, K] (nn.Linear's), bias [N].
    Without `keep_h` (no backward to read it: evaluation, inference) h is not written and comes
    back empty, [M, 0]."""
    M, K = x.shape
    N = weight.shape[0]
    h, g = x.new_empty(M, N if keep_h else 0), x.new_empty(M, N)
    fast(linear_gelu_kernel)[_programs(M, N)](
        X=x, W=weight, BIAS=bias, H=h, G=g, M=M, N=N, K=K, sx_m=x.stride(0), sx_k=x.stride(1),
        sw_n=weight.stride(0), sw_k=weight.stride(1), sh_m=h.stride(0), sg_m=g.stride(0),
        PREC=_prec(x.dtype), KEEP_H=keep_h,
    )  # fmt: skip
    return h, g


@linear_gelu.register_fake
def _(x, weight, bias, keep_h=True):
    M, N = x.shape[0], weight.shape[0]
    return x.new_empty(M, N if keep_h else 0), x.new_empty(M, N)


@torch.library.custom_op("shatter::linear_gelu_bwd", mutates_args=())
def linear_gelu_bwd(g_out: torch.Tensor, weight_out: torch.Tensor, h: torch.Tensor) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """(dh, [Σ_t dh | Σ_t g_out]): dh = (g_out weight_out) GELU'(h), g_out [M, K] the gradient
    of the FFN's output, weight_out [K, N] (nn.Linear's [out, in]), h [M, N] the saved
    pre-activation; the sums, [N + K], are b_in's and b_out's gradients."""
    M, K = g_out.shape
    N = weight_out.shape[1]
    dh = h.new_empty(M, N)
    rows = -(-M // ROW_TILE)
    part = h.new_empty(rows, N + K, dtype=torch.float32)  # per tile of rows: dh's, g_out's sums
    fast(linear_gelu_bwd_kernel)[_programs(M, N)](
        DY=g_out, W=weight_out, H=h, DH=dh, PART=part, M=M, N=N, K=K, sdy_m=g_out.stride(0),
        sdy_k=g_out.stride(1), sw_k=weight_out.stride(0), sw_n=weight_out.stride(1),
        sh_m=h.stride(0), sdh_m=dh.stride(0), PREC=_prec(h.dtype),
    )  # fmt: skip
    sums = h.new_empty(N + K)
    fast(column_sum_kernel)[(-(-(N + K) // 128),)](
        PART=part, OUT=sums, ROWS=rows, N=N + K, BLOCK_R=32, BLOCK_N=128
    )
    return dh, sums


@linear_gelu_bwd.register_fake
def _(g_out, weight_out, h):
    return h.new_empty(h.shape), h.new_empty(h.shape[1] + g_out.shape[1])


register_costs(("shatter::linear_gelu", "shatter::linear_gelu_bwd"))
