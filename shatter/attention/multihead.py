"""Multi-head softmax attention variants: BERT, no position, BERT-RPE, BERT-RAB and Part_Mask.

Every variant maps `forward(x_BLD, mask_BL) -> context_BLD` (before W^O, which the block owns)
and `pool(y_BD, x_BLD, mask_BL) -> context_BD`, the §3.4 attention of a learnt query over a
layer's hidden states with the layer's own weights. `mask_BL` is True at real tokens; padded keys
get no weight, so padding never changes the outputs at real tokens. These variants take
`mask_BL = None` for a batch without padding (`optional_mask`: the encoder passes None when the
caller's attention_mask is None): SDPA then gets no mask and runs FlashAttention-2 on a GPU, where
a mask (even all ones) keeps it on the memory-efficient kernel. Deciding needs no host sync: the
caller knows whether it padded the batch.

References: Vaswani et al. 2017 (eq. 1-3 of the paper, §2); Shaw et al. 2018 as the paper
defines RPE in §2; T5's relative attention bias (Raffel et al. 2019, HF `T5Attention.
_relative_position_bucket`); Part_Mask is eq. 4, §3.1.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shatter.attention.layer_weights import LayerWeights, interleaved, matmul_dtype
from shatter.attention.projection import gemm_input, project, weight_grads
from shatter.partition import PartitionBuffer, partition_mask

if TYPE_CHECKING:  # annotations only: shatter.config reads this registry
    from shatter.config import ModelConfig


def _heads(t_BLD: torch.Tensor, n: int) -> torch.Tensor:
    """[B, L, d] -> [B, n, L, d/n] (eq. 1's tensor form, Q[h] = Q[:, h d/n:(h+1) d/n])."""
    B, L, d = t_BLD.shape
    return t_BLD.view(B, L, n, d // n).transpose(1, 2)


def _merge(t_BNLK: torch.Tensor) -> torch.Tensor:
    """[B, n, L, d/n] -> [B, L, d] (eq. 3)."""
    B, n, L, k = t_BNLK.shape
    return t_BNLK.transpose(1, 2).reshape(B, L, n * k)


def masked_softmax(scores: torch.Tensor, mask_BL: torch.Tensor | None) -> torch.Tensor:
    """Softmax over keys with padded keys at exactly 0; scores are [B, ..., Lq, Lk]; a None mask:
    no padding."""
    if mask_BL is None:
        return scores.softmax(-1)
    key = mask_BL.view(mask_BL.shape[0], *([1] * (scores.dim() - 2)), mask_BL.shape[-1])
    return scores.masked_fill(~key, torch.finfo(scores.dtype).min).softmax(-1)


def _key_mask(mask_BL: torch.Tensor | None) -> torch.Tensor | None:
    """SDPA's [B, 1, 1, L] key mask (True = keep), or None (no padding: the flash kernel)."""
    return None if mask_BL is None else mask_BL[:, None, None, :]


class _PackedQKV(torch.autograd.Function):
    """(q, k, v) = x [W^Q; W^K; W^V]ᵀ + [b^Q; b^K; b^V], one GEMM, as three [B, L, d] views;
    the backward takes SDPA's three gradients as they come. Through `linear(...).chunk(3)`
    autograd first copied them into one [T, 3d] gradient (a `cat`: 3 kernels and 150 MB a layer
    at BERT-base, 16,384 tokens) for the GEMMs and the bias sum to read; here dx is three GEMMs
    accumulating into one output (cuBLAS adds C), and q's, k's and v's weight and bias
    gradients three `weight_grads` (compiled: three GEMMs over [x | 1], no sums)."""

    @staticmethod
    def forward(ctx, x, W, b):
        xc = gemm_input(x.to(W.dtype), True)  # the GEMM's own input (autocast's cast)
        ctx.save_for_backward(xc, W)
        ctx.dtype = x.dtype
        return project(xc, W, b).chunk(3, -1)

    @staticmethod
    def backward(ctx, *grads):
        xc, W = ctx.saved_tensors
        d = W.shape[1]
        g = [t.reshape(-1, t.shape[-1]) for t in grads]  # SDPA's come contiguous: views
        dx = dW = db = None
        if ctx.needs_input_grad[0]:
            Wq, Wk, Wv = W.chunk(3, 0)
            dx = torch.addmm(torch.addmm(g[0] @ Wq, g[1], Wk), g[2], Wv)
            dx = dx.view(*xc.shape[:-1], d).to(ctx.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dW, db = weight_grads(g, xc, d, True)
        return dx, dW, db


class BertAttention(nn.Module):
    """Multi-head softmax attention (eq. 1-3); the embeddings add absolute positions (eq. 4)."""

    absolute_positions = True
    parts = False  # heads are the n parts of the partition N (§3.1): n even, >= 4
    optional_mask = True  # mask_BL None: no padding (SDPA's flash kernel on a GPU)

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d = config.hidden
        self.n = config.heads
        self.query = nn.Linear(d, d)  # W^Q
        self.key = nn.Linear(d, d)  # W^K
        self.value = nn.Linear(d, d)  # W^V
        self.attention_dropout = config.attention_dropout
        self.fused_qkv = config.fused_qkv

    def _p(self) -> float:
        return self.attention_dropout if self.training else 0.0

    @classmethod
    def prepare(cls, blocks) -> list[LayerWeights]:
        """With config.fused_qkv: every layer's [W^Q; W^K; W^V] and [b^Q; b^K; b^V], made once
        per forward in one cat each (shatter/attention/layer_weights.py), so that Q, K and V
        come from one [d, 3d] GEMM; the parameters keep their names (query, key, value)."""
        if not blocks[0].attention.fused_qkv:
            return [LayerWeights({}, block.output.weight, block.output.bias) for block in blocks]
        names = ("query", "key", "value")
        layers = [[block.attention.get_submodule(n) for n in names] for block in blocks]
        dtype = matmul_dtype(layers[0][0].weight)
        W = interleaved([[m.weight for m in layer] for layer in layers], dtype)
        b = interleaved([[m.bias for m in layer] for layer in layers], dtype)
        return [
            LayerWeights({"qkv": (w, c)}, block.output.weight, block.output.bias)
            for w, c, block in zip(W, b, blocks, strict=True)
        ]

    def _qkv(self, x_BLD: torch.Tensor, qkv) -> tuple[torch.Tensor, ...]:
        """(q, k, v), each [B, n, L, d/n]: one GEMM with the fused `qkv` = (W, b) from
        `prepare`, or three with the layer's own W^Q, W^K, W^V."""
        if qkv is None:
            return tuple(_heads(f(x_BLD), self.n) for f in (self.query, self.key, self.value))
        return tuple(_heads(t, self.n) for t in _PackedQKV.apply(x_BLD, *qkv))

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor | None, qkv=None) -> torch.Tensor:
        q, k, v = self._qkv(x_BLD, qkv)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self._bias(x_BLD, mask_BL), dropout_p=self._p()
        )
        return _merge(out)

    def _bias(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor | None) -> torch.Tensor | None:
        """The attention mask/bias given to SDPA: here only the padded keys (bool, True = keep);
        None without padding."""
        return _key_mask(mask_BL)

    def pool(
        self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor | None
    ) -> torch.Tensor:
        """§3.4: q = y W^Q, K = X W^K, V = X W^V, multi-head softmax over the layer's tokens."""
        q = _heads(self.query(y_BD)[:, None, :], self.n)
        k, v = _heads(self.key(x_BLD), self.n), _heads(self.value(x_BLD), self.n)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=_key_mask(mask_BL), dropout_p=self._p()
        )
        return _merge(out)[:, 0]


