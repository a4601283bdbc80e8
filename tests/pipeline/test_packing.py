"""Packing (RoBERTa FULL-SENTENCES): exact row lengths, [CLS]/[SEP], no token lost, order kept."""

import numpy as np
import pytest

from shatter.pipeline.masking import CLS_ID, SEP_ID
from shatter.pipeline.packing import content_tokens, pack_documents, pack_documents_padded, padded


def _docs(seed=0, n=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 500, size=int(rng.integers(1, 300))) for _ in range(n)]


def _content(rows):
    stream = np.concatenate(rows)
    return stream[(stream != CLS_ID) & (stream != SEP_ID)]


@pytest.mark.parametrize("seq_len", [8, 16, 128])
def test_no_token_lost_and_exact_lengths(seq_len):
    docs = _docs()
    rows = pack_documents(docs, seq_len)
    assert all(len(r) == seq_len for r in rows[:-1]) and 3 <= len(rows[-1]) <= seq_len
    assert all(r[0] == CLS_ID and r[-1] == SEP_ID for r in rows)
    assert content_tokens(*padded(rows, seq_len)) == sum(len(d) for d in docs)
    assert np.array_equal(_content(rows), np.concatenate(docs))  # every token, in order
    inner_seps = sum(int((r[1:-1] == SEP_ID).sum()) for r in rows)
    assert len(docs) - len(rows) <= inner_seps <= len(docs) - 1  # boundaries not on a row end


def test_no_cross_document_rows_stay_within_documents():
    docs = _docs(1)
    rows = pack_documents(docs, 32, cross_document=False)
    assert all((r[1:-1] != SEP_ID).all() for r in rows)  # no separator inside any row
    assert content_tokens(*padded(rows, 32)) == sum(len(d) for d in docs)
    per_doc = [-(-len(d) // 30) for d in docs]  # ceil(len / (seq_len - 2)) rows per document
    assert len(rows) == sum(per_doc)


def test_document_ending_at_row_end_uses_its_separator():
    rows = pack_documents([np.arange(5, 11), np.arange(20, 23)], seq_len=8)
    assert [r.tolist() for r in rows] == [
        [CLS_ID, 5, 6, 7, 8, 9, 10, SEP_ID],
        [CLS_ID, 20, 21, 22, SEP_ID],
    ]


def test_empty_input():
    assert pack_documents([], 16) == [] and pack_documents([np.array([], int)], 16) == []


def _reference_rows(stream, seq_len):
    """The recipe written as the obvious loop: a row takes seq_len - 1 ids when they end on a
    [SEP] (or the stream ends), else seq_len - 2 ids and a [SEP] of its own."""
    rows, i = [], 0
    while i < len(stream):
        chunk = stream[i : i + seq_len - 1]
        if len(chunk) < seq_len - 1 or chunk[-1] == SEP_ID:
            rows.append([CLS_ID, *chunk])
            i += len(chunk)
        else:
            rows.append([CLS_ID, *chunk[: seq_len - 2], SEP_ID])
            i += seq_len - 2
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_packing_matches_the_loop(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(3, 12))
    docs = [
        rng.integers(5, 50, size=int(rng.integers(1, 3 * seq_len)))
        for _ in range(int(rng.integers(1, 40)))
    ]
    stream = np.concatenate([part for d in docs for part in (d, [SEP_ID])])
    got = pack_documents(docs, seq_len)
    assert [r.tolist() for r in got] == _reference_rows(stream.tolist(), seq_len)
    ids, lengths = pack_documents_padded(docs, seq_len)
    assert ids.shape == (len(got), seq_len) and ids.dtype == np.int32
    assert (ids[np.arange(seq_len)[None, :] >= lengths[:, None]] == 0).all()  # padding is [PAD]


def test_content_tokens_counts_within_rows_whatever_the_padding():
    """Padding that is not special is counted by elimination (the fast path); padding with a
    special id (here [SEP]) needs the row lengths: both give the document tokens."""
    docs = _docs(2)
    rows = pack_documents(docs, 16)
    want = sum(len(d) for d in docs)
    assert content_tokens(*padded(rows, 24)) == want
    sep_padded = padded(rows, 24, pad_id=SEP_ID)
    assert (sep_padded[0] == SEP_ID).sum() > (padded(rows, 24)[0] == SEP_ID).sum()
    assert content_tokens(*sep_padded, pad_id=SEP_ID) == want
