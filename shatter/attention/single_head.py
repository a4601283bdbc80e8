"""Single-head attention with a relative partition: 1H_Softmax, 1H_Sigmoid, Part_Bias, Shatter.

All four compute ONE score matrix against the hidden states themselves (K = X, no W^K; §3.2)
and split it over the n parts with the constant partition mask N[h, i, j] = f_h(j - i) (§3.1),
keeping V as a rank-3 tensor of n parts:

    1h-softmax  A = softmax(Q X^T / sqrt(d)) ⊙ N
    1h-sigmoid  A = normalize2(sigmoid(Q X^T / sqrt(d))) ⊙ N                          eq. 5
    part-bias   A = normalize2(sigmoid(Q X^T / sqrt(d) + B)) ⊙ N,
                B[i, :] = sum_h (Q R^T)[i, h] N[h, i, :]                             §3.3
    shatter     part-bias plus X_bar_bar = X_bar + A_part V_part,
                A_part^T = sum_j A[:, :, j],  V_part = R W^V                          §3.3

X_bar[:, h d/n:(h+1) d/n] = A[h] V[h] (eq. 2-3). Padded keys are zeroed before the L2
normalisation. R is the n x d partition embedding matrix of the layer. V_part uses W^V's weight
without its bias, as Shaw's V_rel = R W^V does. These archs have no dropout on the attention
weights (the paper's eq. 5 has none, and the lean kernel would have to store its mask).

The layer returns the context [X̄ | A_part | 1 | 0] ([B, L, context_width]), and the block applies W^O folded
with V_part to it: [X̄ | A_part] [W^O | W^O V_partᵀ]ᵀ = (X̄ + A_part V_part) W^Oᵀ, §3.3's X̄̄
through W^O in one GEMM ([W^O | 0] for the archs without the A_part V_part term). The folded
W^O and the projection weights [W^Q; W^V; R W^Q] are made from the parameters once per forward
for every layer (`prepare`, shatter/attention/layer_weights.py).

`config.attention_impl` picks how A, X_bar and A_part are computed (shatter/attention/impls.py:
triton, chunked, lean or naive, `auto` by device); all give the same values and gradients.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from shatter.attention.impls import keeps_rows, kept_rows_bytes, resolve_layer
from shatter.attention.layer_weights import (
    LayerWeights,
    assembled_weights,
    matmul_dtype,
    single_head_weights,
    without_autocast,
)
from shatter.attention.lean import activate
from shatter.attention.projection import project_with_keys
from shatter.partition import PartitionBuffer

if TYPE_CHECKING:  # annotations only: shatter.config reads this registry
    from shatter.config import ModelConfig


class SingleHeadPartitionAttention(PartitionBuffer, nn.Module):
    """The shared form; subclasses only choose the activation and which uses of R they have."""

    absolute_positions = False
    parts = True  # heads are the n parts of the partition N (§3.1)
    sigmoid = True  # eq. 5's L2-normalised sigmoid; False: softmax
    partition_bias = False  # B inside the activation (§3.3)
    partition_value = False  # A_part V_part added to the context (§3.3)

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d, self.n = config.hidden, config.heads
        self.query = nn.Linear(d, d)  # W^Q
        self.value = nn.Linear(d, d)  # W^V
        if self.partition_bias or self.partition_value:
            self.partition_embeddings = nn.Parameter(torch.empty(self.n, d))  # R, n x d
        self.register_partition(config.heads, layer, config.layers, config.max_len)
        self.impl = config.attention_impl

    @classmethod
    def prepare(cls, blocks) -> list[LayerWeights]:
        """Every layer's projection weights and folded W^O, once per forward (layer_weights.py)."""
        return single_head_weights(blocks, cls.partition_bias, cls.partition_value)

    def projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (W^P, b^P) alone (layer_weights.assembled_weights)."""
        weight = self.query.weight
        dtype = matmul_dtype(weight)  # autocast's, asked before it is turned off
        with without_autocast(weight.device):
            W_P, b_P, _ = assembled_weights([self], None, self.partition_bias, False, dtype)
        return W_P[0], b_P[0]

    def forward(
        self,
        x_BLD: torch.Tensor,
        mask_BL: torch.Tensor,
        projection: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The context [X̄ | A_part | 1 | 0] ([B, L, context_width]) for the block's folded W^O. `projection`:
        this layer's (W^P, b^P) from `prepare` (made here when not given)."""
        X = x_BLD.to(matmul_dtype(x_BLD))  # the keys (K = X), cast once: bf16 under autocast
        if projection is None:
            projection = self.projection()
        P, K = project_with_keys(X, *projection)  # [Q | V | c] in one GEMM; K = X (§3.2-3.3)
        shape = (*x_BLD.shape, self.n)  # (B, l, d, n): auto's choice of kernel
        attend = resolve_layer(self.impl, x_BLD.device, P.dtype, shape)  # Q X^T / sqrt(d) inside
        return attend(P, K, mask_BL, self.exact_partition(), self.sigmoid)  # eq. 3, §3.3

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """§3.4 with single-head attention: a = act(y W^Q X^T / sqrt(d)), y_bar = a X W^V.
        The learnt query has no position, so there is no N, B or A_part term."""
        z = (self.query(y_BD)[:, None, :] @ x_BLD.transpose(-1, -2)) / math.sqrt(x_BLD.shape[-1])
        return (activate(z, mask_BL, self.sigmoid) @ self.value(x_BLD))[:, 0]


class OneHeadSoftmaxAttention(SingleHeadPartitionAttention):
    sigmoid = False


class OneHeadSigmoidAttention(SingleHeadPartitionAttention):
    pass


class PartBiasAttention(SingleHeadPartitionAttention):
    partition_bias = True


class ShatterAttention(SingleHeadPartitionAttention):
    partition_bias = True
    partition_value = True


def _auto_layers(model: nn.Module) -> list[SingleHeadPartitionAttention]:
    return [
        m
        for m in model.modules()
        if isinstance(m, SingleHeadPartitionAttention) and m.impl == "auto"
    ]


def rows_to_keep(
    model: nn.Module, batch: int, length: int, dtype: torch.dtype, capability, memory: float
) -> int:
    """The bytes of W that `rows-keep` keeps in `model`'s `auto` partition layers for a training
    batch of `batch` x `length` in `dtype` on a GPU of `capability` with `memory` bytes, where
    `keeps_rows` says a run takes it; 0 where it does not."""
    layers = _auto_layers(model)
    if not layers:
        return 0
    shape = (batch, length, layers[0].query.in_features, layers[0].n)
    if not keeps_rows(capability, shape, dtype, len(layers), memory):
        return 0
    return kept_rows_bytes(shape, dtype, len(layers))


def keep_rows_where_they_fit(
    model: nn.Module, batch: int, length: int, dtype: torch.dtype, capability, memory: float
) -> int:
    """Runs `rows-keep` in every partition layer of `model` set to `auto` where `rows_to_keep`
    says so; the bytes it keeps (0: nothing changed). Only the layers' runtime choice changes:
    the config, and so checkpoints and exports, keep `auto`."""
    kept = rows_to_keep(model, batch, length, dtype, capability, memory)
    if kept:
        for layer in _auto_layers(model):
            layer.impl = "rows-keep"
    return kept
