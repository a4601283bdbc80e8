"""Deterministic, balanced sharding by content key, with bounded memory on any runner.

Rows are spilled in key order to temporary Arrow IPC files by the workers that make them, with a
histogram of their keys over 2**16 buckets (the key's top 16 bits). The summed histogram gives
each split's shard boundaries: contiguous bucket ranges holding about N / num_shards rows each
(off by at most one bucket, ~N / 65536 rows). A shard's writer then reads just its key range of
every spill file. Shards are therefore key ranges of a hash: any row's shard depends on all rows'
keys only, never on workers or bundles, and no stage holds more than one shard in memory (Beam's
local runners keep a GroupByKey's whole input in memory, so rows themselves never go through one).
"""

from __future__ import annotations

import numpy as np

BUCKET_BITS = 16
N_BUCKETS = 1 << BUCKET_BITS


def buckets(keys: np.ndarray) -> np.ndarray:
    return (np.asarray(keys, dtype=np.uint64) >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)


def histogram(keys: np.ndarray) -> np.ndarray:
    """Row counts per bucket, int64[N_BUCKETS]."""
    return np.bincount(buckets(keys), minlength=N_BUCKETS).astype(np.int64)


def balanced_boundaries(hist: np.ndarray, num_shards: int) -> np.ndarray:
    """Bucket edges int64[num_shards + 1]: shard i holds buckets [edges[i], edges[i+1]).

    Edge i is the bucket where the running count first reaches i * N / num_shards, so each shard
    is within one bucket of the ideal size.
    """
    cum = np.concatenate([[0], np.cumsum(hist)])
    total = cum[-1]
    targets = np.arange(1, num_shards) * total / num_shards
    inner = np.searchsorted(cum, targets, side="left")
    # cum[j] = rows in buckets < j; choose the edge j whose count is nearest the target
    below = np.maximum(inner - 1, 0)
    nearer_below = (targets - cum[below]) < (cum[np.minimum(inner, N_BUCKETS)] - targets)
    inner = np.where(nearer_below, below, inner)
    inner = np.maximum.accumulate(np.clip(inner, 0, N_BUCKETS))
    return np.concatenate([[0], inner, [N_BUCKETS]]).astype(np.int64)


def shard_cuts(sorted_buckets: np.ndarray, counts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Row offsets int64[num_shards + 1] of key-sorted rows, given as their distinct buckets
    (ascending) and each bucket's row count: shard i holds rows cuts[i]:cuts[i + 1]."""
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return cum[np.searchsorted(sorted_buckets, edges, side="left")]


def sort_order(keys: np.ndarray) -> np.ndarray:
    """Row order by key. Equal keys mean equal rows (the key hashes the row), so ties are harmless."""
    return np.argsort(np.asarray(keys, dtype=np.uint64), kind="stable")
