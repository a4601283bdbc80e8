"""A Shatter-toolkit encoder in plain PyTorch for Hugging Face transformers (remote code).

This file is copied into every export whose arch has no native transformers class, and is
loaded with `trust_remote_code=True`. It imports only torch and transformers: the toolkit need
not be installed. Parameter names equal the toolkit's, so its weights load unchanged, and the
toolkit's CI checks these classes' logits against its own model for every arch.

The model (Shatter: single-headed attention with relative partition, §2-3 and the appendix of
the paper; its BERT baselines and ablations): word embeddings (+ learnt absolute positions for
bert and bert-rab, eq. 4), then post-LN blocks around one attention variant:

    bert, no-position  multi-head softmax attention (eq. 1-3)
    bert-rpe           + Shaw et al.'s relative key and value embeddings R, clipped at +-(m - 1)
    bert-rab           + T5's bucketed relative attention bias W^B
    part-mask          A = softmax(Q K^T / sqrt(d/n)) ⊙ N                              eq. 4
    1h-softmax         A = softmax(Q X^T / sqrt(d)) ⊙ N        (single head, K = X, §3.2)
    1h-sigmoid         A = normalize2(sigmoid(Q X^T / sqrt(d))) ⊙ N                    eq. 5
    part-bias          as 1h-sigmoid with B[i, :] = sum_h (Q R^T)[i, h] N[h, i, :] inside (§3.3)
    shatter            part-bias plus A_part V_part, V_part = R W^V                     §3.3
    xlnet              Transformer-XL relative attention with XLNet's segment encoding

with N[h, i, j] = f_h(j - i) the partition of unity of the appendix. Attention is computed in
plain torch, so it runs on any device. The single-head archs take it over blocks of query rows
(A's rows are independent: both eq. 5's normalisation and the softmax are per row), part by
part within a block, so that neither [B, n, L, L] nor [B, L, L] is ever held: memory grows
linearly with L, at any input length (N is a function of j - i, so lengths past
max_position_embeddings are well defined). The multi-head archs hold [B, n, L, L], as BERT does.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, initialization as init
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)

from .configuration_shatter import ShatterConfig

ABSOLUTE_POSITIONS = ("bert", "bert-rab")  # eq. 4: learnt absolute position embeddings
MULTI_HEAD = ("bert", "bert-rpe", "bert-rab", "no-position", "part-mask")
SINGLE_HEAD = ("1h-softmax", "1h-sigmoid", "part-bias", "shatter")
SIGMOID = ("1h-sigmoid", "part-bias", "shatter")  # eq. 5's L2-normalised sigmoid
PARTITION_EMBEDDINGS = ("part-bias", "shatter")  # R, n x d (§3.3)
NORM_EPS = 1e-12


# --- the partition of unity (appendix) -------------------------------------------------------


@lru_cache(maxsize=256)
def partition_table(n: int, layer: int, n_layers: int, length: int) -> torch.Tensor:
    """[n, 2 length - 1]: column c holds f_h(c - (length - 1)). f_nu(x) = B_nu(u(x)) for x > 0
    (Bernstein polynomials of degree D = n/2 - 1), parts n/2.. mirror them for x < 0, and
    x = 0 is split evenly between f_0 and f_{n/2}. Computed in float64."""
    D = n // 2 - 1
    t = (layer + 1) / n_layers
    alpha, beta = -t * D, -(1.0 / D) * (D / 12.0) ** t
    x = torch.arange(-(length - 1), length, dtype=torch.float64)
    ax = x.abs()
    u = torch.log(torch.exp(beta * ax) * (1.0 - math.exp(alpha)) + math.exp(alpha)) / alpha
    u = u.clamp(0.0, 1.0)
    nu = torch.arange(D + 1, dtype=torch.float64)[:, None]
    binom = torch.tensor([math.comb(D, v) for v in range(D + 1)], dtype=torch.float64)[:, None]
    bern = binom * u[None] ** nu * (1.0 - u[None]) ** (D - nu)  # [D + 1, 2 length - 1]
    right = torch.where(x > 0, bern, torch.zeros_like(bern))
    left = torch.where(x < 0, bern, torch.zeros_like(bern))
    right[0] += 0.5 * (x == 0)
    left[0] += 0.5 * (x == 0)
    return torch.cat([right, left]).float()


def relative_index(table: torch.Tensor, rows: range, length: int) -> torch.Tensor:
    """[r, L]: (j - i) + (m - 1) for the rows i in `rows` and every j < L, the column of
    f(j - i) in a table of width 2m - 1."""
    m = (table.shape[1] + 1) // 2
    i = torch.arange(rows.start, rows.stop, device=table.device)
    j = torch.arange(length, device=table.device)
    return j[None, :] - i[:, None] + (m - 1)


def toeplitz(table: torch.Tensor, length: int) -> torch.Tensor:
    """[n, L, L] with out[h, i, j] = table[h, (j - i) + (m - 1)], m = (table width + 1) / 2."""
    return table[:, relative_index(table, range(length), length)]


def t5_relative_bucket(rel_pos: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional bucketing of j - i."""
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
    return bucket + torch.where(dist < exact, dist, log_bucket.clamp_max(half - 1))


