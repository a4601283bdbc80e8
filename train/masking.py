"""Masked-LM masking of padded batches, vectorised over the whole batch.

Dynamic masking follows BERT (Devlin et al. 2019, §3.1 and appendix A.1) and RoBERTa's per-epoch
re-masking (Liu et al. 2019, §4.1): of the maskable tokens (not [CLS], [SEP], [PAD]) a share
`mask_prob` is predicted, k = max(1, round(mask_prob · n)) per row, and of those 80% become
[MASK], 10% a random id and 10% stay unchanged. The whole-word option (BERT's later release)
picks whole words until k tokens are reached.

Every random number is a counter-based hash (splitmix64, Steele et al. 2014) of
(seed, epoch, sample id, position): a sample's mask depends on nothing else, so it is the same
whatever the ranks, workers, batch composition or resume point, and the loader needs no RNG
state in its checkpoint. Static masking scatters one of the shards' stored maskings into the
batch (the pipeline's `mask_positions` / `mask_inputs` / `mask_labels` columns).
"""
from __future__ import annotations

import numpy as np

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4  # DESIGN.md "Special token ids"
N_SPECIAL = 5
IGNORE = -100  # label at positions that are not predicted (torch's cross-entropy ignore_index)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective, well-mixed hash of uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def sample_keys(seed: int, epoch: int, uid: np.ndarray) -> np.ndarray:
    """One uint64 key per sample from (seed, epoch, sample id)."""
    base = mix64(mix64(np.uint64(seed)) ^ np.uint64(epoch))
    with np.errstate(over="ignore"):
        spread = np.asarray(uid, dtype=np.uint64) * _GOLDEN
    return mix64(base ^ mix64(spread))


def position_hash(keys_B: np.ndarray, length: int, stream: int) -> np.ndarray:
    """uint64 [B, L] hashes of (sample key, position, stream)."""
    with np.errstate(over="ignore"):
        pos_L = (np.arange(length, dtype=np.uint64) * np.uint64(4) + np.uint64(stream)) * _GOLDEN
    return mix64(keys_B[:, None] ^ mix64(pos_L)[None, :])


def to_unit(h: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from uint64 hashes (their top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _select_tokens(key_BL: np.ndarray, cand_BL: np.ndarray, k_B: np.ndarray) -> np.ndarray:
    """The k lowest-keyed candidates of each row."""
    key = np.where(cand_BL, key_BL, np.uint64(np.iinfo(np.uint64).max))
    kth = np.sort(key, axis=1)[np.arange(len(k_B)), np.maximum(k_B - 1, 0)]
    return cand_BL & (key <= kth[:, None]) & (k_B[:, None] > 0)


def _select_words(key_BL: np.ndarray, cand_BL: np.ndarray, word_start_BL: np.ndarray, k_B: np.ndarray) -> np.ndarray:
    """Whole words in the order of their first token's key, while the running count stays <= k
    (the first word is always taken, so every row with a candidate predicts something)."""
    B, L = key_BL.shape
    col = np.arange(L)
    prev_cand = np.concatenate([np.zeros((B, 1), bool), cand_BL[:, :-1]], axis=1)
    starts = cand_BL & (word_start_BL | ~prev_cand)
    start_idx = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    maxkey = np.uint64(np.iinfo(np.uint64).max)
    wkey = np.where(cand_BL, np.take_along_axis(key_BL, start_idx, axis=1), maxkey)
    order = np.argsort(wkey, axis=1, kind="stable")  # words contiguous, tokens in position order
    wkey_s = np.take_along_axis(wkey, order, axis=1)
    cand_s = np.take_along_axis(cand_BL, order, axis=1)
    count_s = np.cumsum(cand_s, axis=1)
    is_last = np.concatenate([wkey_s[:, 1:] != wkey_s[:, :-1], np.ones((B, 1), bool)], axis=1)
    end_count = np.where(is_last, count_s, np.iinfo(np.int64).max)
    end_count = np.minimum.accumulate(end_count[:, ::-1], axis=1)[:, ::-1]  # count at the word's last token
    take_s = cand_s & ((end_count <= k_B[:, None]) | (wkey_s == wkey_s[:, :1]))
    selected = np.zeros_like(cand_BL)
    np.put_along_axis(selected, order, take_s, axis=1)
    return selected


def dynamic_mask(
    ids_BL: np.ndarray,
    word_start_BL: np.ndarray,
    uid_B: np.ndarray,
    *,
    epoch: int,
    seed: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    mask_token_prob: float = 0.8,
    random_token_prob: float = 0.1,
    whole_word: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) int64 [B, L] for padded ids (PAD = 0); labels are IGNORE where not predicted."""
    ids_BL = ids_BL.astype(np.int64, copy=False)
    B, L = ids_BL.shape
    cand = ids_BL >= N_SPECIAL
    k_B = np.minimum(np.maximum(np.rint(mask_prob * cand.sum(1)).astype(np.int64), 1), cand.sum(1))
    keys = sample_keys(seed, epoch, uid_B)
    order_key = position_hash(keys, L, 0)
    if whole_word:
        selected = _select_words(order_key, cand, word_start_BL, k_B)
    else:
        selected = _select_tokens(order_key, cand, k_B)
    u = to_unit(position_hash(keys, L, 1))
    replace_mask = selected & (u < mask_token_prob)
    replace_random = selected & (u >= mask_token_prob) & (u < mask_token_prob + random_token_prob)
    random_ids = N_SPECIAL + (position_hash(keys, L, 2) % np.uint64(vocab_size - N_SPECIAL)).astype(np.int64)
    inputs = np.where(replace_mask, MASK, np.where(replace_random, random_ids, ids_BL))
    labels = np.where(selected, ids_BL, IGNORE)
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


def static_mask(ids_BL: np.ndarray, lengths_B: np.ndarray, shard, rows_B: np.ndarray, copy: int):
    """(input_ids, labels) int64 [B, L] from the stored masking number `copy` of each row.
    Positions beyond a truncated row's last kept token are dropped."""
    ids_BL = ids_BL.astype(np.int64, copy=False)
    B, L = ids_BL.shape
    lists = shard.masks_outer[rows_B] + copy
    idx, valid = ragged_gather(shard.masks_inner, lists)
    pos = shard.mask_pos[idx].astype(np.int64)
    valid &= pos < (lengths_B[:, None] - 1)  # [SEP] sits at length - 1 after truncation
    row = np.broadcast_to(np.arange(B)[:, None], pos.shape)
    inputs = ids_BL.copy()
    labels = np.full((B, L), IGNORE, dtype=np.int64)
    r, p = row[valid], pos[valid]
    inputs[r, p] = shard.mask_inp[idx][valid]
    labels[r, p] = shard.mask_lab[idx][valid]
    return inputs, labels
