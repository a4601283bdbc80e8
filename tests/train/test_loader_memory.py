"""The loader's memory does not grow with the shard size: one worker's peak RSS at shards of
about 4 and 32 MB (tools/bench/bench_loader.py's worker, in a fresh process each)."""

from pathlib import Path

import pytest

from shatter.tools.bench.bench_loader import synthetic_dataset, worker_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory):
    """Two datasets of 2 train shards each, of about 4 and 32 MB (seq_len 256: record batches of
    1024 rows, about 2.3 MB decoded)."""
    root = tmp_path_factory.mktemp("sizes")
    rows_per_mb = 1200  # random ids at length 256, dupe factor 2: about 880 bytes a row
    return {
        mb: synthetic_dataset(root / f"{mb}mb", 2 * mb * rows_per_mb, 256, 32000, 2)
        for mb in (4, 32)
    }


@pytest.mark.slow
def test_worker_peak_rss_does_not_grow_with_the_shard_size(two_sizes):
    from shatter.shards import read_index

    peak = {}
    for mb, root in two_sizes.items():
        rows = read_index(root).shards("train")[0].rows
        size = read_index(root).shards("train")[0].bytes / 2**20
        assert 0.7 * mb < size < 1.3 * mb, f"{size:.1f} MB shards, meant {mb}"
        # 80 batches (10 record batches) either side of the boundary of the epoch's first shard:
        # the cache fills; a reader that decodes whole shards holds both
        r = worker_run(root, str(REPO), 128, min(rows // 128, 80), 80)
        peak[mb] = (r["hwm"] - r["rss0"]) / 2**20
    print(
        f"loader peak RSS above the warm-up: {peak[4]:.1f} MB (4 MB shards), {peak[32]:.1f} MB (32)"
    )
    assert peak[32] <= 1.2 * peak[4], peak
