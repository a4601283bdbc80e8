"""BERT masked-LM masking as pure, vectorised numpy functions, reproducible anywhere.

The pipeline stores `dupe_factor` static maskings per row (academic-budget-bert style); the trainer
can import the same functions for dynamic masking. The recipe is BERT's (Devlin et al. 2019, §3.1,
"Task #1: Masked LM"): 15% of the non-special tokens are chosen; of those 80% become [MASK], 10% a
random id and 10% stay unchanged. `whole_word=True` chooses whole words (the BERT repository's
"whole word masking"), using the `word_start` flags.

Randomness is counter-based, not a stateful RNG: every draw is splitmix64 (Steele et al. 2014)
of (seed, position) or (seed, word index), so a masking depends only on its seed, never on batch
composition, and a batch of rows is masked in a handful of array operations. The seed of copy `d`
of a row is `row_seeds(global_seed, row_key, d)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)

_U64 = np.uint64
_SALT_SELECT = _U64(0x5E1EC7)
_SALT_ACTION = _U64(0xAC7104)
_SALT_RANDOM = _U64(0x4A4D0)
_TWO53 = float(2**53)


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array: a bijection with full avalanche (wraps mod 2**64)."""
    x = np.array(x, dtype=_U64, copy=True)
    x ^= x >> _U64(30)
    x *= _U64(0xBF58476D1CE4E5B9)
    x ^= x >> _U64(27)
    x *= _U64(0x94D049BB133111EB)
    x ^= x >> _U64(31)
    return x


def row_seeds(global_seed: int, row_keys, dupe_factor: int) -> np.ndarray:
    """Seeds `[B, dupe_factor]` (uint64) from (global seed, row key, copy index)."""
    keys = np.asarray(row_keys, dtype=_U64).reshape(-1, 1)
    copies = np.arange(dupe_factor, dtype=_U64).reshape(1, -1)
    base = mix64(keys ^ mix64(np.array([global_seed], dtype=_U64)))
    return mix64(base + mix64(copies + _U64(1)))


@dataclass(frozen=True)
class MaskedBatch:
    """Flat masking of B rows x D copies: copy (b, d) owns values[offsets[b*D+d]:offsets[b*D+d+1]]."""

    offsets: np.ndarray  # int64 [B*D + 1], into the three flat arrays below
    positions: np.ndarray  # int64, ascending within each copy: indices into the row's input_ids
    labels: np.ndarray  # int64, the original ids at those positions
    inputs: np.ndarray  # int64, what the model sees there: [MASK], a random id, or the original


def mask_batch(
    ids: np.ndarray,
    lengths: np.ndarray,
    word_start: np.ndarray,
    seeds: np.ndarray,
    vocab_size: int,
    rate: float = 0.15,
    whole_word: bool = False,
    special_ids=SPECIAL_IDS,
    mask_id: int = MASK_ID,
) -> MaskedBatch:
    """Mask B padded rows (`ids`, `word_start`: [B, L]; `lengths`: [B]) with seeds [B, D].

    k = max(1, round(rate * n)) of the n non-special tokens are chosen per copy (none if n = 0):
    the k smallest hashes, or whole words in hash order while a word's midpoint stays below k
    (so the expected count is still about k). Random replacements are drawn from the
    non-special ids [len(special_ids), vocab_size).
    """
    ids = np.asarray(ids, dtype=np.int64)
    n_rows, width = ids.shape
    seeds = np.asarray(seeds, dtype=_U64).reshape(n_rows, -1)
    pos = np.arange(width)
    cand = (pos[None, :] < np.asarray(lengths)[:, None]) & ~np.isin(ids, np.asarray(special_ids))
    n_cand = cand.sum(axis=1)
    k = np.where(n_cand > 0, np.maximum(1, np.floor(rate * n_cand + 0.5)), 0).astype(np.int64)

    if whole_word:
        unit = np.cumsum(np.asarray(word_start, dtype=bool) | ~cand, axis=1).astype(_U64)
    else:
        unit = np.broadcast_to(pos.astype(_U64), (n_rows, width))
    score = mix64(seeds[:, :, None] ^ mix64(unit[:, None, :] + _SALT_SELECT))  # [B, D, L]
    if not whole_word:
        # the top 16 bits suffice to rank single tokens, and numpy radix-sorts 16-bit keys (5x faster);
        # a tie (p = 2**-16 per pair) goes to the earlier position, deterministically
        score = (score >> _U64(48)).astype(np.uint16)
    score = np.where(cand[:, None, :], score, np.iinfo(score.dtype).max)
    order = np.argsort(score, axis=2, kind="stable")  # tokens of one word stay together, in order
    cand_sorted = np.take_along_axis(np.broadcast_to(cand[:, None, :], score.shape), order, axis=2)
    if whole_word:
        s_sorted = np.take_along_axis(score, order, axis=2)
        last = np.ones(score.shape, dtype=bool)  # the last token of a word in sorted order
        last[:, :, :-1] = s_sorted[:, :, 1:] != s_sorted[:, :, :-1]
        word_end, word_len = _word_extents(last, np.cumsum(cand_sorted, axis=2))
        first = np.where(last, np.arange(width), width).min(axis=2, keepdims=True)
        midpoint_below_k = (2 * word_end - word_len) < 2 * k[:, None, None]
        chosen_sorted = (midpoint_below_k | (np.arange(width) <= first)) & cand_sorted
    else:
        chosen_sorted = cand_sorted & (np.cumsum(cand_sorted, axis=2) <= k[:, None, None])
    chosen = np.zeros(score.shape, dtype=bool)
    np.put_along_axis(chosen, order, chosen_sorted, axis=2)

    b_idx, d_idx, positions = np.nonzero(chosen)
    draw_seed = seeds[b_idx, d_idx]
    action = (mix64(draw_seed ^ mix64(positions.astype(_U64) + _SALT_ACTION)) >> _U64(11)) / _TWO53
    n_special = len(special_ids)
    rand = mix64(draw_seed ^ mix64(positions.astype(_U64) + _SALT_RANDOM)) % _U64(vocab_size - n_special)
    labels = ids[b_idx, positions]
    inputs = np.where(action < 0.8, mask_id, np.where(action < 0.9, rand.astype(np.int64) + n_special, labels))
    counts = chosen.sum(axis=2).reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return MaskedBatch(offsets, positions.astype(np.int64), labels, inputs.astype(np.int64))


def _word_extents(last: np.ndarray, cum: np.ndarray):
    """Per sorted token: the cumulative candidate count at its word's end, and its word's length."""
    width = cum.shape[-1]
    end = np.flip(np.minimum.accumulate(np.flip(np.where(last, cum, width + 1), -1), axis=-1), -1)
    prev = np.concatenate([np.zeros(cum.shape[:-1] + (1,), cum.dtype), np.where(last, cum, 0)[..., :-1]], -1)
    return end, end - np.maximum.accumulate(prev, axis=-1)


def mask_row(
    ids,
    word_start,
    rng_seed: int,
    vocab_size: int,
    rate: float = 0.15,
    whole_word: bool = False,
    special_ids=SPECIAL_IDS,
    mask_id: int = MASK_ID,
):
    """One masking of one row: (positions, labels, inputs) int64 arrays. For dynamic masking."""
    ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
    out = mask_batch(
        ids, np.array([ids.shape[1]]), np.asarray(word_start, dtype=bool).reshape(1, -1),
        np.array([[rng_seed]], dtype=_U64), vocab_size, rate, whole_word, special_ids, mask_id,
    )
    return out.positions, out.labels, out.inputs
