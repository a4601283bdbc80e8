"""Balanced key-range sharding: balance, coverage, independence from how rows are split."""

import tracemalloc

import numpy as np
import pyarrow as pa
import pytest

from shatter.pipeline import sharding
from shatter.pipeline.sink import SPILL_BATCH_ROWS, read_piece, spill_table


def _sizes(sorted_keys, edges):
    """Rows per shard, through the cut function the shard sink uses on each spill."""
    return np.diff(
        sharding.shard_cuts(*np.unique(sharding.buckets(sorted_keys), return_counts=True), edges)
    )


def _keys(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2**63, size=n, dtype=np.int64).astype(
        np.uint64
    ) * np.uint64(2)


@pytest.mark.parametrize("n,shards", [(37, 4), (1000, 8), (200_000, 16)])
def test_shards_are_balanced(n, shards):
    keys = np.sort(_keys(n))
    edges = sharding.balanced_boundaries(sharding.histogram(keys), shards)
    sizes = _sizes(keys, edges)
    assert sizes.sum() == n and len(sizes) == shards and (sizes > 0).all()
    ideal = n / shards
    # within one bucket (~n / 65536 rows, at least one row) of the ideal size
    assert max(abs(s - ideal) for s in sizes) <= max(2, 3 * n / sharding.N_BUCKETS)
    if n >= 100_000:
        assert max(sizes) / min(sizes) < 1.01


def test_boundaries_depend_only_on_the_set_of_keys():
    keys = _keys(5000, 1)
    parts = np.array_split(np.random.default_rng(2).permutation(keys), 7)
    summed = sum(sharding.histogram(p) for p in parts)
    assert np.array_equal(
        sharding.balanced_boundaries(summed, 5),
        sharding.balanced_boundaries(sharding.histogram(keys), 5),
    )


def test_empty_and_single_shard():
    edges = sharding.balanced_boundaries(np.zeros(sharding.N_BUCKETS, np.int64), 3)
    assert edges[0] == 0 and edges[-1] == sharding.N_BUCKETS and (np.diff(edges) >= 0).all()
    keys = np.sort(_keys(10))
    assert _sizes(keys, sharding.balanced_boundaries(sharding.histogram(keys), 1)).tolist() == [10]
    assert _sizes(keys, edges).sum() == 10  # all rows, whatever the (degenerate) edges


def test_id_type_follows_design_md():
    """uint16 ids, or int32 when the vocabulary exceeds 65535 (DESIGN.md, shard layout)."""
    import pyarrow as pa

    from shatter.shards import id_type

    assert id_type(32000) == id_type(65535) == pa.uint16() and id_type(65536) == pa.int32()


def test_a_piece_of_a_spill_keeps_only_its_own_rows(tmp_path):
    """A shard reads a piece of every spill: a zero-copy slice would keep the spill's whole record
    batches alive, so a shard writer's memory grew with the number of spills (with the corpus)."""
    rows, width = 3 * SPILL_BATCH_ROWS, 128
    keys = np.sort(np.random.default_rng(0).integers(0, 2**63, rows).astype(np.uint64))
    ids = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    lengths = np.full(rows, width, dtype=np.int32)
    path = str(tmp_path / "spill.arrow")
    table = spill_table(keys, ids, lengths)
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=SPILL_BATCH_ROWS):
            writer.write_batch(batch)
    tracemalloc.start()  # the batches are read into Python bytes that Arrow wraps
    try:
        for start, stop in ((10, 20), (SPILL_BATCH_ROWS - 5, SPILL_BATCH_ROWS + 5)):
            before = tracemalloc.get_traced_memory()[0]
            got = read_piece(path, start, stop)
            kept = tracemalloc.get_traced_memory()[0] - before
            assert kept < 100_000, kept  # a batch of the spill is 2.1 MB
            for a, want in zip(got, (keys, ids, lengths)):
                assert np.array_equal(a, want[start:stop])
            del got
    finally:
        tracemalloc.stop()


def test_shard_count_follows_the_size_unless_given():
    size = sharding.ShardSize(64 << 20, 2, 5, 0.15)
    # 2 + 1/8 + 5 * 0.15 * 6 = 6.625 bytes a token, 8 + 8 + 12 * 6 = 88 a row
    assert size.estimate(1000, 256_000) == 256_000 * 6.625 + 1000 * 88
    rows = 3_300_000_000 // 256  # English Wikipedia at length 256
    n = size.count(rows, rows * 256)
    assert n == -(-int(size.estimate(rows, rows * 256)) // (64 << 20)) == 343
    assert (
        size.count(0, 0) == 1
        and sharding.ShardSize(64 << 20, 4, 5, 0.15).count(rows, rows * 256) > n
    )
    given = {"train": None, "validation": 2}
    sizes = {"train": (rows, rows * 256)}  # no validation rows at all: still its given count
    assert sharding.shard_counts(sizes, given, size) == {"train": n, "validation": 2}
    assert sharding.shard_counts({}, {"train": None}, size) == {"train": 1}
    assert sharding.sum_sizes([(1, 10), (2, 20), (3, 30)]) == (6, 60)
