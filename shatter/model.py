"""The encoder and the masked-LM model, built from parts: Embeddings -> Block -> Encoder -> MLM.

- Embeddings: word embeddings, plus learnt absolute position embeddings when the arch asks for
  them (eq. 4: x^0_i = LayerNorm(E(w_i) + P[i])), then dropout.
- Block: post-LN BERT block. The attention variant (from the registry, shatter/attention/) gives
  the context; the block applies W^O, dropout, residual, LayerNorm, a GELU FFN (shatter/ffn.py:
  on a GPU, GELU in its GEMMs' epilogues), residual, LayerNorm. It never branches on the variant: the per-forward inputs a variant declares
  (`segments = True`: segment_BL from the [SEP]s, xlnet) are computed once by the encoder
  (`Encoder.attention_inputs`) and passed through the blocks as keyword arguments, unread; the
  weights a variant derives from its parameters (the single-head archs' projection and folded
  W^O) are made once per forward for every layer (`Encoder.layer_weights`,
  shatter/attention/layer_weights.py) and handed to each block.
- ShatterForMaskedLM: the MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings)
  decodes only the predicted positions (cramming).

References: Devlin et al. 2019 (BERT, HF `modeling_bert.py`), nanoGPT `model.py`, cramming.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shatter.attention import ATTENTIONS
from shatter.attention.layer_weights import LayerWeights, layer_weights
from shatter.config import ModelConfig, preset_config
from shatter.ffn import feed_forward
from shatter.partition import exact_partitions
from shatter.xlnet import two_stream_encode

IGNORE_INDEX = -100


def segment_ids(input_ids_BL: torch.Tensor, sep_id: int) -> torch.Tensor:
    """[B, L] segment index: the number of [SEP] strictly before each position, so
    `[CLS] a [SEP]` is segment 0 and `b [SEP]` segment 1 (on the ids' device, no host sync)."""
    sep = (input_ids_BL == sep_id).long()
    return sep.cumsum(-1) - sep


class EncoderOutput(NamedTuple):
    last_hidden_state: torch.Tensor  # X^L: [B, L, d]
    hidden_states: tuple[torch.Tensor, ...]  # X^0 (embeddings) .. X^L: L + 1 tensors [B, L, d]


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)  # E
        if ATTENTIONS[config.arch].absolute_positions:
            self.position_embeddings = nn.Embedding(config.max_len, config.hidden)  # P (eq. 4)
        else:
            self.position_embeddings = None
        if hasattr(ATTENTIONS[config.arch], "two_stream"):
            # w, the query stream's start at every position (XLNet's mask_emb, shatter/xlnet.py)
            std = config.initializer_range
            self.query_stream = nn.Parameter(torch.randn(config.hidden) * std)
        self.layer_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids_BL)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings.weight[: input_ids_BL.shape[1]]
        return self.dropout(self.layer_norm(x))


