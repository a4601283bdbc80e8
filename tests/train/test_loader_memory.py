"""The loader's memory does not grow with the shard size: one worker's peak RSS on the same
64 MB of rows in 1 shard and in 32 (tools/bench/bench_loader.py's worker, in a fresh process
each)."""

import tempfile
from pathlib import Path

import pytest

from shatter.tools.bench.bench_loader import synthetic_dataset, worker_run

REPO = Path(__file__).resolve().parents[2]
ROWS = 64 * 1200  # random ids at length 256, dupe factor 2: about 880 bytes a row, 64 MB


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same number of rows in 1 train shard of about 64 MB and in 32 of about 2 MB (seq_len
    256: record batches of 1024 rows, about 2.3 MB decoded)."""
    root = tmp_path_factory.mktemp("shards")
    return {n: synthetic_dataset(root / f"{n}", ROWS, 256, 32000, 2, 0, n) for n in (1, 32)}


def peak_mb(root: Path, shard_mb: int) -> float:
    """The worker's peak RSS above its warm-up, in MB, over 160 batches of 128 rows (20 record
    batches), up to 80 of them before the end of the epoch's first shard: the cache fills; a
    reader that decodes whole shards holds one or two. Each run has a node cache of its own, so
    it hashes every shard it opens, as a node's first run does."""
    from shatter.shards import read_index

    first = read_index(root).shards("train")[0]
    size = first.bytes / 2**20
    assert 0.7 * shard_mb < size < 1.3 * shard_mb, f"{size:.1f} MB shards, meant {shard_mb}"
    before = min(first.rows // 128, 80)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", tmp)  # where the node cache keeps its verified marks
        r = worker_run(root, str(REPO), 128, before, 160 - before)
    return (r["hwm"] - r["rss0"]) / 2**20


@pytest.mark.slow
def test_worker_peak_rss_is_flat_in_the_shard_size(datasets):
    """The 1 shard within 1.2x of the 32: a whole shard held, read (a sha256 of one read) or
    decoded, costs it 64 MB or more. (The 32 small shards measure 0-25% above the 1.)"""
    peak = {n: peak_mb(datasets[n], 64 // n) for n in (1, 32)}
    print(f"loader peak RSS above the warm-up: {peak[1]:.1f} MB (1 shard), {peak[32]:.1f} MB (32)")
    assert peak[1] <= 1.2 * peak[32], peak
