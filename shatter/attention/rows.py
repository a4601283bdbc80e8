"""`attention_impl: rows`: the single-head partition attention for GPUs without Triton tensor-core
dots (V100 sm_70, T4 sm_75), from cuBLAS GEMMs and two Triton row kernels (eq. 2, 3, 5, §3.3).

Every product is a cuBLAS GEMM in the input dtype (fp16 on a V100: tensor cores, fp32
accumulation); the kernels of shatter/kernels/row_mixing.py only stream rows (elementwise work and
row sums in fp32 registers). Per layer, with P = [Q | V | c] the layer's projections:

    forward   Z = Q Xᵀ/√d                         one GEMM, the 1/√d in its α; kept
              W_h = A ⊙ N[h], A_part              `shatter::rows_fwd`: one row kernel
              X̄[h] = W_h V[h]                     min(B, n) strided-batched GEMMs (one a part, or
                                                  one a sequence), V read in place from P, X̄
                                                  written in the context's [B, L, d] layout
    backward  W recomputed from Z (or kept)       `shatter::rows_fwd` again
              dV[h] = W_hᵀ dX̄[h]                  min(B, n) GEMMs, written once into dP's V columns
              dW_h = dX̄[h] V[h]ᵀ                  min(B, n) GEMMs, into W's buffer when recomputed
              dA, δ, dS, dc; dZ = dS/√d           `shatter::rows_bwd`: one row kernel
              dQ = dZ X into dP, dX = dZᵀ Q       two GEMMs

With dc's copy into dP and dP's zeroed alignment columns, a layer's forward and backward launch
3 min(B, n) + 8 kernels (44 at n = 12 and 12 sequences or more: 39 GEMMs, 3 row kernels), where `chunked` launches about 300 at
l = 256 and 930 at l = 1024; and the l x l tensors move in fp16 only, never through fp32 copies
(docs/model.md has the per-kernel FLOPs and bytes).

W (n x l x l in the input dtype) is recomputed in the backward by default (`rows`): the forward
then keeps only Z (l x l, less than BERT's saved Q, K, V, O up to l = 4d), so the memory of a step
grows with l as the other impls' and an extension to a longer l at finetune time fits where BERT
fits. `rows-keep` keeps W from the forward instead: one row kernel and (1 + n) l² elements of
traffic a layer fewer in the backward (10-13% of the layer's attention time, modelled in
docs/model.md), at n l² more saved elements a layer (1.2 GB at l = 1024 for 4,096 tokens over
12 layers): for when memory allows.

Inputs as the impls' common signature (impls.py); fp16, bf16 or fp32 (the GEMMs in that dtype,
the row work in fp32); L ≤ row_mixing.MAX_ROW keys. CUDA tensors of any capability Triton
compiles for, or CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import os

import torch

from shatter.attention.projection import (
    context,
    gather_projections,
    padded,
    parts_layout,
    projection_views,
)
from shatter.kernels.cost import register_costs
from shatter.kernels.launch import fast, pow2
from shatter.kernels.row_mixing import MAX_ROW, row_warps, rows_bwd_kernel, rows_fwd_kernel


def _check(P: torch.Tensor, X: torch.Tensor, mask: torch.Tensor, table: torch.Tensor) -> None:
    B, L, d = X.shape
    n, max_len = table.shape[0], (table.shape[1] + 1) // 2
    problems = [
        (d % n, f"d = {d} is not a multiple of n = {n} parts"),
        (L > min(max_len, MAX_ROW), f"length {L} exceeds the table's {max_len} or {MAX_ROW} keys"),
        (P.dtype != X.dtype, f"the projections are {P.dtype}, the keys X {X.dtype}"),
        (tuple(mask.shape) != (B, L), f"mask has shape {tuple(mask.shape)}, not {(B, L)}"),
        (table.dtype != torch.float32, f"the partition table is {table.dtype}, not float32"),
        (X.device.type == "cpu" and not _interpreted(), "CPU tensors need TRITON_INTERPRET=1"),
    ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"attention_impl rows: {what} (shatter/attention/rows.py)")


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _keys(mask: torch.Tensor) -> torch.Tensor:
    """The key mask as the kernels read it: bool as is (no copy), anything else != 0."""
    return _unit(mask if mask.dtype == torch.bool else mask != 0)


def _unit(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous (the kernels take every other stride);
    autograd hands in expanded gradients (all strides 0) for a loss such as part.sum()."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _shared(Z, c, mask, table, sigmoid: bool) -> tuple[list, list, dict]:
    """The row kernels' common leading arguments (Z, c, mask, table and their strides) and
    compile-time constants."""
    B, L, _ = Z.shape
    cc = c if c is not None else Z  # a placeholder pointer without the bias
    args = [Z, cc, mask, table]
    strides = [Z.stride(0), Z.stride(1), cc.stride(0), cc.stride(1), mask.stride(0), table.stride(0)]  # fmt: skip
    block = pow2(L)
    meta = dict(
        HAS_C=c is not None, N_PARTS=table.shape[0], SIGMOID=sigmoid, BLOCK_L=block,
        num_warps=row_warps(block),
    )  # fmt: skip
    return args, strides, meta


@torch.library.custom_op("shatter::rows_fwd", mutates_args=())
def rows_fwd(
    Z: torch.Tensor, c: torch.Tensor | None, mask: torch.Tensor, table: torch.Tensor, sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [B, n, L, Lp], A_part [B, L, n]) from the scores Z [B, L, Lp] (Q Xᵀ/√d, keys padded to
    Lp), c [B, L, n] or None, the key mask [B, L] and the (n, 2m − 1) table: one row kernel."""
    B, L, Lp = Z.shape
    n = table.shape[0]
    W = Z.new_empty(B, n, L, Lp)
    part = Z.new_empty(B, L, n)
    args, strides, meta = _shared(Z, c, _keys(mask), table, sigmoid)
    fast(rows_fwd_kernel)[(L, B)](
        *args, W, part, *strides, W.stride(0), W.stride(1), W.stride(2), part.stride(0),
        part.stride(1), L, (table.shape[1] - 1) // 2, **meta,
    )  # fmt: skip
    return W, part


