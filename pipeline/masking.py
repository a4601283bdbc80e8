"""BERT masked-LM masking as pure, vectorised numpy functions, reproducible anywhere.

The pipeline stores `dupe_factor` static maskings per row (academic-budget-bert style); the trainer
can import the same functions for dynamic masking. The recipe is BERT's (Devlin et al. 2019, §3.1,
"Task #1: Masked LM"): 15% of the non-special tokens are chosen; of those 80% become [MASK], 10% a
random id and 10% stay unchanged. `whole_word=True` chooses whole words (the BERT repository's
"whole word masking"), using the `word_start` flags.

Randomness is counter-based, not a stateful RNG: every draw is a hash of (seed, position) or
(seed, word index), so a masking depends only on its seed, never on batch composition, and a
batch of rows is masked in a handful of array operations. The seed of copy `d` of a row is
`row_seeds(global_seed, row_key, d)` (splitmix64, Steele et al. 2014); the per-token draws use
MurmurHash3's 32-bit finaliser, which halves the memory traffic of the [B, D, L] arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shatter.shards.tokenizer import (  # noqa: F401  (the masking's special ids, used from here)
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    UNK_ID,
)

_U64, _U32 = np.uint64, np.uint32
_GOLDEN = _U32(0x9E3779B9)  # 2**32 / golden ratio: spreads consecutive counters before hashing
_SALT_SELECT, _SALT_ACTION, _SALT_RANDOM = _U32(0x5E1EC7), _U32(0xAC7104), _U32(0x4A4D0)
_P80, _P90 = (
    _U32(int(0.8 * 2**32)),
    _U32(int(0.9 * 2**32)),
)  # the 80% / 10% / 10% split of the draws
_POS_MASK = 0xFFFF  # positions are uint16 (the shard format), the low 16 bits of a sort key
_NOT_CANDIDATE = _U64(2**64 - 1)
_BLOCK_ELEMENTS = 1 << 17  # keys per block of rows in mask_batch (512 KiB of uint32)


# xorshift-multiply finalisers (shift, multiplier, shift, multiplier, shift): bijections with full avalanche
_SPLITMIX64 = (
    30,
    0xBF58476D1CE4E5B9,
    27,
    0x94D049BB133111EB,
    31,
)  # splitmix64 (Steele et al. 2014)
_FMIX32 = (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)  # MurmurHash3's 32-bit finaliser (Appleby 2011)


def _finalise(x: np.ndarray, constants) -> np.ndarray:
    """Apply a xorshift-multiply finaliser in place (wraps modulo 2**bits of x's dtype)."""
    s1, m1, s2, m2, s3 = (x.dtype.type(c) for c in constants)
    x ^= x >> s1
    x *= m1
    x ^= x >> s2
    x *= m2
    x ^= x >> s3
    return x


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser on a copy of `x` as uint64."""
    return _finalise(np.array(x, dtype=_U64, copy=True), _SPLITMIX64)


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
    positions: np.ndarray  # int32, ascending within each copy: indices into the row's input_ids
    labels: np.ndarray  # int32, the original ids at those positions
    inputs: np.ndarray  # int32, what the model sees there: [MASK], a random id, or the original


def fmix32(x) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser on a copy of `x` as uint32."""
    return _finalise(np.array(x, dtype=_U32, copy=True), _FMIX32)


def _unit_hash(unit, salt) -> np.ndarray:
    """A 32-bit hash per position (or word) index: the counter of the counter-based draws."""
    return fmix32(np.asarray(unit, dtype=_U32) * _GOLDEN + salt)


def _candidates(ids: np.ndarray, lengths, special_ids) -> np.ndarray:
    special = np.asarray(special_ids)
    in_row = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    if np.array_equal(special, np.arange(len(special))):  # the format's ids 0..4: one comparison
        return in_row & (ids >= len(special))
    return in_row & ~np.isin(ids, special)


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

    Each candidate gets the sort key (hash << 16) | position, where hash is a hash of
    (seed, position), or of (seed, word index) for whole words. One sort per copy then ranks the
    tokens, keeps a word's tokens together and in order, breaks ties by position, and carries
    the positions along, so no argsort, gather or scatter over [B, D, L] is needed. Keys do
    not depend on the padded width: a row masks the same alone or in any batch.
    """
    ids = np.asarray(ids)
    if ids.dtype != np.int32:  # ids are vocabulary ids: int32 halves the traffic of int64
        ids = ids.astype(np.int32)
    n_rows, width = ids.shape
    if width > _POS_MASK:  # the all-ones key marks non-candidates
        raise ValueError(
            f"rows of {width} ids: masking positions are uint16 (rows of at most {_POS_MASK})"
        )
    if not 0 < rate <= 1:  # k <= n: the chosen keys are candidates' keys
        raise ValueError(f"masking rate {rate} must be in (0, 1]")
    seeds = np.asarray(seeds, dtype=_U64)
    seeds = seeds[:, None] if seeds.ndim == 1 else seeds  # [B] means one copy per row
    n_copies = seeds.shape[1]
    seed32 = (seeds ^ (seeds >> _U64(32))).astype(_U32)  # [B, D]
    cand = _candidates(ids, lengths, special_ids)
    n_cand = cand.sum(axis=1)
    k = np.where(n_cand > 0, np.maximum(1, np.floor(rate * n_cand + 0.5)), 0).astype(np.int64)
    if whole_word:  # the word index of each position, hashed per copy below
        unit = np.cumsum(np.asarray(word_start, dtype=bool) | ~cand, axis=1)
        hashes = _unit_hash(unit, _SALT_SELECT)[:, None, :]  # [B, 1, L]
    else:
        hashes = _unit_hash(np.arange(width), _SALT_SELECT)[None, None, :]  # [1, 1, L]
    # blocks of rows whose [rows, D, L] temporaries stay in cache (whole batches are 2x slower)
    step = max(1, _BLOCK_ELEMENTS // max(1, n_copies * width))
    counts, positions = np.zeros((n_rows, n_copies), dtype=np.int64), []
    for lo in range(0, n_rows, step):
        rows = slice(lo, lo + step)
        counts[rows], chosen = _choose(
            seed32[rows],
            hashes[rows] if whole_word else hashes,
            cand[rows],
            n_cand[rows],
            k[rows],
            whole_word,
        )
        positions.append(chosen)
    positions = np.concatenate(positions) if positions else np.zeros(0, np.int32)
    per_copy = counts.reshape(-1)
    flat = np.repeat(np.arange(n_rows, dtype=np.intp) * width, counts.sum(axis=1))
    flat += positions

    draw_seed = np.repeat(seed32.reshape(-1), per_copy)
    pos = np.arange(width)
    action = _finalise(draw_seed ^ _unit_hash(pos, _SALT_ACTION)[positions], _FMIX32)
    n_special = len(special_ids)
    rand = _finalise(draw_seed ^ _unit_hash(pos, _SALT_RANDOM)[positions], _FMIX32)
    rand %= _U32(vocab_size - n_special)
    labels = ids.reshape(-1)[flat]  # a flat take: 2x faster than ids[b, p]
    inputs = rand.view(np.int32)
    inputs += n_special
    np.copyto(inputs, labels, where=action >= _P90)
    inputs[action < _P80] = mask_id
    offsets = np.zeros(len(per_copy) + 1, dtype=np.int64)
    np.cumsum(per_copy, out=offsets[1:])
    return MaskedBatch(offsets, positions, labels, inputs)


def _choose(seed32, hashes, cand, n_cand, k, whole_word: bool):
    """The chosen positions of a block of rows: (counts [b, D], positions ascending per copy).

    Each candidate gets the sort key (hash << 16) | position (`mask_batch`); the first counts[b, d]
    keys of a sorted copy are its choice."""
    width = cand.shape[1]
    key = seed32[:, :, None] ^ hashes  # [b, D, L]
    _finalise(key, _FMIX32)
    if whole_word:  # 64-bit keys: the full 32-bit word hash, so distinct words never merge
        key = key.astype(_U64)
        key <<= _U64(16)
        key |= np.where(cand, np.arange(width, dtype=_U64), _NOT_CANDIDATE)[:, None, :]
    else:  # 32-bit keys: the hash's top 16 bits rank single tokens; a tie (p = 2**-16) goes to the earlier one
        key &= _U32(0xFFFF0000)
        key |= np.where(cand, np.arange(width, dtype=_U32), _U32(0xFFFFFFFF))[:, None, :]
    key.sort(axis=2)  # non-candidates (keys of all ones) sort last

    if whole_word:
        # candidates sort first, a word's tokens together: words end where the word hash changes
        word = key >> _U64(16)
        idx = np.arange(width, dtype=np.int32)
        end = np.ones(key.shape, dtype=bool)
        end[:, :, :-1] = word[:, :, 1:] != word[:, :, :-1]
        end &= idx < n_cand[:, None, None]
        # a word ending at sorted index j covers candidates (prev_end, j]: midpoint j + 1 - len / 2
        end_idx = np.where(end, idx, np.int32(-1))
        prev_end = np.maximum.accumulate(end_idx, axis=2)
        prev_end[:, :, 1:] = prev_end[:, :, :-1].copy()
        prev_end[:, :, 0] = -1
        midpoint_below_k = end & (2 * (idx + 1) - (idx - prev_end) < 2 * k[:, None, None])
        # midpoints grow in sorted order, so the chosen words are a prefix; the first is always taken
        first_end = np.argmax(end, axis=2) + 1
        counts = np.maximum(np.where(midpoint_below_k, idx + 1, 0).max(axis=2), first_end)
        counts = np.where(n_cand[:, None] > 0, counts, 0)
    else:
        counts = np.broadcast_to(k[:, None], key.shape[:2])
    # the chosen keys are the first counts[b, d] of each copy; their positions, ascending
    top = int(counts.max(initial=0))
    valid = np.arange(top)[None, None, :] < counts[:, :, None]
    chosen = (key[:, :, :top] & key.dtype.type(_POS_MASK)).astype(np.int32)
    chosen[~valid] = width
    chosen.sort(axis=2)
    return counts, chosen[valid]


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
    """One masking of one row: (positions, labels, inputs) int32 arrays, as `mask_batch` masks it in any batch."""
    ids = np.asarray(ids).reshape(1, -1)
    out = mask_batch(
        ids,
        np.array([ids.shape[1]]),
        np.asarray(word_start, dtype=bool).reshape(1, -1),
        np.array([[rng_seed]], dtype=_U64),
        vocab_size,
        rate,
        whole_word,
        special_ids,
        mask_id,
    )
    return out.positions, out.labels, out.inputs
