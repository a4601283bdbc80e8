"""The fused partition attention behind `attention_impl="fused"`: the l x l scores never reach HBM
(eq. 2, 3, 5, §3.3; FlashAttention's recomputation, for one head of width d).

Every Triton kernel of the hybrid impl (shatter/attention/triton_kernel.py,
shatter/kernels/partition_mixing.py) runs here with RECOMPUTE on: where the hybrid reads a tile
of the saved Z = Q Xᵀ/√d, these recompute it on chip from Q and the keys X (`_qx_tile`, fp32
accumulation over d in BLOCK_D steps), so neither Z nor its cuBLAS GEMM exists. The kernels, with
their launches:

    forward   row statistics: ρ = 1/‖p‖ (sigmoid) or the row maximum and log-sum (softmax),
              O(l) per row; sweeps Q Xᵀ once                              `row_stats_kernel`
              mixing: X̄ and A_part normalised; each side's Q Xᵀ tiles again  `mix_fwd_kernel`
    backward  dV from the recomputed A                                      `mix_bwd_dv_kernel`
              δ_i = Σ_h ⟨dX̄[h]_i, X̄[h]_i⟩ + ⟨dA_part_i, A_part_i⟩, O(l)     `delta_kernel`
              dS/√d (with dc) from the recomputed A                        `mix_bwd_dz_kernel`
              dQ = dS X and dX = dSᵀ Q: two cuBLAS GEMMs

The forward saves only the row statistics [2, B, L] and its outputs. Why the backward still
writes dS: the single head is d = 768 wide (12 of BERT's heads side by side), and
FlashAttention's register-resident [block, d] accumulators of dQ and dK, at 12 x the head width
its kernels take, do not fit a program; dS goes to cuBLAS as in the hybrid. Inputs and the
impls' signature are those of the hybrid impl (`partition_attention_triton`); the costs are
shatter/kernels/cost.py's `shatter::fused_fwd` and `shatter::fused_bwd`.
"""

import torch
from torch import Tensor

from shatter.attention.projection import (
    context_views,
    gather_projections,
    new_context,
    projection_views,
)
from shatter.attention.triton_kernel import (
    _check,
    backward_kernels,
    forward_kernels,
    register_backward,
)
from shatter.kernels.cost import register_costs


# flexible_layout: compiled, X comes as a view of the projection's [X | 1 | 0] (projection.
# gemm_input), strided rows; the kernels take X's strides, so inductor passes it without a copy
@torch.library.custom_op("shatter::fused_fwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fused_fwd(
    P: torch.Tensor, X: torch.Tensor, mask: torch.Tensor, table: torch.Tensor, sigmoid: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the context [X̄ | A_part | 1 | 0] [B, L, context_width], stat [2, B, L] fp32) from the layer's
    projections P = [Q | V | c]; stat is kept for `fused_bwd`."""
    return forward_kernels(P, X, mask, table, sigmoid, None)


@fused_fwd.register_fake
def _(P, X, mask, table, sigmoid):
    B, L, _ = X.shape
    return new_context(X, table.shape[0]), X.new_empty(2, B, L, dtype=torch.float32)


# flexible_layout: compiled, X comes as a view of the projection's [X | 1 | 0] (projection.
# gemm_input), strided rows; the kernels take X's strides, so inductor passes it without a copy
@torch.library.custom_op("shatter::fused_bwd", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def fused_bwd(
    P: Tensor, X: Tensor, mask: Tensor, table: Tensor, stat: Tensor, out: Tensor, part: Tensor,
    g_out: Tensor, g_part: Tensor, sigmoid: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(dP, dX): the backward kernels with the scores recomputed, then dQ and dX in cuBLAS."""
    return backward_kernels(P, X, mask, table, None, stat, out, part, g_out, g_part, sigmoid)


@fused_bwd.register_fake
def _(P, X, mask, table, stat, out, part, g_out, g_part, sigmoid):
    return torch.empty_like(P, memory_format=torch.contiguous_format), torch.empty_like(X)


register_backward(fused_fwd, torch.ops.shatter.fused_bwd)
register_costs(("shatter::fused_fwd", "shatter::fused_bwd"))


def partition_attention_fused(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid: bool):
    """(X_bar [B, n, L, d/n], A_part [B, L, n]) as `lean.partition_mix_lean` gives them for
    Z0 = Q Xᵀ/√d (the impls' common signature; Q, V and c gathered into one P, a copy)."""
    _check(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, "fused")
    P = gather_projections(Q_BLD, V_BnLk, c_BLn_or_None)
    ctx, _ = torch.ops.shatter.fused_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))
    return context_views(ctx, table.shape[0])


def fused_attention_layer(P, X_BLD, mask_BL, table, sigmoid: bool):
    """The layer's context [X̄ | A_part | 1 | 0] ([B, L, context_width]) from its projections P = [Q | V | c]
    (no copy of them)."""
    B, L, d = X_BLD.shape
    Q, V, c = projection_views(P, d, table.shape[0])
    _check(Q, X_BLD, V, c, mask_BL, table, "fused")
    return torch.ops.shatter.fused_fwd(P, X_BLD, mask_BL, table, bool(sigmoid))[0]
