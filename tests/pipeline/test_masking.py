"""Properties of the masking recipe (BERT §3.1): rates, 80/10/10, specials untouched, determinism."""

import numpy as np
import pytest

from shatter.pipeline.masking import (
    CLS_ID,
    MASK_ID,
    SEP_ID,
    SPECIAL_IDS,
    mask_batch,
    mask_row,
    row_seeds,
)

VOCAB = 1000


def _rows(n=64, width=128, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL_IDS), VOCAB, size=(n, width))
    lengths = rng.integers(3, width + 1, size=n)
    lengths[0] = width
    ids[np.arange(n), 0] = CLS_ID
    ids[np.arange(n), lengths - 1] = SEP_ID
    ids[:, 40] = SEP_ID  # a document boundary inside rows
    word_start = rng.random((n, width)) < 0.6
    return ids, lengths, word_start


@pytest.mark.parametrize("whole_word", [False, True])
def test_rates_labels_and_specials(whole_word):
    ids, lengths, ws = _rows()
    seeds = row_seeds(7, np.arange(len(ids)), 4)
    out = mask_batch(ids, lengths, ws, seeds, VOCAB, whole_word=whole_word)
    counts = np.diff(out.offsets).reshape(len(ids), 4)
    cand = [(~np.isin(ids[b, : lengths[b]], SPECIAL_IDS)).sum() for b in range(len(ids))]
    k = np.maximum(1, np.floor(0.15 * np.array(cand) + 0.5))
    if whole_word:  # words are taken while their midpoint is below k: close to k on average
        assert abs(counts.sum() / (4 * k.sum()) - 1) < 0.1
    else:
        assert (counts == k[:, None]).all()
    b_of = np.repeat(np.repeat(np.arange(len(ids)), 4), np.diff(out.offsets))
    assert (out.labels == ids[b_of, out.positions]).all()
    assert not np.isin(out.labels, SPECIAL_IDS).any()
    assert (out.positions < lengths[b_of]).all()


def test_80_10_10():
    ids, lengths, ws = _rows(n=512)
    out = mask_batch(ids, lengths, ws, row_seeds(0, np.arange(512), 2), VOCAB)
    is_mask = out.inputs == MASK_ID
    unchanged = out.inputs == out.labels
    random = ~is_mask & ~unchanged
    n = len(out.inputs)
    assert abs(is_mask.mean() - 0.8) < 0.02
    # a random draw equals the label with probability ~1/VOCAB, so "unchanged" is ~10.01%
    assert abs(unchanged.mean() - 0.1) < 0.015 and abs(random.mean() - 0.1) < 0.015
    assert (out.inputs[random] >= len(SPECIAL_IDS)).all() and (out.inputs[random] < VOCAB).all()
    assert n > 10000


def test_copies_differ_and_seeds_reproduce():
    ids, lengths, ws = _rows(n=8)
    seeds = row_seeds(3, np.arange(8), 3)
    a = mask_batch(ids, lengths, ws, seeds, VOCAB)
    b = mask_batch(ids, lengths, ws, seeds, VOCAB)
    assert all(np.array_equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))
    copy0 = a.positions[a.offsets[0] : a.offsets[1]]
    copy1 = a.positions[a.offsets[1] : a.offsets[2]]
    assert not np.array_equal(copy0, copy1)
    assert not np.array_equal(row_seeds(3, [5], 2), row_seeds(4, [5], 2))


@pytest.mark.parametrize("whole_word", [False, True])
def test_a_row_masks_the_same_alone_or_in_a_batch(whole_word):
    ids, lengths, ws = _rows(n=16)
    seeds = row_seeds(1, np.arange(16), 1)
    batch = mask_batch(ids, lengths, ws, seeds, VOCAB, whole_word=whole_word)
    for b in (1, 5):  # row 0 fills the width; these are padded in the batch
        pos, lab, inp = mask_row(
            ids[b, : lengths[b]],
            ws[b, : lengths[b]],
            int(seeds[b, 0]),
            VOCAB,
            whole_word=whole_word,
        )
        s, e = batch.offsets[b], batch.offsets[b + 1]
        assert (
            len(pos)
            and np.array_equal(pos, batch.positions[s:e])
            and np.array_equal(inp, batch.inputs[s:e])
        )
        assert np.array_equal(lab, batch.labels[s:e])


def test_whole_word_masks_complete_words():
    ids, lengths, ws = _rows(n=64)
    out = mask_batch(ids, lengths, ws, row_seeds(2, np.arange(64), 2), VOCAB, whole_word=True)
    for c in range(len(out.offsets) - 1):
        b = c // 2
        chosen = set(out.positions[out.offsets[c] : out.offsets[c + 1]].tolist())
        special = np.isin(ids[b], SPECIAL_IDS)
        word = np.cumsum(ws[b] | special)
        for p in chosen:  # every candidate token of a chosen token's word is chosen too
            mates = np.flatnonzero(
                (word == word[p]) & ~special & (np.arange(ids.shape[1]) < lengths[b])
            )
            assert set(mates.tolist()) <= chosen


def test_rows_without_candidates_get_no_masks():
    ids = np.array([[CLS_ID, SEP_ID, 0, 0]])
    out = mask_batch(ids, np.array([2]), np.ones_like(ids, bool), row_seeds(0, [1], 2), VOCAB)
    assert out.offsets.tolist() == [0, 0, 0]


@pytest.mark.parametrize("whole_word", [False, True])
def test_every_position_is_masked_equally_often(whole_word):
    n, width = 4000, 64
    ids = np.random.default_rng(1).integers(len(SPECIAL_IDS), VOCAB, size=(n, width))
    ws = (
        np.ones((n, width), bool)
        if not whole_word
        else np.arange(width)[None, :].repeat(n, 0) % 2 == 0
    )
    out = mask_batch(
        ids, np.full(n, width), ws, row_seeds(5, np.arange(n), 2), VOCAB, whole_word=whole_word
    )
    freq = np.bincount(out.positions, minlength=width) / (2 * n)
    assert abs(freq.mean() - 0.15) < 0.01
    assert np.abs(freq - 0.15).max() < 0.03  # no position favoured (by hash ties, word order, ...)


def test_an_empty_batch_masks_nothing():
    out = mask_batch(
        np.zeros((0, 16), int),
        np.zeros(0, int),
        np.zeros((0, 16), bool),
        row_seeds(0, [], 3),
        VOCAB,
    )
    assert (
        out.offsets.tolist() == [0]
        and len(out.positions) == len(out.labels) == len(out.inputs) == 0
    )


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_a_rate_outside_0_1_is_refused(rate):
    ids, lengths, ws = _rows(n=4)
    with pytest.raises(ValueError, match="rate"):
        mask_batch(ids, lengths, ws, row_seeds(0, np.arange(4), 1), VOCAB, rate=rate)
