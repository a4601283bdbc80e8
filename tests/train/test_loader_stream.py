"""The loader's stream (train/loader/stream.py): reading through shatter.shards (checks, errors
named by file, Beam-free), the finite validation stream, the bounded block cache and read-ahead."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shatter.shards import DatasetError, read_index
from tests.train.loaderutil import stream, take
from tests.train.shardutil import write_dataset


def test_longer_seq_len_than_the_data_is_an_error(dataset):
    with pytest.raises(DatasetError, match="seq-len 64.*32"):
        stream(read_index(dataset), seq_len=64)


def test_corrupted_shard_is_refused_by_name(tmp_path):
    root = write_dataset(tmp_path / "data", shards=(4, 4))
    victim = root / "train-00001-of-00002.arrow"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    s = stream(read_index(root), batch_size=8, shuffle=False)
    with pytest.raises(DatasetError, match=r"train-00001-of-00002\.arrow.*corrupted"):
        next(iter(s))


def test_a_shard_that_rots_after_its_check_stops_the_next_read(tmp_path, monkeypatch):
    """A bit flipped after a clean read (the node's mark made), size and mtime kept as bit rot
    keeps them: the next read hashes the record batch it reads and stops naming it."""
    from shatter.shards.store import configure, current

    monkeypatch.setattr("shatter.shards.store.settings._current", None)  # restored after
    configure(current().replace(cache_dir=str(tmp_path / "node-cache")))
    root = write_dataset(tmp_path / "data", shards=(4, 4))
    first = [b["sample_id"] for b in take(stream(read_index(root), shuffle=False), 2)]
    assert list((tmp_path / "node-cache" / "verified").iterdir())  # the marks of a clean read
    victim = root / "train-00001-of-00002.arrow"
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.seek(st.st_size - 100)  # inside the last record batch's compressed body
        byte = f.read(1)[0]
        f.seek(st.st_size - 100)
        f.write(bytes([byte ^ 0x10]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DatasetError) as err:
        take(stream(read_index(root), shuffle=False), 2)
    line = str(err.value)
    assert str(victim) in line and "record batch 1 is corrupted" in line and "\n" not in line
    assert "rebuild the dataset or fetch the shard again" in line and len(first) == 2


def test_missing_index_tokenizer_and_version_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_index(tmp_path / "nowhere")
    (tmp_path / "partial").mkdir()
    with pytest.raises(DatasetError, match="index.json not found"):
        read_index(tmp_path / "partial")
    root = write_dataset(tmp_path / "data")
    (root / "tokenizer.model").write_bytes(b"another tokenizer")
    with pytest.raises(DatasetError, match="tokenizer.model: sha256"):
        read_index(root)
    index = json.loads((root / "index.json").read_text())
    index["version"] = 2
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match="version 2"):
        read_index(root, verify_tokenizer=False)


def test_validation_stream_is_finite_and_split_between_ranks(dataset):
    from shatter.train.config import DataArgs
    from shatter.train.loader import validation_stream

    index = read_index(dataset)
    ids = []
    for rank in range(2):
        for b in validation_stream(
            index, DataArgs(), batch_size=2, seq_len=32, rank=rank, world_size=2
        ):
            ids += b["sample_id"].tolist()
    assert sorted(ids) == [-1] + list(range(5))  # rank 1 padded to rank 0's 2 batches
    ids = [i for i in ids if i >= 0]
    np.testing.assert_array_equal(np.unique(ids), np.arange(5))


@pytest.mark.slow
def test_format_reader_is_beam_free(tmp_path):
    """The trainer reads a local dataset through shatter.shards without importing Beam."""
    import subprocess
    import sys

    root = write_dataset(tmp_path / "data")
    code = (
        "import sys, shatter.train.loader; from shatter.shards import read_index, load_shard; "
        f"i = read_index({str(root)!r}); s = i.shards('train')[0]; load_shard(i.shard_path(s), s); "
        "assert 'apache_beam' not in sys.modules, 'the reader imported apache_beam'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    index = json.loads((root / "index.json").read_text())
    index["format"] = "something-else"
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(DatasetError, match="format 'something-else'"):
        read_index(root, verify_tokenizer=False)


def test_validation_stream_can_be_iterated_again_without_rehashing(dataset, monkeypatch, tmp_path):
    """The loop builds the validation stream once and passes over it at every evaluation; another
    stream of the node (a loader worker, a rank) trusts the node's mark and hashes nothing."""
    from shatter.shards import reader
    from shatter.shards.store import configure, current
    from shatter.train.config import DataArgs
    from shatter.train.loader import validation_stream

    monkeypatch.setattr("shatter.shards.store.settings._current", None)  # restored after
    configure(current().replace(cache_dir=str(tmp_path / "node-cache")))
    hashed = []  # the passes over a whole shard (each read of a record batch hashes it alone)
    real = reader._hash_blocks
    monkeypatch.setattr(reader, "_hash_blocks", lambda fd, *a: hashed.append(fd) or real(fd, *a))
    s = validation_stream(
        read_index(dataset, verify_tokenizer=False),
        DataArgs(),
        batch_size=2,
        seq_len=32,
        rank=0,
        world_size=1,
    )
    first, second = list(s), list(s)
    assert len(first) == 3 and len(first) == len(second)
    for a, b in zip(first, second):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    assert len(hashed) == 1, hashed  # one validation shard, hashed on the first pass only
    again = validation_stream(s.index, DataArgs(), batch_size=2, seq_len=32, rank=1, world_size=2)
    assert list(again) and len(hashed) == 1, hashed


def test_record_batches_are_located_by_their_headers_and_decoded_one_at_a_time(tmp_path):
    """open_shard reads message headers only; a block is one record batch; damage is named."""
    import pyarrow as pa

    from shatter.shards.reader import open_shard

    root = write_dataset(tmp_path / "data", shards=(11, 6))  # record batches of n // 2 rows
    index = read_index(root)
    for info in index.shards("train"):
        path = index.shard_path(info)
        file = open_shard(path, info)
        with pa.memory_map(path) as source:
            batches = list(pa.ipc.open_stream(source))
        assert list(np.diff(file.row_start)) == [b.num_rows for b in batches]
        for i, batch in enumerate(batches):
            block = file.block(i)
            np.testing.assert_array_equal(block.ids, batch["input_ids"].values.to_numpy())
            assert block.rows == batch.num_rows
    info = index.shards("train")[0]
    path = Path(index.shard_path(info))
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DatasetError, match=r"train-00000-of-00002\.arrow: truncated"):
        open_shard(str(path), info, verify=False)


