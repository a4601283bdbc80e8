"""XLNet's two-stream pass (Yang et al. 2019, §2.3) through the encoder's own blocks.

The content stream starts from the word embeddings, h^0 = X^0; the query stream from one
trainable vector, g^0_i = w at every position (XLNet's mask_emb; `Embeddings.query_stream`).
In every block both streams go through the variant's `two_stream` attention (the factorisation
order masks and the relative segment encoding, shatter/attention/xlnet.py; both streams get
the same `Encoder.attention_inputs`) and then the block's own `finish` (W^O, residual,
LayerNorm, FFN), so the blocks stay free of per-arch branches. Predictions come from g^L; only
the content stream (`Encoder.forward`) exists at finetuning and evaluation.

`rank_BL` is the position of each token in the factorisation order z: the content stream at i
sees every j with rank_j <= rank_i, the query stream every j with rank_j < rank_i. With partial
prediction (train/plm.py) the non-targets share the lowest rank and see each other, the targets
come last in a random order.
"""

from __future__ import annotations

import torch
from torch import nn


def two_stream_encode(
    encoder: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    rank_BL: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h^L, g^L), each [B, L, d]: the content and the query stream after the last block."""
    if not hasattr(encoder.layers[0].attention, "two_stream"):
        raise ValueError(
            f"arch {encoder.config.arch!r} has no two-stream attention: the permutation LM "
            "(objective plm) needs arch xlnet; use objective mlm"
        )
    if rank_BL.shape != input_ids.shape:
        raise ValueError(
            f"perm_rank shape {tuple(rank_BL.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    mask_BL = encoder.key_mask(input_ids, attention_mask)
    inputs = encoder.attention_inputs(input_ids)  # segment_BL, shared by both streams
    h = encoder.embeddings(input_ids)
    g = encoder.embeddings.dropout(encoder.embeddings.query_stream.expand_as(h))
    for block in encoder.layers:
        content, query = block.attention.two_stream(h, g, mask_BL, rank_BL, **inputs)
        h, g = block.finish(content, h), block.finish(query, g)
    return h, g
