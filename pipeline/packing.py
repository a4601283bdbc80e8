"""Packing token streams into fixed-length rows: the BERT / RoBERTa "FULL-SENTENCES" recipe.

Documents are joined with [SEP] between them and cut into rows of exactly `seq_len` ids, [CLS]
first and a closing [SEP] last (RoBERTa, Liu et al. 2019, §4.2 "FULL-SENTENCES"; here rows may
cross documents unless `cross_document=False`). Only the last row of a stream may be shorter. No
token is dropped: every document token lands in exactly one row, in order; a separator that falls
on a row boundary doubles as that row's closing [SEP].

Rows come out padded, as one int32 [n, seq_len] array and their lengths: the row starts are found
by a short loop over rows (each start fixes the next), and each row is one window of the stream.
"""

from __future__ import annotations

import numpy as np

from shatter.pipeline.masking import CLS_ID, PAD_ID, SEP_ID


def pack_stream_padded(
    stream: np.ndarray,
    seq_len: int,
    cls_id: int = CLS_ID,
    sep_id: int = SEP_ID,
    pad_id: int = PAD_ID,
) -> tuple[np.ndarray, np.ndarray]:
    """Cut `stream` (documents each followed by [SEP]) into `[CLS] ... [SEP]` rows of <= seq_len
    ids: (ids int32 [n, seq_len] padded with `pad_id`, lengths int32 [n])."""
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 ([CLS], one token, [SEP]); got {seq_len}")
    stream = np.asarray(stream)
    n, room = len(stream), seq_len - 1  # ids after [CLS]
    # from start i, a row takes `room` ids when they end on a [SEP] (or the stream ends first),
    # else room - 1 ids and a [SEP] of its own
    at_sep = (stream == sep_id).tobytes()  # indexing bytes is the fastest scalar lookup
    starts, i = [], 0
    while i < n:
        starts.append(i)
        i += room if i + room > n or at_sep[i + room - 1] else room - 1
    starts = np.asarray(starts, dtype=np.int64)
    taken = np.minimum(np.diff(np.append(starts, i)), n - starts)
    own_sep = taken == room - 1
    own_sep[-1:] &= starts[-1:] + taken[-1:] < n  # the tail ends in the stream's own [SEP]
    # each row is a window of the stream (past its end: padding), copied whole
    windows = np.lib.stride_tricks.sliding_window_view(
        np.concatenate([stream, np.full(room, pad_id, stream.dtype)]), room
    )
    ids = np.empty((len(starts), seq_len), dtype=np.int32)
    ids[:, 0] = cls_id
    ids[:, 1:] = windows[starts]
    ids[own_sep, -1] = sep_id  # over the id the row leaves to the next one
    return ids, (taken + 1 + own_sep).astype(np.int32)


def pack_documents_padded(
    docs: list[np.ndarray],
    seq_len: int,
    cross_document: bool = True,
    cls_id: int = CLS_ID,
    sep_id: int = SEP_ID,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack tokenised documents (empty ones ignored) into padded rows; per document if not cross_document."""
    docs = [np.asarray(d) for d in docs if len(d)]
    if not docs:
        return np.zeros((0, seq_len), dtype=np.int32), np.zeros(0, dtype=np.int32)
    sep = np.array([sep_id], dtype=np.result_type(*docs))
    if not cross_document:
        parts = [
            pack_stream_padded(np.concatenate([d, sep]), seq_len, cls_id, sep_id) for d in docs
        ]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return pack_stream_padded(
        np.concatenate([part for d in docs for part in (d, sep)]), seq_len, cls_id, sep_id
    )


def unpad(ids: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return [row[:length] for row, length in zip(ids, lengths)]


def pack_documents(
    docs: list[np.ndarray],
    seq_len: int,
    cross_document: bool = True,
    cls_id: int = CLS_ID,
    sep_id: int = SEP_ID,
) -> list[np.ndarray]:
    """`pack_documents_padded` as a list of unpadded rows."""
    return unpad(*pack_documents_padded(docs, seq_len, cross_document, cls_id, sep_id))


def content_tokens(
    ids: np.ndarray, lengths: np.ndarray, special_ids=(CLS_ID, SEP_ID), pad_id: int = PAD_ID
) -> int:
    """Number of non-special ids in rows padded with `pad_id` (what the documents contributed)."""
    if pad_id in special_ids:  # the padding would count: only the ids within each row's length
        in_row = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
        return int((in_row & ~np.isin(ids, special_ids)).sum())
    # the padding is not special: every special id of the array lies within a row (3x faster)
    return int(np.asarray(lengths).sum()) - sum(
        int(np.count_nonzero(ids == s)) for s in special_ids
    )


def padded(
    rows: list[np.ndarray], width: int, pad_id: int = PAD_ID
) -> tuple[np.ndarray, np.ndarray]:
    """Rows as one int32 [n, width] array, padded with `pad_id`, and their int32 lengths."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths
