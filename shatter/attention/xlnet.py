"""XLNet's relative attention (Yang et al. 2019, with Transformer-XL's relative encoding), one
stream or two.

Per head, with W_R one trainable d x d matrix per layer, u and v trainable per-head biases and
r_t the fixed sinusoid encoding of the relative distance t = i - j (Dai et al. 2019, eq. of §3.3):

    Score_ij = ((q_i + u) . k_j + (q_i + v) . (W_R r_{i-j})) / sqrt(d/n)

softmax over the visible keys, dropout, then A V (eq. 2-3 of the paper). No absolute positions,
and nothing depends on max_len: the encoding is a function of distance, so length extension adds
no weights. As for every arch of this toolkit there is no segment input (the BERT baselines
have no token-type embeddings either): a pair is told apart by its [SEP] alone, so XLNet's
relative segment encoding is left out.

Two streams (XLNet §2.3): for a factorisation order given as `rank_BL` (the position of each
token in the order; tokens of equal rank see each other), the content stream h at i attends to
the content of every j with rank_j <= rank_i (itself included) and the query stream g at i to
the content of every j with rank_j < rank_i: it knows its position i (through r_{i-j}) but not
its own content. Both streams share every weight of the layer (XLNet's two-stream attention).
`forward` is the content stream with every position visible: the single-stream encoder of
finetuning and evaluation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shatter.attention.multihead import _heads, _merge
from shatter.config import ModelConfig


def sinusoid(distances: torch.Tensor, d: int) -> torch.Tensor:
    """r_t = [sin(t w_k), cos(t w_k)], w_k = 10000^(-2k/d) (Transformer-XL's relative encoding)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = distances.float()[:, None] * inv_freq.to(distances.device)[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class XLNetAttention(nn.Module):
    """XLNet's relative attention; `two_stream` is the permutation-LM form of the same weights."""

    absolute_positions = False  # having `two_stream`, the embeddings also hold w (model.py)

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
        self.attention_dropout = config.attention_dropout

    def _position_keys(self, L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """W_R r_t for t = L-1 .. -(L-1), per head [n, 2L-1, d/n], and the [L, L] index of
        t = i - j into them."""
        t = torch.arange(L - 1, -L, -1, device=device)
        kr = self.relative(sinusoid(t, self.relative.in_features).to(self.relative.weight.dtype))
        pos = torch.arange(L, device=device)
        return _heads(kr[None], self.n)[0], (L - 1) - (pos[:, None] - pos[None, :])

    def _attend(self, q, k, v, kr, idx, visible_BLL) -> torch.Tensor:
        """Context of queries q [B, n, L, d/n] over keys k, v, with `visible_BLL[b, i, j]`."""
        B, n, L, _ = q.shape
        content = (q + self.content_bias[:, None]) @ k.transpose(-1, -2)  # (q_i + u) . k_j
        position = (q + self.position_bias[:, None]) @ kr.transpose(-1, -2)  # [B, n, L, 2L-1]
        position = torch.gather(position, -1, idx.expand(B, n, L, L))  # (q_i + v) . W_R r_{i-j}
        scores = (content + position) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible_BLL[:, None], torch.finfo(scores.dtype).min)
        # a query that sees no key (the query stream at z_1) gets no context, not a uniform mix
        a = scores.softmax(-1) * visible_BLL.any(-1)[:, None, :, None]
        a = F.dropout(a, self.attention_dropout if self.training else 0.0)
        return _merge(a @ v)

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        q, k, v = (_heads(f(x_BLD), self.n) for f in (self.query, self.key, self.value))
        kr, idx = self._position_keys(L, x_BLD.device)
        return self._attend(q, k, v, kr, idx, mask_BL[:, None, :].expand(B, L, L))

    def two_stream(
        self, h_BLD: torch.Tensor, g_BLD: torch.Tensor, mask_BL: torch.Tensor, rank_BL: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(content context, query context): h attends to rank_j <= rank_i, g to rank_j < rank_i;
        both read the keys and values of the content stream h only (XLNet eq. of §2.3)."""
        L = h_BLD.shape[1]
        k, v = _heads(self.key(h_BLD), self.n), _heads(self.value(h_BLD), self.n)
        kr, idx = self._position_keys(L, h_BLD.device)
        earlier = rank_BL[:, None, :] < rank_BL[:, :, None]  # [b, i, j]: rank_j < rank_i
        same = rank_BL[:, None, :] == rank_BL[:, :, None]
        key = mask_BL[:, None, :]
        content = self._attend(
            _heads(self.query(h_BLD), self.n), k, v, kr, idx, (earlier | same) & key
        )
        query = self._attend(_heads(self.query(g_BLD), self.n), k, v, kr, idx, earlier & key)
        return content, query

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """§3.4: the learnt query has no position, so only the content term (q + u) . k_j."""
        q = _heads(self.query(y_BD)[:, None, :], self.n)
        k, v = _heads(self.key(x_BLD), self.n), _heads(self.value(x_BLD), self.n)
        scores = (q + self.content_bias[:, None]) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask_BL[:, None, None, :], torch.finfo(scores.dtype).min)
        a = F.dropout(scores.softmax(-1), self.attention_dropout if self.training else 0.0)
        return _merge(a @ v)[:, 0]