def sinusoid(distances: torch.Tensor, d: int) -> torch.Tensor:
    """Transformer-XL's relative encoding r_t = [sin(t w_k), cos(t w_k)], w_k = 10000^(-2k/d)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angle = distances.float()[:, None] * inv_freq.to(distances.device)[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


# --- attention variants ----------------------------------------------------------------------


def _heads(t_BLD: torch.Tensor, n: int) -> torch.Tensor:
    B, L, d = t_BLD.shape
    return t_BLD.view(B, L, n, d // n).transpose(1, 2)  # [B, n, L, d/n]


def _merge(t_BNLK: torch.Tensor) -> torch.Tensor:
    B, n, L, k = t_BNLK.shape
    return t_BNLK.transpose(1, 2).reshape(B, L, n * k)


def masked_softmax(scores: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
    key = mask_BL.view(mask_BL.shape[0], *([1] * (scores.dim() - 2)), mask_BL.shape[-1])
    return scores.masked_fill(~key, torch.finfo(scores.dtype).min).softmax(-1)


def activate(Z: torch.Tensor, mask_BL: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """eq. 5's L2-normalised sigmoid (padded keys zeroed first), or a masked softmax."""
    if sigmoid:
        P = torch.sigmoid(Z) * mask_BL[:, None, :]
        return P / P.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return masked_softmax(Z, mask_BL)


class MultiHeadAttention(nn.Module):
    """bert, no-position, bert-rpe, bert-rab and part-mask: multi-head softmax attention."""

    def __init__(self, config: ShatterConfig, layer: int):
        super().__init__()
        d, self.n, self.arch = config.hidden_size, config.num_attention_heads, config.arch
        self.layer, self.layers = layer, config.num_hidden_layers
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        if self.arch == "bert-rpe":
            self.m = config.rpe_max_distance
            self.relative_embeddings = nn.Parameter(torch.empty(2 * self.m - 1, d))  # R
        if self.arch == "bert-rab":
            self.buckets = (config.rab_buckets, config.rab_max_distance)
            self.relative_attention_bias = nn.Embedding(config.rab_buckets, self.n)  # W^B

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, **_) -> torch.Tensor:
        B, L, _d = x_BLD.shape
        q, k, v = (_heads(f(x_BLD), self.n) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2)
        if self.arch == "bert-rpe":  # S_rel[i, j] = Q[i] . (R W^K)[clip(j - i)]
            reach = min(L - 1, self.m - 1)
            R = self.relative_embeddings[self.m - 1 - reach : self.m + reach]
            pos = torch.arange(L, device=x_BLD.device)
            idx = ((pos[None, :] - pos[:, None]).clamp(-reach, reach) + reach).expand(
                B, self.n, L, L
            )
            k_rel = _heads(F.linear(R, self.key.weight)[None], self.n)[0]
            v_rel = _heads(F.linear(R, self.value.weight)[None], self.n)[0]
            scores = scores + torch.gather(q @ k_rel.transpose(-1, -2), -1, idx)
        scores = scores / math.sqrt(q.shape[-1])
        if self.arch == "bert-rab":  # B[h, i, j] = W^B[bucket(j - i), h]
            rel = torch.arange(-(L - 1), L, device=x_BLD.device)
            table = self.relative_attention_bias(t5_relative_bucket(rel, *self.buckets)).t()
            scores = scores + toeplitz(table, L)[None]
        a = masked_softmax(scores, mask_BL)
        if self.arch == "part-mask":  # eq. 4: A ⊙ N
            table = partition_table(self.n, self.layer, self.layers, L).to(a.device, a.dtype)
            a = a * toeplitz(table, L)
        a = self.dropout(a)
        out = a @ v
        if self.arch == "bert-rpe":  # + A_rel V_rel
            a_rel = a.new_zeros(B, self.n, L, R.shape[0]).scatter_add_(-1, idx, a)
            out = out + a_rel @ v_rel
        return _merge(out)

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """§3.4: a learnt query (no position) attends over a layer's tokens."""
        q = _heads(self.query(y_BD)[:, None, :], self.n)
        k, v = _heads(self.key(x_BLD), self.n), _heads(self.value(x_BLD), self.n)
        a = masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), mask_BL)
        return _merge(self.dropout(a) @ v)[:, 0]