@rows_fwd.register_fake
def _(Z, c, mask, table, sigmoid):
    B, L, Lp = Z.shape
    n = table.shape[0]
    return Z.new_empty(B, n, L, Lp), Z.new_empty(B, L, n)


@torch.library.custom_op("shatter::rows_bwd", mutates_args=())
def rows_bwd(
    Z: torch.Tensor,
    c: torch.Tensor | None,
    mask: torch.Tensor,
    table: torch.Tensor,
    dW: torch.Tensor,
    g_part: torch.Tensor,
    sigmoid: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dZ [B, L, Lp] = dS · scale in Z's dtype, dc [B, L, n], [B, L, 0] without c) from
    dW [B, n, L, Lp] (dX̄[h] V[h]ᵀ) and dA_part [B, L, n]: one row kernel."""
    B, L, Lp = Z.shape
    n = table.shape[0]
    dZ = torch.empty_like(Z)  # the padded keys' columns are never read
    dc = Z.new_empty(B, L, n if c is not None else 0)
    dcc = dc if c is not None else Z
    args, strides, meta = _shared(Z, c, _keys(mask), table, sigmoid)
    fast(rows_bwd_kernel)[(L, B)](
        *args, dW, g_part, dZ, dcc, *strides, dW.stride(0), dW.stride(1), dW.stride(2),
        g_part.stride(0), g_part.stride(1), dcc.stride(0), dcc.stride(1), L,
        (table.shape[1] - 1) // 2, scale, **meta,
    )  # fmt: skip
    return dZ, dc


@rows_bwd.register_fake
def _(Z, c, mask, table, dW, g_part, sigmoid, scale):
    B, L, _ = Z.shape
    return torch.empty_like(Z), Z.new_empty(B, L, table.shape[0] if c is not None else 0)


register_costs(("shatter::rows_fwd", "shatter::rows_bwd"))


def _scores(Q: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Z = Q Xᵀ/√d [B, L, Lp] on cuBLAS, 1/√d in the GEMM's α (on the fp32 accumulator: no fp16
    overflow, no scaled copy of Q), rows padded to Lp for aligned GEMMs; the padding is never
    read."""
    B, L, d = Q.shape
    Z = Q.new_empty(B, L, padded(L))
    torch.baddbmm(Z[..., :L], Q, X.transpose(1, 2), beta=0.0, alpha=d**-0.5, out=Z[..., :L])
    return Z


def batches(B: int, n: int) -> list[tuple]:
    """The [B, n, ...] index of each strided-batched GEMM of a product over the parts: one GEMM
    per part batched over the B sequences, or one per sequence batched over the n parts, whichever
    launches fewer. Both read V and X̄ in place: P's V columns of a sequence are its n parts at a
    stride of d/n, a part's are the sequences at a stride of L·w, and a GEMM takes one stride."""
    return [(slice(None), h) for h in range(n)] if n <= B else [(b,) for b in range(B)]


def _mix(W: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """X̄[h] = W_h V[h] for each part, in the context's layout."""
    B, n, L, k = V.shape
    out = parts_layout(B, L, n, k, V)
    for i in batches(B, n):
        torch.bmm(W[i][..., :L], V[i], out=out[i])
    return out


def part_grads(
    W: torch.Tensor, V: torch.Tensor, g_out: torch.Tensor, dV: torch.Tensor, reuse: bool
):
    """dV[h] = W_hᵀ dX̄[h] into dV (dP's V columns), then dW_h = dX̄[h] V[h]ᵀ [B, n, L, Lp]:
    into W's own buffer (each batch of `batches` after its dV) when `reuse`, else a new one."""
    B, n, L, _ = V.shape
    dW = W if reuse else torch.empty_like(W)
    for i in batches(B, n):
        torch.bmm(W[i][..., :L].transpose(-1, -2), g_out[i], out=dV[i])
        torch.bmm(g_out[i], V[i].transpose(-1, -2), out=dW[i][..., :L])
    return dW


class RowsAttention(torch.autograd.Function):
    """(P [B, L, w] = [Q | V | c], X [B, L, d], mask [B, L], table, sigmoid, keep) ->
    (X̄ [B, n, L, d/n] stored as [B, L, n, d/n], A_part [B, L, n]); dP comes back whole."""

    @staticmethod
    def forward(ctx, P, X, mask, table, sigmoid: bool, keep: bool):
        d, n = X.shape[-1], table.shape[0]
        P = _unit(P)  # c's columns are read by the row kernels
        Q, V, c = projection_views(P, d, n)
        with torch.autocast(X.device.type, enabled=False):
            Z = _scores(Q, X)
            W, part = torch.ops.shatter.rows_fwd(Z, c, mask, table, sigmoid)
            out = _mix(W, V)
        ctx.save_for_backward(P, X, mask, table, Z, W if keep else None)
        ctx.sigmoid = sigmoid
        ctx.set_materialize_grads(False)
        return out, part

    @staticmethod
    def backward(ctx, g_out, g_part):
        P, X, mask, table, Z, kept = ctx.saved_tensors
        B, L, d = X.shape
        n = table.shape[0]
        Q, V, c = projection_views(P, d, n)
        g_out = torch.zeros_like(V) if g_out is None else g_out.to(X.dtype)
        g_part = X.new_zeros(B, L, n) if g_part is None else _unit(g_part.to(X.dtype))
        dP = torch.empty_like(P, memory_format=torch.contiguous_format)
        dQ, dV, dc = projection_views(dP, d, n)
        with torch.autocast(X.device.type, enabled=False):
            W = kept if kept is not None else torch.ops.shatter.rows_fwd(Z, c, mask, table, ctx.sigmoid)[0]  # fmt: skip
            dW = part_grads(W, V, g_out, dV, reuse=kept is None)
            dZ, dc_ = torch.ops.shatter.rows_bwd(Z, c, mask, table, dW, g_part, ctx.sigmoid, d**-0.5)  # fmt: skip
            if c is not None:
                dc.copy_(dc_)
                dP[..., 2 * d + n :].zero_()  # c's alignment columns: no gradient
            dS = dZ[..., :L]  # dS/√d
            torch.matmul(dS, X, out=dQ)  # dQ = dS X/√d, into dP's columns
            gX = torch.matmul(dS.transpose(1, 2), Q)  # dX_key = dSᵀ Q/√d
        return dP, gX, None, None, None, None


def rows_layer(P, X_BLD, mask_BL, table, sigmoid: bool, keep: bool = False):
    """The layer's context [X̄ | A_part | 1 | 0] ([B, L, context_width]) from its projections P = [Q | V | c]
    (no copy of them)."""
    _check(P, X_BLD, mask_BL, table)
    out, part = RowsAttention.apply(P, X_BLD, mask_BL, table, bool(sigmoid), keep)
    return context(out, part)


def partition_attention_rows(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid: bool, keep: bool = False):  # fmt: skip
    """(X̄ [B, n, L, d/n], A_part [B, L, n]) as `lean.partition_mix_lean` gives them for
    Z0 = Q Xᵀ/√d: the impls' common signature (Q, V and c gathered into one P, a copy; the
    layer passes its P itself, `rows_layer`)."""
    P = gather_projections(Q_BLD, V_BnLk, c_BLn_or_None)
    _check(P, X_BLD, mask_BL, table)
    return RowsAttention.apply(P, X_BLD, mask_BL, table, bool(sigmoid), keep)


__all__ = ["RowsAttention", "partition_attention_rows", "rows_layer"]