def test_a_worker_keeps_a_bounded_cache_and_opens_the_next_shard_ahead(dataset):
    from shatter.shards.blocks import BlockReader

    s = stream(read_index(dataset), batch_size=3)
    it = iter(s)
    next(it)
    order, _ = s.order.shards(0)
    s.reader.file(int(order[1]))  # opened ahead: already under way (or done)
    assert int(order[1]) in s.reader._files
    tiny = BlockReader([s.index.shard_path(i) for i in s.shards], s.shards, True, capacity=2)
    for shard, info in enumerate(s.shards):
        for _block, _rows, _hit in tiny.rows(shard, np.arange(info.rows)):
            assert len(tiny._blocks) <= 2


def _worker_fault(kind: str, owed: np.ndarray):
    """A `ShardStream.batch` whose loader worker hangs or is SIGKILLed at the batch `owed`."""
    import os
    import signal
    import time

    from shatter.train.loader import ShardStream

    batch = ShardStream.batch

    def faulty(self, q):
        if np.array_equal(q, owed):
            if kind == "hang":
                time.sleep(600)
            os.kill(os.getpid(), signal.SIGKILL)
        return batch(self, q)

    return faulty


@pytest.mark.parametrize("kind", ["hang", "die"])
def test_a_stuck_or_dead_loader_worker_is_named_with_the_shards_it_reads(
    dataset, monkeypatch, kind
):
    """Two workers; the one that owes local batch 2 (worker 0) hangs in it or is killed: the
    rank's wait ends within the loader's timeout (a death: at once, whichever batch the rank
    waits for) in one line naming that worker and the batch's shards, not as a peer's
    collective timeout, much later."""
    from torch.utils.data import DataLoader

    from shatter.train.loader import ShardStream, WorkerBatches

    s = stream(read_index(dataset), batch_size=3)
    monkeypatch.setattr(ShardStream, "batch", _worker_fault(kind, s.slots.positions(2)))
    batches = WorkerBatches(DataLoader(s, batch_size=None, num_workers=2), timeout_s=3)
    try:
        with pytest.raises(DatasetError) as caught:
            for _ in range(5):
                next(batches)
        assert batches.received == 2 or kind == "die"
    finally:
        batches.close()
    line = str(caught.value)
    owed = 2 if kind == "hang" else int(line.split("it owes, ")[1].split(",")[0])
    shards = {s.paths[i] for _, _, i, *_ in s.by_shard(s.slots.positions(owed))}
    assert all(path in line for path in shards), line
    if kind == "hang":
        assert "sent no batch for 3 s: a stuck loader worker" in line
        assert "raise run.collective_timeout_s" in line
    else:
        assert "died (DataLoader worker (pid" in line and "data.num_workers" in line
    assert line.startswith("loader worker 0 (pid ") and "the next batch it owes, " in line
    print(line)  # the report's line (-s)