class NoPositionAttention(BertAttention):
    """BERT with no position information at all (the "No_Position" ablation, §3)."""

    absolute_positions = False


def t5_relative_bucket(rel_pos: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional bucketing of j - i: half the buckets per sign, exact below num_buckets/4,
    log-spaced up to max_distance, the last bucket beyond it."""
    half = num_buckets // 2
    bucket = (rel_pos > 0).long() * half
    dist = rel_pos.abs()
    exact = half // 2
    log_bucket = (
        exact
        + (
            torch.log(dist.float().clamp_min(1) / exact)
            / math.log(max_distance / exact)
            * (half - exact)
        ).long()
    )
    log_bucket = log_bucket.clamp_max(half - 1)
    return bucket + torch.where(dist < exact, dist, log_bucket)


class RabAttention(BertAttention):
    """BERT plus T5's relative attention bias B[:, i, j] = W^B[bucket(j - i), :] (§2, "RAB").

    Keeps BERT's absolute position embeddings ("BERT-RAB adds a RAB to the BERT model", §4).
    One bias per head per bucket, in every layer (T5 shares one table across layers; we give
    each layer its own so that each variant owns its position parameters).
    """

    absolute_positions = True

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.relative_attention_bias = nn.Embedding(config.rab_buckets, config.heads)  # W^B, m x n
        # The bucket of every relative position -(max_len-1)..(max_len-1), computed once: the bias
        # is Toeplitz, so each forward looks up 2 max_len - 1 rows of W^B and indexes [n, L, L]
        # from them as the partition archs index N (instead of bucketing and embedding L^2 pairs).
        rel = torch.arange(-(config.max_len - 1), config.max_len)
        buckets = t5_relative_bucket(rel, config.rab_buckets, config.rab_max_distance)
        self.register_buffer("buckets", buckets, persistent=False)  # (2 max_len - 1,)

    def _bias(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor | None) -> torch.Tensor:
        table = self.relative_attention_bias(self.buckets).t()  # [n, 2 max_len - 1]
        bias = partition_mask(table, x_BLD.shape[1])[
            None
        ]  # B[h, i, j] = W^B[bucket(j - i), h]: [1, n, L, L]
        if mask_BL is None:
            return bias
        pad = torch.zeros(mask_BL.shape, dtype=bias.dtype, device=bias.device)
        pad = pad.masked_fill(~mask_BL, torch.finfo(bias.dtype).min)
        return bias + pad[:, None, None, :]


class RpeAttention(BertAttention):
    """Shaw et al.'s relative position embeddings as §2 defines them.

    Per layer a (2m - 1) x d matrix R (m = 128), K_rel = R W^K and V_rel = R W^V (the weights
    of W^K and W^V, as x_j + R[j - i] gives the key and value), distances clipped to +-(m - 1):
        A = softmax((Q K^T + S_rel) / sqrt(d/n)),  S_rel[i, j] = Q[i] . K_rel[clip(j - i)]
        X_bar = A V + A_rel V_rel,                  A_rel[i, r] = sum_{j: clip(j - i) = r} A[i, j]
    No absolute positions. R does not depend on max_len, so length extension keeps it as is.
    """

    absolute_positions = False

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.m = config.rpe_max_distance
        self.relative_embeddings = nn.Parameter(torch.empty(2 * self.m - 1, config.hidden))  # R

    def _relative(self, L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of R that length L can reach, and the [L, L] index of clip(j - i) into them."""
        reach = min(L - 1, self.m - 1)
        rows = self.relative_embeddings[self.m - 1 - reach : self.m + reach]
        pos = torch.arange(L, device=device)
        return rows, (pos[None, :] - pos[:, None]).clamp(-reach, reach) + reach

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, qkv=None) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q, k, v = self._qkv(x_BLD, qkv)
        R, idx = self._relative(L, x_BLD.device)
        k_rel = _heads(F.linear(R, self.key.weight)[None], self.n)[0]  # [n, r, d/n]
        v_rel = _heads(F.linear(R, self.value.weight)[None], self.n)[0]
        idx_BNLL = idx.expand(B, self.n, L, L)
        s_rel = torch.gather(q @ k_rel.transpose(-1, -2), -1, idx_BNLL)  # [B, n, L, L]
        scores = (q @ k.transpose(-1, -2) + s_rel) / math.sqrt(q.shape[-1])
        a = F.dropout(masked_softmax(scores, mask_BL), self._p(), self.training)
        a_rel = a.new_zeros(B, self.n, L, R.shape[0]).scatter_add_(-1, idx_BNLL, a)
        return _merge(a @ v + a_rel @ v_rel)


class PartMaskAttention(PartitionBuffer, BertAttention):
    """eq. 4, §3.1: A = softmax(Q K^T / sqrt(d/n)) ⊙ N, head h restricted by N[h] = f_h(j - i)."""

    absolute_positions = False
    parts = True

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config, layer)
        self.register_partition(config.heads, layer, config.layers, config.max_len)

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, qkv=None) -> torch.Tensor:
        q, k, v = self._qkv(x_BLD, qkv)
        N = partition_mask(self.exact_partition(), x_BLD.shape[1]).to(q.dtype)  # [n, L, L]
        a = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), mask_BL) * N
        return _merge(F.dropout(a, self._p(), self.training) @ v)
