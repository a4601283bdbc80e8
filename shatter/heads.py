"""Finetuning heads: thin wrappers over a pretrained backbone's encoder (HF BERT's task heads).

- `SequenceClassificationModel(backbone, num_labels, strategy)`:
  - `"modified"` (default): the paper's §3.4 strategy. A learnt vector y^0 attends over each
    layer's hidden states X^k (the input of block k, X^0 being the embeddings) with that layer's
    own attention weights and FFN, y^{k+1} = F^k(attend(y^k, X^k), y^k), and y^L is classified.
    y acts as an extra query token that the tokens never attend to. X^L is not needed, so the
    last block runs on y only, and its position-only parameters (R, W^B) get no gradient.
    The attention is the variant's own `pool` (shatter/attention/): multi-head softmax for the
    BERT archs and Part_Mask, single-head over K = X for the 1h archs, Part_Bias and Shatter
    (L2-normalised sigmoid, or softmax for 1h-softmax, "according to the sequence encoder").
    The learnt query has no position, so no partition mask or partition embeddings apply.
  - `"cls"`: BERT's strategy, the final hidden state at [CLS] (position 0).
  Either way the vector goes through BERT's pooler (dense + tanh), dropout and a linear
  classifier. `num_labels == 1` is regression (MSE against float labels), otherwise
  cross-entropy.
- `SpanExtractionModel(backbone)`: start/end logits over tokens for extractive QA (SQuAD),
  padded positions excluded; loss is the mean of the start and end cross-entropies, positions
  outside the sequence are ignored.

`save_pretrained` writes `head.json` (`head_config()`) beside the weights, and
`from_pretrained` rebuilds the head (shatter/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shatter.model import ShatterForMaskedLM

STRATEGIES = ("modified", "cls")


def _init_linear(layer: nn.Linear, std: float) -> nn.Linear:
    nn.init.normal_(layer.weight, mean=0.0, std=std)
    nn.init.zeros_(layer.bias)
    return layer


class SequenceClassificationModel(nn.Module):
    def __init__(self, backbone: ShatterForMaskedLM, num_labels: int, strategy: str = "modified"):
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
        if num_labels < 1:
            raise ValueError(f"num_labels must be >= 1 (1 = regression), got {num_labels}")
        self.config = backbone.config
        self.encoder = backbone.encoder
        self.num_labels, self.strategy = num_labels, strategy
        d, std = self.config.hidden, self.config.initializer_range
        if strategy == "modified":
            self.query = nn.Parameter(torch.randn(d) * std)  # y^0
        self.pooler = _init_linear(nn.Linear(d, d), std)
        self.dropout = nn.Dropout(self.config.dropout)
        self.classifier = _init_linear(nn.Linear(d, num_labels), std)

    def head_config(self) -> dict[str, Any]:
        return {
            "head": "sequence-classification",
            "num_labels": self.num_labels,
            "strategy": self.strategy,
        }

    def sequence_vector(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """y^L (modified) or the [CLS] state X^L[:, 0] (cls): [B, d]."""
        if self.strategy == "cls":
            return self.encoder(input_ids, attention_mask)[:, 0]
        mask_BL = self.encoder.key_mask(input_ids, attention_mask)
        inputs = self.encoder.attention_inputs(input_ids)  # e.g. xlnet's segments, for X^k
        x = self.encoder.embeddings(input_ids)  # X^0
        y = self.query.expand(input_ids.shape[0], -1)  # y^0
        last = len(self.encoder.layers) - 1
        weights = self.encoder.layer_weights()  # once for every layer
        for k, block in enumerate(self.encoder.layers):
            y = block.pool(y, x, mask_BL)  # y^{k+1} from y^k and X^k
            if k < last:  # X^L itself is never read
                x = block(x, mask_BL, weights[k], **inputs)
        return y

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """-> {"loss", "logits" [B, num_labels]}; labels [B] (long, or float for regression)."""
        pooled = torch.tanh(self.pooler(self.sequence_vector(input_ids, attention_mask)))
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                loss = F.cross_entropy(logits, labels.long())
        return {"loss": loss, "logits": logits}


class SpanExtractionModel(nn.Module):
    def __init__(self, backbone: ShatterForMaskedLM):
        super().__init__()
        self.config = backbone.config
        self.encoder = backbone.encoder
        # no bias: a constant added to every position's logit cancels in the softmax over positions
        self.qa_outputs = nn.Linear(self.config.hidden, 2, bias=False)
        nn.init.normal_(self.qa_outputs.weight, mean=0.0, std=self.config.initializer_range)

    def head_config(self) -> dict[str, Any]:
        return {"head": "span-extraction"}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """-> {"loss", "start_logits" [B, L], "end_logits" [B, L]}; padded positions get the
        lowest float so that they are never predicted."""
        h = self.encoder(input_ids, attention_mask)
        logits = self.qa_outputs(h)
        if attention_mask is not None:
            logits = logits.masked_fill(
                ~attention_mask.bool()[..., None], torch.finfo(logits.dtype).min
            )
        start, end = logits.unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            L = input_ids.shape[1]

            def ce(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                positions = positions.long()
                positions = positions.masked_fill((positions < 0) | (positions >= L), -100)
                return F.cross_entropy(scores, positions, ignore_index=-100)

            loss = (ce(start, start_positions) + ce(end, end_positions)) / 2
        return {"loss": loss, "start_logits": start, "end_logits": end}


def build_head(
    backbone: ShatterForMaskedLM, spec: Mapping[str, Any], source: Path | str = "head.json"
) -> nn.Module:
    """Rebuild a head from its `head_config()` dict (read from `source`, named in errors)."""
    kind = spec.get("head")
    try:
        if kind == "sequence-classification":
            allowed = {"head", "num_labels", "strategy"}
            if set(spec) - allowed:
                raise ValueError(f"unknown keys {sorted(set(spec) - allowed)}")
            return SequenceClassificationModel(
                backbone, int(spec["num_labels"]), spec.get("strategy", "modified")
            )
        if kind == "span-extraction":
            if set(spec) - {"head"}:
                raise ValueError(f"unknown keys {sorted(set(spec) - {'head'})}")
            return SpanExtractionModel(backbone)
        raise ValueError(
            f"unknown head {kind!r}; expected sequence-classification or span-extraction"
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