class Block(nn.Module):
    """Post-LN Transformer block around one attention variant."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d = config.hidden
        self.attention = ATTENTIONS[config.arch](config, layer)
        self.output = nn.Linear(d, d)  # W^O
        self.attention_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(d, config.ffn)
        self.ffn_out = nn.Linear(config.ffn, d)
        self.ffn_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.ffn_impl = config.ffn_impl  # shatter/ffn.py
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x_BLD: torch.Tensor,
        mask_BL: torch.Tensor,
        weights: LayerWeights | None = None,
        **inputs,
    ) -> torch.Tensor:
        """`weights`: this layer's LayerWeights from Encoder.layer_weights (made here for this
        layer alone when not given); `inputs`: the variant's own per-forward inputs
        (Encoder.attention_inputs), passed on."""
        weights = weights if weights is not None else layer_weights([self])[0]
        context = self.attention(x_BLD, mask_BL, **weights.attention, **inputs)
        return self.finish(context, x_BLD, weights.output, weights.output_bias)

    def pool(self, y_BD: torch.Tensor, x_BLD: torch.Tensor, mask_BL: torch.Tensor) -> torch.Tensor:
        """y^{k+1} from y^k attending over this layer's input X^k with its own weights (§3.4)."""
        return self.finish(self.attention.pool(y_BD, x_BLD, mask_BL), y_BD)

    def finish(
        self,
        context: torch.Tensor,
        residual: torch.Tensor,
        output_weight: torch.Tensor | None = None,
        output_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F^k(X_bar, X): W^O, dropout, residual, LayerNorm, GELU FFN, residual, LayerNorm.
        `output_weight`, `output_bias`: the W^O and bias for this context (LayerWeights.output
        and .output_bias; W^O and b^O themselves when no weight is given)."""
        if output_weight is None:
            output_weight, output_bias = self.output.weight, self.output.bias
        h = F.linear(context, output_weight, output_bias)
        h = self.attention_norm(residual + self.dropout(h))
        ffn = feed_forward(h, self.ffn_in, self.ffn_out, self.ffn_impl)
        return self.ffn_norm(h + self.dropout(ffn))


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Block(config, k) for k in range(config.layers))
        self.segments = getattr(ATTENTIONS[config.arch], "segments", False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ):
        """[B, L] ids (and 1/0 mask) -> X^L [B, L, d]; with output_hidden_states an EncoderOutput."""
        mask_BL = self.key_mask(input_ids, attention_mask)
        inputs = self.attention_inputs(input_ids)
        x = self.embeddings(input_ids)
        # tables a cast rounded, made exact here at once: under torch.compile that is one graph
        # break before the loop, where one inside it would leave the loop to eager Python
        exact_partitions([block.attention for block in self.layers])
        hidden = (
            [x] if output_hidden_states else None
        )  # else each X^k is freed once used (inference)
        for block, weights in zip(self.layers, self.layer_weights(), strict=True):
            x = block(x, mask_BL, weights, **inputs)
            if hidden is not None:
                hidden.append(x)
        return EncoderOutput(x, tuple(hidden)) if hidden is not None else x

    def layer_weights(self) -> list[LayerWeights | None]:
        """Every block's LayerWeights, made once per forward in batched ops (layer_weights.py);
        under ZeRO-3 (partitioned parameters: `ds_id`) each block makes its own inside its
        forward, where ZeRO-3 has gathered them (train/engine.py: blocks are ZeRO-3 leaves)."""
        if hasattr(next(self.layers.parameters()), "ds_id"):  # ZeRO-3 partitions all or none
            return [None] * len(self.layers)
        return layer_weights(list(self.layers))

    def attention_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-forward inputs the attention variant declares, as keyword arguments of its
        forward and two_stream: `segment_BL` (segment_ids from config.sep_id) when it sets
        `segments = True` (xlnet), else none."""
        if not self.segments:
            return {}
        return {"segment_BL": segment_ids(input_ids, self.config.sep_id)}

    def key_mask(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Validate the inputs and return the bool key mask (True = real token); None for no
        attention_mask when the variant declares `optional_mask` (no padding)."""
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] > self.config.max_len:
            raise ValueError(
                f"input length {input_ids.shape[1]} exceeds max_len {self.config.max_len} of this "
                f"{self.config.arch} model; extend it first (shatter-extend --max-len N)"
            )
        if attention_mask is None:  # no padding: None where the variant takes it (SDPA's flash)
            if getattr(ATTENTIONS[self.config.arch], "optional_mask", False):
                return None
            return torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        mask = attention_mask.bool()
        # a free check on the host (left to eager runs: a compiled graph would break on it);
        # on a GPU it would sync
        if mask.device.type == "cpu" and not torch.compiler.is_compiling():
            if not bool(mask.any(-1).all()):
                raise ValueError(
                    "every sequence needs at least one real token (attention_mask row of zeros)"
                )
            return mask
        # sync-free on an accelerator: a row of zeros attends to every position (finite output,
        # as an unmasked row) instead of dividing by an empty softmax
        return mask | ~mask.any(-1, keepdim=True)


class MaskedLMHead(nn.Module):
    """Dense, GELU, LayerNorm, then the decoder tied to the word embeddings (plus a bias)."""

    def __init__(self, config: ModelConfig, word_embeddings: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.layer_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.word_embeddings = word_embeddings  # tied: the same module, not a copy
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(
            self.layer_norm(F.gelu(self.dense(h))), self.word_embeddings.weight, self.bias
        )


class ShatterForMaskedLM(nn.Module):
    """The masked-LM model that `build_model` returns (any arch; the name is the project's)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.mlm_head = MaskedLMHead(config, self.encoder.embeddings.word_embeddings)
        self.init_weights()

    def init_weights(self) -> None:
        """BERT's init: N(0, initializer_range) for weights, embeddings and the position tables
        R and W^B; zero biases; LayerNorm to the identity."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            for name in ("relative_embeddings", "partition_embeddings"):
                if isinstance(getattr(m, name, None), nn.Parameter):
                    nn.init.normal_(getattr(m, name), mean=0.0, std=std)
        nn.init.zeros_(self.mlm_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        perm_rank: torch.Tensor | None = None,
        predicted: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """With labels ([B, L], -100 where not predicted): logits [M, V] at the M predicted
        positions and loss = their mean cross-entropy. Without: logits [B, L, V], loss None.
        With perm_rank ([B, L], the factorisation order; xlnet): the permutation LM, decoded
        from the query stream (shatter/xlnet.py). `predicted`: those M positions, made from the
        labels where they are on the host (`predicted_positions`), as the trainer's batches
        carry them: without, the model finds them itself on the labels' device, and on a GPU
        that waits for the GPU (a host sync in the forward, a graph break under torch.compile)."""
        if perm_rank is None:
            h = self.encoder(input_ids, attention_mask)
        else:
            h = two_stream_encode(self.encoder, input_ids, attention_mask, perm_rank)[1]
        if labels is None:
            return {"loss": None, "logits": self.mlm_head(h)}
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        if predicted is None:
            predicted = predicted_positions(labels)
        # [M, V]: only the predicted positions decoded, in the order labels[labels != -100] has
        logits = self.mlm_head(h.flatten(0, 1).index_select(0, predicted))
        target = labels.reshape(-1).index_select(0, predicted)
        loss = F.cross_entropy(logits, target) if target.numel() else logits.sum() * 0.0
        return {"loss": loss, "logits": logits}


def predicted_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions of `labels` [B, L] that are predicted (not -100), flat (row × L + column),
    in row-major order: [M] int64. On a GPU tensor this waits for the GPU (M is its count);
    made from the host's labels, as the trainer's loader makes it, it costs the GPU nothing."""
    return (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def build_model(preset: str, **overrides) -> ShatterForMaskedLM:
    """`build_model("shatter-base", max_len=1024)`: a freshly initialised masked-LM model."""
    return ShatterForMaskedLM(preset_config(preset, **overrides))


def count_parameters(model: nn.Module, exclude_word_embeddings: bool = True) -> int:
    """Number of parameters (tied weights counted once), by default without the word
    embeddings E, as Table 2 counts them."""
    params = {id(p): p for p in model.parameters()}
    if exclude_word_embeddings:
        for m in model.modules():
            if isinstance(m, Embeddings):
                params.pop(id(m.word_embeddings.weight), None)
    return sum(p.numel() for p in params.values())
