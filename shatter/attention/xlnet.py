"""XLNet's relative attention (Yang et al. 2019, with Transformer-XL's relative encoding), one
stream or two.

Per head, with W_R one trainable d x d matrix per layer, u and v trainable per-head biases and
r_t the fixed sinusoid encoding of the relative distance t = i - j (Dai et al. 2019, eq. of §3.3):

    Score_ij = ((q_i + u) . k_j + (q_i + v) . (W_R r_{i-j})) / sqrt(d/n)

plus XLNet's relative segment encoding (§2.5): with s+ and s- trainable per-head vectors per
layer (same segment / different segments) and b a trainable per-head bias, the score gains

    a_ij = (q_i + b) . s_ij,   s_ij = s+ if segment_i == segment_j else s-

(inside the same 1/sqrt(d/n)), then softmax over the visible keys, dropout, A V (eq. 2-3 of the
paper). No absolute positions, and nothing depends on max_len: the encodings are functions of
distance and of segment equality, so length extension adds no weights.

The toolkit has no segment input (no arch has token-type embeddings): the segments come from
the [SEP]s of input_ids (`segment_ids`, computed once per forward by the encoder because this
class sets `segments = True`; shatter/model.py): position i is in segment "number of [SEP]
strictly before i", so `[CLS] a [SEP]` is segment 0 and `b [SEP]` segment 1, and in a packed
pretraining row each document is its own segment. Only same / different matters, so the
encoding is invariant to shifting the whole sequence.

Two streams (XLNet §2.3): for a factorisation order given as `rank_BL` (the position of each
token in the order; tokens of equal rank see each other), the content stream h at i attends to
the content of every j with rank_j <= rank_i (itself included) and the query stream g at i to
the content of every j with rank_j < rank_i: it knows its position i (through r_{i-j}) but not
its own content. Both streams share every weight of the layer (XLNet's two-stream attention),
the segment term included: the query stream at i knows i's segment, as it knows i. Segments
reveal only where the [SEP]s are, and [SEP] is never a prediction target. `forward` is the
content stream with every position visible: the single-stream encoder of finetuning and
evaluation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shatter.attention.multihead import _heads, _merge

if TYPE_CHECKING:  # annotations only: shatter.config reads this registry
    from shatter.config import ModelConfig


def sinusoid(distances: torch.Tensor, d: int) -> torch.Tensor:
    """r_t = [sin(t w_k), cos(t w_k)], w_k = 10000^(-2k/d) (Transformer-XL's relative encoding)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = distances.float()[:, None] * inv_freq.to(distances.device)[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


def same_segment(segment_BL: torch.Tensor) -> torch.Tensor:
    """[B, L, L]: positions i and j are in the same segment."""
    return segment_BL[:, :, None] == segment_BL[:, None, :]


class XLNetAttention(nn.Module):
    """XLNet's relative attention; `two_stream` is the permutation-LM form of the same weights."""

    parts = False
    absolute_positions = False  # having `two_stream`, the embeddings also hold w (model.py)
    segments = True  # forward and two_stream take segment_BL (Encoder.attention_inputs)
    # added after the first exports: at zero the segment term is exactly 0 (old models unchanged)

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d, self.n = config.hidden, config.heads
        std = config.initializer_range
        self.query = nn.Linear(d, d)  # W^Q
        self.key = nn.Linear(d, d)  # W^K
        self.value = nn.Linear(d, d)  # W^V
        self.relative = nn.Linear(d, d, bias=False)  # W_R, applied to the sinusoid r_{i-j}
        self.content_bias = nn.Parameter(torch.randn(self.n, d // self.n) * std)  # u
        self.position_bias = nn.Parameter(torch.randn(self.n, d // self.n) * std)  # v
        # [s+, s-] per head (XLNet's seg_embed) and b (its r_s_bias)
        self.segment_embeddings = nn.Parameter(torch.randn(2, self.n, d // self.n) * std)
        self.segment_bias = nn.Parameter(torch.randn(self.n, d // self.n) * std)
        self.attention_dropout = config.attention_dropout

    def _position_keys(self, L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """W_R r_t for t = L-1 .. -(L-1), per head [n, 2L-1, d/n], and the [L, L] index of
        t = i - j into them."""
        t = torch.arange(L - 1, -L, -1, device=device)
        kr = self.relative(sinusoid(t, self.relative.in_features).to(self.relative.weight.dtype))
        pos = torch.arange(L, device=device)
        return _heads(kr[None], self.n)[0], (L - 1) - (pos[:, None] - pos[None, :])

    def _attend(self, q, k, v, kr, idx, same_BLL, visible_BLL) -> torch.Tensor:
        """Context of queries q [B, n, L, d/n] over keys k, v, with `visible_BLL[b, i, j]` and
        `same_BLL[b, i, j]`: i and j in the same segment."""
        B, n, L, _ = q.shape
        content = (q + self.content_bias[:, None]) @ k.transpose(-1, -2)  # (q_i + u) . k_j
        position = (q + self.position_bias[:, None]) @ kr.transpose(-1, -2)  # [B, n, L, 2L-1]
        position = torch.gather(position, -1, idx.expand(B, n, L, L))  # (q_i + v) . W_R r_{i-j}
        # (q_i + b) . s+ and (q_i + b) . s-: [B, n, L, 1] each, picked per (i, j)
        seg = (q + self.segment_bias[:, None]) @ self.segment_embeddings.permute(1, 2, 0)
        segment = torch.where(same_BLL[:, None], seg[..., :1], seg[..., 1:])
        scores = (content + position + segment) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible_BLL[:, None], torch.finfo(scores.dtype).min)
        # a query that sees no key (the query stream at z_1) gets no context, not a uniform mix
        a = scores.softmax(-1) * visible_BLL.any(-1)[:, None, :, None]
        a = F.dropout(a, self.attention_dropout if self.training else 0.0)
        return _merge(a @ v)

    def forward(
        self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, segment_BL: torch.Tensor
    ) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q, k, v = (_heads(f(x_BLD), self.n) for f in (self.query, self.key, self.value))
        kr, idx = self._position_keys(L, x_BLD.device)
        return self._attend(
            q, k, v, kr, idx, same_segment(segment_BL), mask_BL[:, None, :].expand(B, L, L)
        )

    def two_stream(
        self,
        h_BLD: torch.Tensor,
        g_BLD: torch.Tensor,
        mask_BL: torch.Tensor,
        rank_BL: torch.Tensor,
        segment_BL: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(content context, query context): h attends to rank_j <= rank_i, g to rank_j < rank_i;
        both read the keys and values of the content stream h only (XLNet eq. of §2.3)."""
        L = h_BLD.shape[1]
        k, v = _heads(self.key(h_BLD), self.n), _heads(self.value(h_BLD), self.n)
        kr, idx = self._position_keys(L, h_BLD.device)
        segment = same_segment(segment_BL)
        earlier = rank_BL[:, None, :] < rank_BL[:, :, None]  # [b, i, j]: rank_j < rank_i
        same_rank = rank_BL[:, None, :] == rank_BL[:, :, None]
        key = mask_BL[:, None, :]
        content = self._attend(
            _heads(self.query(h_BLD), self.n), k, v, kr, idx, segment, (earlier | same_rank) & key
        )
        query = self._attend(
            _heads(self.query(g_BLD), self.n), k, v, kr, idx, segment, earlier & key
        )
        return content, query

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """§3.4: the learnt query has no position and no segment, so only the content term
        (q + u) . k_j."""
        q = _heads(self.query(y_BD)[:, None, :], self.n)
        k, v = _heads(self.key(x_BLD), self.n), _heads(self.value(x_BLD), self.n)
        scores = (q + self.content_bias[:, None]) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask_BL[:, None, None, :], torch.finfo(scores.dtype).min)
        a = F.dropout(scores.softmax(-1), self.attention_dropout if self.training else 0.0)
        return _merge(a @ v)[:, 0]
