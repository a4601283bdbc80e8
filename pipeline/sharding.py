"""Deterministic, balanced sharding by content key, with bounded memory on any runner.

Rows are spilled in key order to temporary Arrow IPC files by the workers that make them, with a
histogram of their keys over 2**16 buckets (the key's top 16 bits). The summed histogram gives
each split's shard boundaries: contiguous bucket ranges holding about N / num_shards rows each
(off by at most one bucket, ~N / 65536 rows). A shard's writer then reads just its key range of
every spill file. Shards are therefore key ranges of a hash: any row's shard depends on all rows'
keys only, never on workers or bundles, and no stage holds more than one shard in memory (Beam's
local runners keep a GroupByKey's whole input in memory, so rows themselves never go through one).

The number of shards of a split is given (`--num-shards`) or follows from its size
(`ShardSize`): the summed rows and tokens of its spills, which depend on the rows alone, so the
count is as deterministic as the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ShardSize:
    """Shards of about `target_bytes` each, estimated as the Arrow data they hold before zstd
    (the writer's columns, docs/pipeline.md): the files come out smaller, and a reader's decoded
    record batches are about this size per row."""

    target_bytes: int  # --shard-size-mb
    id_bytes: int  # 2 (uint16 ids) or 4 (int32)
    dupe_factor: int
    mask_rate: float

    def estimate(self, rows: int, tokens: int) -> float:
        per_token = (
            self.id_bytes  # input_ids
            + 1 / 8  # word_start, bit-packed
            + self.dupe_factor
            * self.mask_rate
            * (2 + 2 * self.id_bytes)  # positions, labels, inputs
        )
        per_row = 8 + 2 * 4 + 3 * 4 * (1 + self.dupe_factor)  # key, list offsets
        return tokens * per_token + rows * per_row

    def count(self, rows: int, tokens: int) -> int:
        return max(1, math.ceil(self.estimate(rows, tokens) / self.target_bytes))


def sum_sizes(sizes) -> tuple[int, int]:
    """(rows, tokens) summed (a Beam combiner: associative, also over partial sums)."""
    rows = tokens = 0
    for r, t in sizes:
        rows, tokens = rows + r, tokens + t
    return rows, tokens


def shard_counts(sizes: dict, given: dict, size: ShardSize) -> dict:
    """Shards per split: the given count, else from the split's (rows, tokens); at least 1."""
    return {split: n if n else size.count(*sizes.get(split, (0, 0))) for split, n in given.items()}
