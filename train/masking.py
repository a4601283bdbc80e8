"""Masked-LM masking of padded batches, vectorised over the whole batch.

Dynamic masking is RoBERTa's per-epoch re-masking (Liu et al. 2019, §4.1) with BERT's recipe
(Devlin et al. 2019, §3.1: 15% of the non-special tokens, 80% [MASK] / 10% random / 10% kept,
optionally whole words): the pipeline's own pure function `shatter.pipeline.masking.mask_batch`, the one
that wrote the static masks, seeded per sample and epoch (splitmix64). Its draws are
counter-based hashes (MurmurHash3's 32-bit finaliser) of the seed and the position, so a
sample's mask depends on (seed, epoch, sample id) only, whatever the ranks, workers, batch
composition or resume point, and the loader keeps no RNG state.

Static masking scatters one of the shards' stored maskings (`mask_positions` / `mask_inputs` /
`mask_labels`) into the batch.
"""

from __future__ import annotations

import numpy as np

from shatter.pipeline.masking import mask_batch, mix64, row_seeds
from shatter.shards.tokenizer import (  # noqa: F401  (the trainer's special ids, from here)
    CLS_ID as CLS,
    MASK_ID as MASK,
    PAD_ID as PAD,
    SEP_ID as SEP,
)

IGNORE = -100  # label at positions that are not predicted (torch's cross-entropy ignore_index)


def dynamic_seeds(seed: int, epoch: int, uid_B: np.ndarray) -> np.ndarray:
    """Seeds [B, 1] of sample ids `uid_B` in `epoch`: one fresh masking per sample and epoch."""
    epoch_seed = int(mix64(np.array([seed, epoch], dtype=np.uint64)).sum(dtype=np.uint64))
    return row_seeds(epoch_seed, uid_B, 1)


def dynamic_mask(
    ids_BL: np.ndarray,
    lengths_B: np.ndarray,
    word_start_BL: np.ndarray,
    uid_B: np.ndarray,
    *,
    epoch: int,
    seed: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    whole_word: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) int64 [B, L] for padded ids; labels are IGNORE where not predicted."""
    ids_BL = ids_BL.astype(np.int64, copy=False)
    masks = mask_batch(
        ids_BL,
        lengths_B,
        word_start_BL,
        dynamic_seeds(seed, epoch, uid_B),
        vocab_size,
        rate=mask_prob,
        whole_word=whole_word,
    )
    row = np.repeat(np.arange(len(ids_BL)), np.diff(masks.offsets))
    inputs = ids_BL.copy()
    labels = np.full(ids_BL.shape, IGNORE, dtype=np.int64)
    inputs[row, masks.positions] = masks.inputs
    labels[row, masks.positions] = masks.labels
    return inputs, labels


def ragged_gather(offsets: np.ndarray, lists: np.ndarray, width: int | None = None):
    """Indices into a flat array of the lists `lists` (offsets[i]:offsets[i+1]), padded to the
    longest: (index [n, W] with 0 at padding, valid [n, W] bool)."""
    start = offsets[lists]
    length = offsets[lists + 1] - start
    W = int(length.max(initial=0)) if width is None else width
    col = np.arange(W)
    valid = col[None, :] < length[:, None]
    return np.where(valid, start[:, None] + col[None, :], 0), valid


def static_mask(
    ids_BL: np.ndarray,
    lengths_B: np.ndarray,
    shard,
    rows_B: np.ndarray,
    copy: int,
    shift_B: np.ndarray | None = None,
):
    """(input_ids, labels) int64 [B, L] from the stored masking number `copy` of each row.
    Positions beyond a truncated row's last kept token are dropped; a piece of a cut row
    (`shift_B`: stored position - piece position) keeps the stored positions of its own tokens."""
    ids_BL = ids_BL.astype(np.int64, copy=False)
    B, L = ids_BL.shape
    lists = shard.masks_outer[rows_B] + copy
    idx, valid = ragged_gather(shard.masks_inner, lists)
    pos = shard.mask_pos[idx].astype(np.int64)
    if shift_B is not None:
        pos = pos - shift_B[:, None]
        valid &= pos >= 1  # before the piece: another piece's token (or its [CLS])
    valid &= pos < (lengths_B[:, None] - 1)  # [SEP] sits at length - 1 after truncation
    row = np.broadcast_to(np.arange(B)[:, None], pos.shape)
    inputs = ids_BL.copy()
    labels = np.full((B, L), IGNORE, dtype=np.int64)
    r, p = row[valid], pos[valid]
    inputs[r, p] = shard.mask_inp[idx][valid]
    labels[r, p] = shard.mask_lab[idx][valid]
    return inputs, labels
