"""The hybrid Triton partition attention behind `attention_impl="triton"` (eq. 2, 3, 5, §3.3).

Shatter has one head: the score matrix Z = Q Xᵀ/√d is a single l x l matrix per sequence (B·l²
elements in the input dtype, less than the Q, K, V and O that BERT's flash attention saves), so
the three d-wide products are plain GEMMs in the input dtype with fp32 accumulation:

    forward    Z = Q Xᵀ/√d + b                     saved for the backward pass
    backward   dQ = dZ X,   dX_key = dZᵀ Q         dZ = dS/√d, written by the mixing kernel

Z is made by the row statistics kernel from sm_80 (tensor-core dots over d, the statistics and
the partition bias in the same pass: `family.z_inside`), by cuBLAS below it; the backward's two
are cuBLAS GEMMs. The rest runs in Triton (shatter/kernels/partition_mixing.py): the mask, the
sigmoid (or 1h-softmax's softmax), the partition bias c·f(j−i), the n/2 parts per side with
64-wide dots, ‖p‖, and the outputs normalised in the input dtype; the backward pass takes δ from
the saved outputs, then dV and dZ (with dc).

The layer calls `partition_attention_layer(P, X, mask, table, v_part, sigmoid)` on its projections
P = [Q | V | c] (projection.projection_views) and gets dP back whole; the impls' common signature
`partition_attention_triton(Q, X, V, c, mask, table, sigmoid)` computes what
`lean.partition_mix_lean(Q Xᵀ/√d, c, V, mask, table, sigmoid)` computes. Inputs: Q, X [B, L, d];
V [B, n, L, d/n]; c = Q Rᵀ [B, L, n] or None (1h-sigmoid, 1h-softmax); mask [B, L] (1 token,
0 padding); table [n, 2 max_len − 1] fp32 (shatter/partition.py). bf16 or fp16 on sm_80+ (auto's
choice); fp32 runs too (IEEE dots, for the tests). n even in 4..16, d/n ≤ 128, L ≤ max_len. CUDA
tensors of compute capability ≥ 8.0, or CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

import functools

import torch
import torch.nn.functional as F

from shatter.attention.projection import (
    context_views,
    gather_projections,
    new_context,
    padded,
    projection_views,
    write_context,
)
from shatter.kernels.cost import register_costs
from shatter.kernels.family import delta_inside, family_of, z_inside
from shatter.kernels.launch import fast, pow2
from shatter.kernels.partition_mixing import (
    INTERPRET,
    MAX_PARTS,
    block_k,
    delta_kernel,
    mix_bwd_dv_kernel,
    mix_bwd_dz_kernel,
    mix_fwd_kernel,
    row_stats_kernel,
)


def kernel_meta(d: int, n: int, dtype: torch.dtype) -> dict:
    """The shape-derived compile-time constants the kernels share (tools/bench/kernel_report.py
    too): a copy of `_kernel_meta`'s, made once per shape (every call asks: the host's time)."""
    return dict(_kernel_meta(d, n, dtype))


@functools.cache
def _kernel_meta(d: int, n: int, dtype: torch.dtype) -> tuple:
    return tuple({
        "N_PARTS": n,
        "BLOCK_K": block_k(d, n),
        "PREC": "ieee" if dtype == torch.float32 else "tf32",
        "NP": max(16, pow2(n)),
        "BLOCK_D": min(64, max(16, pow2(d))),  # Q Xᵀ's steps over d (RECOMPUTE)
    }.items())  # fmt: skip


def _check(Q, X, V, c, mask, table, impl="triton"):
    """The shapes and dtypes the kernels take, else a ValueError naming the first problem. Each
    message is a lambda, formatted only when its check fails: this runs on every call, and the
    host's time per call is what an eager step pays for (docs/benchmarks.md)."""
    B, L, d = Q.shape
    n = table.shape[0]
    max_len = (table.shape[1] + 1) // 2
    shape = lambda t: tuple(t.shape) if t is not None else None  # noqa: E731
    problems = [
        (X.shape != Q.shape, lambda: f"X has shape {shape(X)}, Q {shape(Q)}"),
        (n % 2 or not 4 <= n <= MAX_PARTS, lambda: f"n = {n} parts; the kernel takes an even n in 4..16"),
        (d % n or d // n > 128, lambda: f"d = {d} is not n = {n} parts of at most 128"),
        (tuple(V.shape) != (B, n, L, d // n), lambda: f"V has shape {shape(V)}, not {(B, n, L, d // n)}"),
        (c is not None and tuple(c.shape) != (B, L, n), lambda: f"c has shape {shape(c)}"),
        (tuple(mask.shape) != (B, L), lambda: f"mask has shape {shape(mask)}, not {(B, L)}"),
        (L > max_len, lambda: f"sequence length {L} exceeds the table's max_len {max_len}"),
        (Q.dtype not in (torch.float16, torch.bfloat16, torch.float32), lambda: f"dtype {Q.dtype}"),
        (X.dtype != Q.dtype or V.dtype != Q.dtype, lambda: f"Q, X, V dtypes {Q.dtype}, {X.dtype}, {V.dtype} differ"),
        (table.dtype != torch.float32, lambda: f"the partition table is {table.dtype}, not float32"),
        (Q.device.type == "cpu" and not INTERPRET, lambda: "CPU tensors need TRITON_INTERPRET=1"),
    ]  # fmt: skip
    for bad, what in problems:
        if bad:
            raise ValueError(
                f"attention_impl {impl}: {what()} (shatter/attention/triton_kernel.py)"
            )


def _grid(L, block, per_batch, half=0):
    """(blocks of L, per_batch programs, times 2 sides × n/2/GROUP groups of parts when a side
    has `half` = n/2 parts)."""

    def grid(META):
        # -(-a // b): triton.cdiv is a constexpr function in Triton 3.9, about 5 µs a call
        return -(-L // META[block]), per_batch * (2 * half // META["GROUP"] if half else 1)

    return grid


def _delta_inside(X: torch.Tensor) -> bool:
    """Whether the dZ kernel makes δ itself on X's device (family.delta_inside); under
    the interpreter, as on sm_80 (the tests set it both ways)."""
    return delta_inside(_family(X.device.index) if X.is_cuda else None)


def _z_inside(X: torch.Tensor) -> bool:
    """Whether the row statistics make Z on X's device (family.z_inside); under the
    interpreter, as on sm_80+ (the tests set it both ways)."""
    return z_inside(_family(X.device.index) if X.is_cuda else None)


@functools.cache
def _family(index: int | None) -> int:
    """The arch family of CUDA device `index`, read once (every backward call asks)."""
    return family_of(torch.cuda.get_device_capability(index))


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


def _source(Q, X, Z, dtype) -> dict:
    """The kernels' score-source arguments: Z's own (RECOMPUTE off), or with Z None, Q in Z's
    place and the keys X, for the tiles of Q Xᵀ/√d recomputed on chip (RECOMPUTE on)."""
    src = Q if Z is None else Z
    return dict(
        Z=src, X=X, sz_b=src.stride(0), sz_l=src.stride(1), sx_b=X.stride(0), sx_l=X.stride(1),
        D=X.shape[-1], scale=X.shape[-1] ** -0.5, RECOMPUTE=Z is None,
        BLOCK_D=kernel_meta(X.shape[-1], 2, dtype)["BLOCK_D"],
    )  # fmt: skip


def forward_kernels(P, X, mask, table, sigmoid: bool, Z, make_z: bool = False):
    """(the context [X̄ | A_part | 1 | 0] [B, L, context_width] (projection.context_views), stat [2, B, L] fp32)
    from the projections P = [Q | V | c]: the row statistics, then the mixing forward writing X̄
    and A_part into the context, their scores read from Z [B, L, Lp] or, with Z None, recomputed
    from Q and X tile by tile; with `make_z` the row statistics make Z's tiles on chip and
    write z + b into Z (`z_inside`), which the mixing forward reads. The key mask is read as
    it is (bool or integer)."""
    B, L, d = X.shape
    n = table.shape[0]
    Q, V, c = projection_views(P, d, n)
    source = _source(Q, X, Z, X.dtype)
    cc = c if c is not None else source["Z"]  # a placeholder pointer without the bias
    stat = torch.empty(2, B, L, device=X.device, dtype=torch.float32)
    meta = kernel_meta(d, n, X.dtype)
    shared = dict(
        C=cc, Mk=mask.contiguous(), T=table, sc_b=cc.stride(0), sc_l=cc.stride(1), st_h=table.stride(0),
        L=L, L_KEY=pow2(L), T_CENTRE=(table.shape[1] - 1) // 2,
        HAS_C=c is not None, N_PARTS=n, SIGMOID=sigmoid, PREC=meta["PREC"], **source,
    )  # fmt: skip
    zo = source["Z"]  # Z, written in place where z + b is kept (else a placeholder)
    fast(row_stats_kernel)[_grid(L, "BLOCK_M", B)](
        STAT=stat[0], STAT2=stat[1], ZO=zo, szo_b=zo.stride(0), szo_l=zo.stride(1),
        KEEP=make_z or (c is not None and Z is not None),
        **(shared | (_source(Q, X, None, X.dtype) if make_z else {})),
    )  # fmt: skip
    ctx = new_context(X, n, fill_alignment=False)  # the mixing forward fills them
    out, part = context_views(ctx, n)
    fast(mix_fwd_kernel)[_grid(L, "BLOCK_M", B, n // 2)](  # batch x side x group of parts
        V=V, STAT=stat[0], STAT2=stat[1], OUT=out, AP=part, sv_b=V.stride(0), sv_h=V.stride(1),
        sv_l=V.stride(2), so_b=out.stride(0), so_h=out.stride(1), so_l=out.stride(2),
        sa_b=part.stride(0), sa_l=part.stride(1), K_PART=d // n, BLOCK_K=meta["BLOCK_K"],
        AP_COLS=ctx.shape[-1] - d, NP=meta["NP"], **shared,
    )  # fmt: skip
    return ctx, stat


# flexible_layout: compiled, X comes as a view of the projection's [X | 1 | 0] (projection.
# gemm_input), strided rows; the kernels take X's strides, so inductor passes it without a copy
@torch.library.custom_op("shatter::mixing_fwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def mixing_fwd(
    P: torch.Tensor, X: torch.Tensor, mask: torch.Tensor, table: torch.Tensor, sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the context [X̄ | A_part | 1 | 0] [B, L, context_width], Z [B, L, Lp], stat [2, B, L] fp32) from the
    layer's projections P = [Q | V | c] (projection.projection_views): the row statistics (Z's
    tiles made on chip and z + b written into Z from sm_80, `z_inside`; below, cuBLAS's Z GEMM
    before them) and the mixing forward; Z and stat are kept for `mixing_bwd`. Z's columns past
    L are never read."""
    make_z = _z_inside(X)
    if make_z:
        Z = X.new_empty(X.shape[0], X.shape[1], padded(X.shape[1]))
    else:
        Z = _scores(projection_views(P, X.shape[-1], table.shape[0])[0], X)
    ctx, stat = forward_kernels(P, X, mask, table, sigmoid, Z, make_z)
    return ctx, Z, stat


@mixing_fwd.register_fake
def _(P, X, mask, table, sigmoid):
    B, L, _ = X.shape
    stat = X.new_empty(2, B, L, dtype=torch.float32)
    return new_context(X, table.shape[0]), X.new_empty(B, L, padded(L)), stat


def backward_kernels(P, X, mask, table, Z, stat, out, part, g_out, g_part, sigmoid: bool):
    """(dP, dX) from the saved statistics and outputs: dV, δ, then dS/√d (with dc) in Triton,
    their scores read from Z or, with Z None, recomputed from Q and X; then dQ = dS X into dP
    and dX = dSᵀ Q in cuBLAS. dX̄ is read in whatever strides autograd hands in."""
    B, L, d = X.shape
    n = table.shape[0]
    Q, V, c = projection_views(P, d, n)
    g_out, g_part = _unit(g_out.to(X.dtype)), _unit(g_part.to(X.dtype))
    dP = torch.empty_like(P, memory_format=torch.contiguous_format)
    dQ, gV, dc = projection_views(dP, d, n)  # the dZ kernel zeroes c's alignment columns
    meta = kernel_meta(d, n, X.dtype)
    source = _source(Q, X, Z, X.dtype)
    cc = c if c is not None else source["Z"]
    dcc = dc if dc is not None else source["Z"]
    shared = dict(
        C=cc, Mk=mask.contiguous(), T=table, STAT=stat[0], STAT2=stat[1], DO=g_out, sc_b=cc.stride(0),
        sc_l=cc.stride(1), st_h=table.stride(0), sd_b=g_out.stride(0), sd_h=g_out.stride(1),
        sd_l=g_out.stride(2), L=L, L_KEY=pow2(L), HAS_C=c is not None,
        N_PARTS=n, SIGMOID=sigmoid, K_PART=d // n, BLOCK_K=meta["BLOCK_K"],
        T_CENTRE=(table.shape[1] - 1) // 2, PREC=meta["PREC"], **source,
    )  # fmt: skip
    fast(mix_bwd_dv_kernel)[_grid(L, "BLOCK_N", B, n // 2)](
        DV=gV, sg_b=gV.stride(0), sg_h=gV.stride(1), sg_l=gV.stride(2), **shared
    )
    inside = _delta_inside(X)
    # with δ made inside, DELTA is a placeholder pointer the kernel never reads
    delta = stat[0] if inside else torch.empty(B, L, device=X.device, dtype=torch.float32)
    outputs = dict(
        OUT=out, AP=part, so_b=out.stride(0), so_h=out.stride(1), so_l=out.stride(2),
        sa_b=part.stride(0), sa_l=part.stride(1), sp_b=g_part.stride(0), sp_l=g_part.stride(1),
    )  # fmt: skip
    if not inside:  # δ in a launch of its own (family.delta_inside)
        fast(delta_kernel)[_grid(L, "BLOCK_M", B)](
            DO=g_out, DAP=g_part, DELTA=delta, sd_b=shared["sd_b"], sd_h=shared["sd_h"],
            sd_l=shared["sd_l"], L=L, L_KEY=shared["L_KEY"], K_PART=d // n, N_PARTS=n,
            BLOCK_K=meta["BLOCK_K"], NP=meta["NP"], **outputs,
        )  # fmt: skip
    dZ = X.new_empty(B, L, padded(L))  # dS/√d; the padded keys' columns are never read
    fast(mix_bwd_dz_kernel)[_grid(L, "BLOCK_M", B)](
        V=V, DELTA=delta, DAP=g_part, DZ=dZ, DC=dcc, sdz_b=dZ.stride(0), sdz_l=dZ.stride(1),
        sv_b=V.stride(0), sv_h=V.stride(1), sv_l=V.stride(2), sdc_b=dcc.stride(0),
        sdc_l=dcc.stride(1), NP=meta["NP"], DC_COLS=P.shape[-1] - 2 * d, DELTA_INSIDE=inside,
        **outputs, **shared,
    )  # fmt: skip
    dS = dZ[:, :, :L]  # dS/√d
    torch.matmul(dS, X, out=dQ)  # cuBLAS: dQ = dS X / √d, into dP's columns
    gX = torch.matmul(dS.transpose(-1, -2), Q)  # dX_key = dSᵀ Q / √d
    return dP, gX


# flexible_layout: compiled, X comes as a view of the projection's [X | 1 | 0] (projection.
# gemm_input), strided rows; the kernels take X's strides, so inductor passes it without a copy
@torch.library.custom_op("shatter::mixing_bwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
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
    """(dP, dX) from the saved Z and statistics (`backward_kernels`)."""
    return backward_kernels(P, X, mask, table, Z, stat, out, part, g_out, g_part, sigmoid)


@mixing_bwd.register_fake
def _(P, X, mask, table, Z, stat, out, part, g_out, g_part, sigmoid):
    return torch.empty_like(P, memory_format=torch.contiguous_format), torch.empty_like(X)


def register_backward(forward_op, backward_op) -> None:
    """The autograd of a forward op (P, X, mask, table, sigmoid) -> (context, *kept): it saves
    P, X, mask, table, the `kept` tensors (for the backward only) and the context [X̄ | A_part],
    and its backward is `backward_op`(*saved, X̄, A_part, dX̄, dA_part, sigmoid) -> (dP, dX),
    X̄ and A_part and their gradients views of the context and of its gradient."""

    def setup_context(ctx, inputs, output):
        P, X, mask, table, sigmoid = inputs
        context, *kept = output
        ctx.save_for_backward(P, X, mask, table, *kept, context)
        ctx.mark_non_differentiable(*kept)
        ctx.set_materialize_grads(False)  # no zero gradients made for the kept tensors
        ctx.sigmoid = sigmoid

    def backward(ctx, g_context, *_g_kept):
        *saved, context = ctx.saved_tensors
        g_context = torch.zeros_like(context) if g_context is None else g_context
        n = saved[3].shape[0]
        grads = (*context_views(context, n), *context_views(g_context, n))
        dP, dX = backward_op(*saved, *grads, ctx.sigmoid)
        return dP, dX, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)


register_backward(mixing_fwd, torch.ops.shatter.mixing_bwd)
register_costs(("shatter::mixing_fwd", "shatter::mixing_bwd"))


def partition_attention_triton(
    Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid: bool, out=None
):
    """(X_bar [B, n, L, d/n], A_part [B, L, n]) as `lean.partition_mix_lean` gives them for
    Z0 = Q Xᵀ/√d; the 1h-sigmoid and 1h-softmax archs pass c = None. The impls' common
    signature: Q, V and c are gathered into one P (a copy); the layer passes its P itself
    (`partition_attention_layer`)."""
    _check(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table)
    P = gather_projections(Q_BLD, V_BnLk, c_BLn_or_None)
    ctx, _, _ = torch.ops.shatter.mixing_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))
    x_bar, part = context_views(ctx, table.shape[0])
    return (x_bar, part) if out is None else write_context(out, x_bar, part)


def partition_attention_layer(P, X_BLD, mask_BL, table, sigmoid: bool):
    """The layer's context [X̄ | A_part | 1 | 0] ([B, L, context_width], projection.context) from its
    projections P = [Q | V | c] (no copy of them), for the block's folded W^O."""
    B, L, d = X_BLD.shape
    Q, V, c = projection_views(P, d, table.shape[0])
    _check(Q, X_BLD, V, c, mask_BL, table)
    return torch.ops.shatter.mixing_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))[0]
