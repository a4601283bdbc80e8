"""Packing token streams into fixed-length rows: the BERT / RoBERTa "FULL-SENTENCES" recipe.

Documents are joined with [SEP] between them and cut into rows of exactly `seq_len` ids, [CLS]
first and a closing [SEP] last (RoBERTa, Liu et al. 2019, §4.2 "FULL-SENTENCES"; here rows may
cross documents unless `cross_document=False`). Only the last row of a stream may be shorter. No
token is dropped: every document token lands in exactly one row, in order; a separator that falls
on a row boundary doubles as that row's closing [SEP].
"""
from __future__ import annotations

import numpy as np

from pipeline.masking import CLS_ID, SEP_ID


def pack_stream(stream: np.ndarray, seq_len: int, cls_id: int = CLS_ID, sep_id: int = SEP_ID) -> list[np.ndarray]:
    """Cut `stream` (documents each followed by [SEP]) into `[CLS] ... [SEP]` rows of <= seq_len ids."""
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 ([CLS], one token, [SEP]); got {seq_len}")
    rows, i, n = [], 0, len(stream)
    cls = np.array([cls_id], dtype=stream.dtype)
    sep = np.array([sep_id], dtype=stream.dtype)
    while i < n:
        chunk = stream[i : i + seq_len - 1]
        if len(chunk) < seq_len - 1 or chunk[-1] == sep_id:
            # the stream (always ending in [SEP]) or a document ends exactly at the row's end
            rows.append(np.concatenate([cls, chunk]))
            i += len(chunk)
        else:
            rows.append(np.concatenate([cls, chunk[: seq_len - 2], sep]))
            i += seq_len - 2
    return rows


def pack_documents(
    docs: list[np.ndarray], seq_len: int, cross_document: bool = True, cls_id: int = CLS_ID, sep_id: int = SEP_ID
) -> list[np.ndarray]:
    """Pack tokenised documents (empty ones ignored) into rows; per document if not cross_document."""
    docs = [np.asarray(d) for d in docs if len(d)]
    if not docs:
        return []
    dtype = np.result_type(*docs)
    sep = np.array([sep_id], dtype=dtype)
    if not cross_document:
        return [row for d in docs for row in pack_stream(np.concatenate([d, sep]), seq_len, cls_id, sep_id)]
    stream = np.concatenate([part for d in docs for part in (d, sep)])
    return pack_stream(stream, seq_len, cls_id, sep_id)


def content_tokens(rows: list[np.ndarray], special_ids=(CLS_ID, SEP_ID)) -> int:
    """Number of non-special ids in `rows` (what the documents contributed)."""
    if not rows:
        return 0
    flat = np.concatenate(rows)
    return int(len(flat) - np.isin(flat, special_ids).sum())


def padded(rows: list[np.ndarray], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows as one int32 [n, width] array, padded with `pad_id`, and their int32 lengths."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    full = lengths == width
    if full.any():
        ids[full] = np.stack([r for r, f in zip(rows, full) if f])
    for i in np.flatnonzero(~full):
        ids[i, : lengths[i]] = rows[i]
    return ids, lengths