BLOCK_VALUES = 1 << 22  # a row block's n parts A ⊙ N[h], [B, n, r, L]: at most 16 MiB in fp32
MIN_BLOCK_ROWS = 32  # fewer rows would make each product too small to run well


def block_rows(B: int, n: int, L: int) -> int:
    """Query rows per block: the n parts' [B, n, r, L] (what a block's backward holds) within
    BLOCK_VALUES, at least MIN_BLOCK_ROWS rows."""
    return min(L, max(MIN_BLOCK_ROWS, BLOCK_VALUES // max(1, B * n * L)))


def mix_rows(Q, X, V, c, mask_BL, table, rows: range, sigmoid: bool):
    """The single-head attention of the query rows `rows`: ([B, r, d] the n parts' (A ⊙ N[h]) V[h]
    side by side, eq. 2-3; [B, r, n] A_part[i, h] = sum_j (A ⊙ N[h])_ij, §3.3), from these rows'
    scores Z = Q X^T / sqrt(d) (+ B, B_ij = sum_h c_ih N[h, i, j] when c = Q R^T is given) and
    A = activate(Z); N[h] is taken one part at a time, [r, L]."""
    idx = relative_index(table, rows, X.shape[1])  # N[h][rows] = table[h][idx]
    Z = (Q[:, rows.start : rows.stop] / math.sqrt(X.shape[-1])) @ X.transpose(-1, -2)
    if c is not None:
        for h in range(table.shape[0]):
            Z = Z + c[:, rows.start : rows.stop, h, None] * table[h][idx]
    A = activate(Z, mask_BL, sigmoid)
    outs, sums = [], []
    for h in range(table.shape[0]):
        A_h = A * table[h][idx]  # (A ⊙ N[h]) for these rows
        outs.append(A_h @ V[:, h])
        sums.append(A_h.sum(-1))
    return torch.cat(outs, dim=-1), torch.stack(sums, dim=-1)


class SingleHeadAttention(nn.Module):
    """1h-softmax, 1h-sigmoid, part-bias and shatter: one score matrix against K = X (§3.2),
    split over the n parts by N, V kept as n parts."""

    def __init__(self, config: ShatterConfig, layer: int):
        super().__init__()
        d, self.n, arch = config.hidden_size, config.num_attention_heads, config.arch
        self.layer, self.layers = layer, config.num_hidden_layers
        self.sigmoid = arch in SIGMOID
        self.partition_value = arch == "shatter"
        self.query, self.value = nn.Linear(d, d), nn.Linear(d, d)
        if arch in PARTITION_EMBEDDINGS:
            self.partition_embeddings = nn.Parameter(torch.empty(self.n, d))  # R

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, **_) -> torch.Tensor:
        """Row block by row block (`mix_rows`); when training, each block is recomputed in the
        backward (activation checkpointing), so the backward too holds one block at a time."""
        B, L, _d = x_BLD.shape
        Q = self.query(x_BLD)
        V = _heads(self.value(x_BLD), self.n)  # [B, n, L, d/n]
        table = partition_table(self.n, self.layer, self.layers, L).to(Q.device, Q.dtype)
        c = Q @ self.partition_embeddings.t() if hasattr(self, "partition_embeddings") else None
        r = block_rows(B, self.n, L)
        inputs = (Q, x_BLD, V, c, mask_BL, table)
        blocks = [self._rows(inputs, range(i, min(i + r, L))) for i in range(0, L, r)]
        context = torch.cat([out for out, _ in blocks], dim=1)
        if self.partition_value:  # + A_part V_part (§3.3)
            a_part = torch.cat([part for _, part in blocks], dim=1)  # [B, L, n]
            context = context + a_part @ F.linear(self.partition_embeddings, self.value.weight)
        return context

    def _rows(self, inputs, rows: range):
        if torch.is_grad_enabled():
            return checkpoint(mix_rows, *inputs, rows, self.sigmoid, use_reentrant=False)
        return mix_rows(*inputs, rows, self.sigmoid)

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        z = (self.query(y_BD)[:, None, :] @ x_BLD.transpose(-1, -2)) / math.sqrt(x_BLD.shape[-1])
        return (activate(z, mask_BL, self.sigmoid) @ self.value(x_BLD))[:, 0]


class XLNetAttention(nn.Module):
    """XLNet's relative attention, content stream with every position visible: Score_ij =
    ((q_i + u) . k_j + (q_i + v) . W_R r_{i-j} + (q_i + b) . s_ij) / sqrt(d/n)."""

    def __init__(self, config: ShatterConfig, layer: int):
        super().__init__()
        d, self.n = config.hidden_size, config.num_attention_heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.relative = nn.Linear(d, d, bias=False)  # W_R
        self.content_bias = nn.Parameter(torch.empty(self.n, d // self.n))  # u
        self.position_bias = nn.Parameter(torch.empty(self.n, d // self.n))  # v
        self.segment_embeddings = nn.Parameter(torch.empty(2, self.n, d // self.n))  # s+, s-
        self.segment_bias = nn.Parameter(torch.empty(self.n, d // self.n))  # b
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, x_BLD: torch.Tensor, mask_BL: torch.Tensor, segment_BL: torch.Tensor):
        B, L, _d = x_BLD.shape
        q, k, v = (_heads(f(x_BLD), self.n) for f in (self.query, self.key, self.value))
        t = torch.arange(L - 1, -L, -1, device=x_BLD.device)
        kr = self.relative(sinusoid(t, self.relative.in_features).to(self.relative.weight.dtype))
        kr = _heads(kr[None], self.n)[0]  # W_R r_t for t = L-1 .. -(L-1): [n, 2L-1, d/n]
        pos = torch.arange(L, device=x_BLD.device)
        idx = ((L - 1) - (pos[:, None] - pos[None, :])).expand(B, self.n, L, L)
        content = (q + self.content_bias[:, None]) @ k.transpose(-1, -2)
        position = torch.gather((q + self.position_bias[:, None]) @ kr.transpose(-1, -2), -1, idx)
        seg = (q + self.segment_bias[:, None]) @ self.segment_embeddings.permute(1, 2, 0)
        same = (segment_BL[:, :, None] == segment_BL[:, None, :])[:, None]
        segment = torch.where(same, seg[..., :1], seg[..., 1:])
        scores = (content + position + segment) / math.sqrt(q.shape[-1])
        return _merge(self.dropout(masked_softmax(scores, mask_BL)) @ v)

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        q = _heads(self.query(y_BD)[:, None, :], self.n)
        k, v = _heads(self.key(x_BLD), self.n), _heads(self.value(x_BLD), self.n)
        scores = (q + self.content_bias[:, None]) @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return _merge(self.dropout(masked_softmax(scores, mask_BL)) @ v)[:, 0]


def attention_for(config: ShatterConfig, layer: int) -> nn.Module:
    if config.arch in MULTI_HEAD:
        return MultiHeadAttention(config, layer)
    if config.arch in SINGLE_HEAD:
        return SingleHeadAttention(config, layer)
    return XLNetAttention(config, layer)


# --- the encoder -----------------------------------------------------------------------------


class Embeddings(nn.Module):
    def __init__(self, config: ShatterConfig):
        super().__init__()
        d = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, d)
        if config.arch in ABSOLUTE_POSITIONS:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, d)
        if config.arch == "xlnet":  # the permutation LM's query stream start (unused here)
            self.query_stream = nn.Parameter(torch.empty(d))
        self.layer_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids_BL)
        if hasattr(self, "position_embeddings"):
            table = self.position_embeddings.weight
            if input_ids_BL.shape[1] > table.shape[0]:  # an absolute table has no row for it
                raise ValueError(
                    f"input length {input_ids_BL.shape[1]} exceeds max_position_embeddings "
                    f"{table.shape[0]} of this model: truncate (the tokenizer's truncation=True), "
                    "or extend the toolkit export (shatter-extend --max-len N) and export it again"
                )
            x = x + table[: input_ids_BL.shape[1]]
        return self.dropout(self.layer_norm(x))


class Block(nn.Module):
    """Post-LN block: attention, W^O, residual, LayerNorm, GELU FFN, residual, LayerNorm."""

    def __init__(self, config: ShatterConfig, layer: int):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.attention = attention_for(config, layer)
        self.output = nn.Linear(d, d)
        self.attention_norm = nn.LayerNorm(d, eps=eps)
        self.ffn_in = nn.Linear(d, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, d)
        self.ffn_norm = nn.LayerNorm(d, eps=eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x_BLD, mask_BL, **inputs):
        return self.finish(self.attention(x_BLD, mask_BL, **inputs), x_BLD)

    def pool(self, y_BD, x_BLD, mask_BL):
        return self.finish(self.attention.pool(y_BD, x_BLD, mask_BL), y_BD)

    def finish(self, context, residual):
        h = self.attention_norm(residual + self.dropout(self.output(context)))
        return self.ffn_norm(h + self.dropout(self.ffn_out(F.gelu(self.ffn_in(h)))))


class ShatterPreTrainedModel(PreTrainedModel):
    config_class = ShatterConfig
    base_model_prefix = "encoder"

    def _init_weights(self, module: nn.Module) -> None:
        """BERT's init, as the toolkit's: N(0, initializer_range) for weights, embeddings and
        the position parameters; zero biases; LayerNorm the identity."""
        super()._init_weights(module)
        std = self.config.initializer_range
        for name, param in module.named_parameters(recurse=False):
            if name in ("relative_embeddings", "partition_embeddings", "query_stream", "query"):
                init.normal_(param, mean=0.0, std=std)
            elif name in ("content_bias", "position_bias", "segment_embeddings", "segment_bias"):
                init.normal_(param, mean=0.0, std=std)
            elif name == "bias" and isinstance(module, MaskedLMHead):
                init.zeros_(param)


class ShatterModel(ShatterPreTrainedModel):
    """The encoder: [B, L] ids and 1/0 mask -> last hidden states [B, L, d]."""

    # AutoModel on an export with a head loads the encoder alone; the head's weights are expected
    # (`query`: the §3.4 classifier's y^0)
    _keys_to_ignore_on_load_unexpected = [
        r"^mlm_head\.",
        r"^query$",
        r"^pooler\.",
        r"^classifier\.",
        r"^qa_outputs\.",
    ]

    def __init__(self, config: ShatterConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Block(config, k) for k in range(config.num_hidden_layers))
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def prepare(self, input_ids, attention_mask):
        """(bool key mask, the variant's per-forward inputs): xlnet's segments, the number of
        [SEP] strictly before each position."""
        if attention_mask is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            mask = attention_mask.bool()
            mask = mask | ~mask.any(-1, keepdim=True)  # an all-padding row attends everywhere
        if self.config.arch != "xlnet":
            return mask, {}
        sep = (input_ids == self.config.sep_token_id).long()
        return mask, {"segment_BL": sep.cumsum(-1) - sep}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        mask, inputs = self.prepare(input_ids, attention_mask)
        x = self.embeddings(input_ids)
        hidden = [x] if output_hidden_states else None
        for block in self.layers:
            x = block(x, mask, **inputs)
            if hidden is not None:
                hidden.append(x)
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(hidden) if hidden else None)


class MaskedLMHead(nn.Module):
    def __init__(self, config: ShatterConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # tied to E
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.layer_norm(F.gelu(self.dense(h)))) + self.bias


class ShatterForMaskedLM(ShatterPreTrainedModel):
    _tied_weights_keys = {"mlm_head.decoder.weight": "encoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: ShatterConfig):
        super().__init__(config)
        self.encoder = ShatterModel(config)
        self.mlm_head = MaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.mlm_head.decoder

    def set_output_embeddings(self, value):
        self.mlm_head.decoder = value

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs) -> MaskedLMOutput:
        out = self.encoder(input_ids, attention_mask, kwargs.get("output_hidden_states"))
        logits = self.mlm_head(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


class ShatterForSequenceClassification(ShatterPreTrainedModel):
    """§3.4's modified strategy (`classifier_strategy="modified"`): a learnt y^0 attends over
    each layer's input X^k with that layer's weights, y^{k+1} = F^k(attend(y^k, X^k), y^k), and
    y^L is classified; or BERT's final [CLS] state ("cls"). Then pooler (dense + tanh), dropout
    and a linear classifier. num_labels 1 is regression (MSE)."""

    def __init__(self, config: ShatterConfig):
        super().__init__(config)
        d = config.hidden_size
        self.encoder = ShatterModel(config)
        if config.classifier_strategy == "modified":
            self.query = nn.Parameter(torch.empty(d))  # y^0
        self.pooler = nn.Linear(d, d)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(d, config.num_labels)
        self.post_init()

    def sequence_vector(self, input_ids, attention_mask):
        if self.config.classifier_strategy == "cls":
            return self.encoder(input_ids, attention_mask).last_hidden_state[:, 0]
        mask, inputs = self.encoder.prepare(input_ids, attention_mask)
        x = self.encoder.embeddings(input_ids)  # X^0
        y = self.query.expand(input_ids.shape[0], -1)  # y^0
        last = len(self.encoder.layers) - 1
        for k, block in enumerate(self.encoder.layers):
            y = block.pool(y, x, mask)
            if k < last:  # X^L is never read
                x = block(x, mask, **inputs)
        return y

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        pooled = torch.tanh(self.pooler(self.sequence_vector(input_ids, attention_mask)))
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                loss = F.cross_entropy(logits, labels.long())
        return SequenceClassifierOutput(loss=loss, logits=logits)


class ShatterForQuestionAnswering(ShatterPreTrainedModel):
    """Start/end logits per token (no bias: a constant cancels in the softmax over positions);
    padded positions get the lowest float. The loss is the mean of the two cross-entropies,
    positions outside the sequence ignored."""

    def __init__(self, config: ShatterConfig):
        super().__init__(config)
        self.encoder = ShatterModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2, bias=False)
        self.post_init()

    def forward(
        self, input_ids, attention_mask=None, start_positions=None, end_positions=None, **kwargs
    ):
        logits = self.qa_outputs(self.encoder(input_ids, attention_mask).last_hidden_state)
        if attention_mask is not None:
            logits = logits.masked_fill(
                ~attention_mask.bool()[..., None], torch.finfo(logits.dtype).min
            )
        start, end = logits.unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            L = input_ids.shape[1]

            def ce(scores, positions):
                positions = positions.long().masked_fill((positions < 0) | (positions >= L), -100)
                return F.cross_entropy(scores, positions, ignore_index=-100)

            loss = (ce(start, start_positions) + ce(end, end_positions)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end)
