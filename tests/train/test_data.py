"""The streaming loader: no overlap or gap across ranks and workers, exact resume, checks, masking."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from shardutil import write_dataset
from torch.utils.data import DataLoader

from pipeline.format import DatasetError, read_index
from train.data import MaskingSpec, ShardStream, StreamPosition
from train.masking import IGNORE, MASK, PAD, SEP


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(
        tmp_path_factory.mktemp("shards") / "data", shards=(7, 5, 9, 3), seq_len=32, dupe_factor=3
    )


def stream(index, **kw):
    args = dict(batch_size=4, seq_len=index.seq_len, masking=MaskingSpec("static"), seed=3)
    args.update(kw)
    return ShardStream(index, "train", **args)


def take(loader, n_batches):
    it = iter(loader)
    return [next(it) for _ in range(n_batches)]


@pytest.mark.parametrize("world,workers", [(1, 0), (3, 2)])
def test_each_epoch_sees_every_sample_once_across_ranks_and_workers(dataset, world, workers):
    index = read_index(dataset)
    n = 24  # rows of the train split
    batch = 2
    steps = (
        2 * n // (batch * world) + 1
    )  # two epochs and a bit: batches straddle the epoch boundary
    per_rank = []
    for rank in range(world):
        s = stream(index, batch_size=batch, rank=rank, world_size=world)
        loader = DataLoader(s, batch_size=None, num_workers=workers)
        per_rank.append(take(loader, steps))
    # the global order: micro-step by micro-step, rank by rank, sample by sample
    seen = []
    for step in range(steps):
        rows = [(b["epoch"], b["sample_id"]) for b in (per_rank[r][step] for r in range(world))]
        for k in range(batch):
            seen += [(int(e[k]), int(u[k])) for e, u in rows]
    first, second = seen[:n], seen[n : 2 * n]
    assert sorted(u for _, u in first) == list(range(n)) and {e for e, _ in first} == {0}
    assert sorted(u for _, u in second) == list(range(n)) and {e for e, _ in second} == {1}
    assert [u for _, u in first] != [u for _, u in second], "epochs must be shuffled differently"
    assert [u for _, u in first] != sorted(u for _, u in first)


def test_resume_continues_at_the_next_sample(dataset):
    index = read_index(dataset)
    full = take(iter(stream(index, rank=1, world_size=2)), 12)
    start = 5 * 4 * 2  # five micro-steps of batch 4 on two ranks
    resumed = take(iter(stream(index, rank=1, world_size=2, start=start)), 7)
    for a, b in zip(full[5:], resumed):
        for key in ("input_ids", "labels", "attention_mask", "sample_id"):
            assert torch.equal(a[key], b[key]), key


def test_a_different_world_size_resumes_at_the_same_global_position(dataset):
    index = read_index(dataset)
    one = torch.cat([b["sample_id"] for b in take(iter(stream(index, batch_size=2)), 10)])
    start = 6
    r0 = take(iter(stream(index, batch_size=1, rank=0, world_size=2, start=start)), 7)
    r1 = take(iter(stream(index, batch_size=1, rank=1, world_size=2, start=start)), 7)
    interleaved = torch.stack(
        [torch.cat([a["sample_id"] for a in r0]), torch.cat([b["sample_id"] for b in r1])], 1
    )
    assert torch.equal(interleaved.reshape(-1), one[start : start + 14])


@pytest.mark.parametrize("start", [0, 16])
def test_a_step_s_micro_batches_are_the_same_rows_for_any_ranks_times_accumulation(dataset, start):
    """W ranks x A micro-batches a step, W*A = 4: micro-batch a of rank r holds the same rows as
    slot a*W + r of any other split (2 loader workers on one of them); from position 0, 3 steps
    cover one epoch (24 rows) once."""
    index = read_index(dataset)
    steps, layouts = 3, {}
    for world, accum in [(4, 1), (2, 2), (1, 4)]:
        slots = {}
        for rank in range(world):
            s = stream(
                index, batch_size=2, rank=rank, world_size=world, grad_accum=accum, start=start
            )
            loader = DataLoader(s, batch_size=None, num_workers=2 if world == 1 else 0)
            for j, b in enumerate(take(loader, steps * accum)):
                step, micro = divmod(j, accum)
                slots[step, micro * world + rank] = b["sample_id"].tolist()
        layouts[world, accum] = slots
    assert layouts[4, 1] == layouts[2, 2] == layouts[1, 4]
    rows = [u for batch in layouts[1, 4].values() for u in batch]
    assert len(rows) == 24 and (start or sorted(rows) == list(range(24)))


def test_position_round_trip_and_refusal_on_other_data():
    p = StreamPosition(samples=53, epoch_size=24)
    assert (p.epoch, p.in_epoch) == (2, 5)
    assert StreamPosition.from_dict(p.to_dict(), 24) == p
    with pytest.raises(DatasetError, match="24 rows"):
        StreamPosition.from_dict(p.to_dict(), 25)


def test_batches_are_named_padded_to_their_longest_row(dataset):
    index = read_index(dataset)
    for b in take(iter(stream(index)), 6):
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        lengths = mask.sum(1)
        assert ids.shape[1] == lengths.max()  # padded to the longest row of this batch, not seq_len
        assert bool((ids[mask == 0] == PAD).all()) and bool((labels[mask == 0] == IGNORE).all())
        assert bool((ids[torch.arange(len(ids)), lengths - 1] == SEP).all())
        assert ids.dtype == labels.dtype == torch.int64


def test_static_masks_cycle_by_epoch_and_match_the_shards(dataset):
    index = read_index(dataset)
    n, dupe = 24, index.dupe_factor
    s = stream(index, batch_size=n, shuffle=False)
    epochs = take(iter(s), dupe + 1)
    import pyarrow.ipc as ipc

    shard0 = ipc.open_stream(
        str(dataset / index.raw["splits"]["train"]["shards"][0]["file"])
    ).read_all()
    for e, b in enumerate(epochs[:dupe]):
        row0 = b["sample_id"].tolist().index(0)
        predicted = torch.nonzero(b["labels"][row0] != IGNORE).flatten().tolist()
        assert predicted == shard0["mask_positions"][0][e].as_py()
        assert b["input_ids"][row0, predicted].tolist() == shard0["mask_inputs"][0][e].as_py()
        assert b["labels"][row0, predicted].tolist() == shard0["mask_labels"][0][e].as_py()
    assert torch.equal(
        epochs[dupe]["labels"], epochs[0]["labels"]
    )  # epoch dupe_factor reuses copy 0
    assert not torch.equal(epochs[1]["labels"], epochs[0]["labels"])


@pytest.mark.parametrize("whole_word", [False, True])
def test_dynamic_masks_are_seeded_per_sample_and_epoch(dataset, whole_word):
    index = read_index(dataset)
    spec = MaskingSpec("dynamic", whole_word=whole_word)
    n = 24
    a = take(iter(stream(index, batch_size=n, masking=spec)), 2)
    b = take(iter(stream(index, batch_size=6, masking=spec, rank=0, world_size=1)), 8)
    by_id = {}
    for batch in b:
        for i, uid in enumerate(batch["sample_id"].tolist()):
            by_id.setdefault(uid, []).append(batch["labels"][i][batch["attention_mask"][i] == 1])
    for e in range(2):
        for i, uid in enumerate(a[e]["sample_id"].tolist()):
            mine = a[e]["labels"][i][a[e]["attention_mask"][i] == 1]
            assert torch.equal(mine, by_id[uid][e])  # independent of batch size and composition
    differs = sum(not torch.equal(x[0], x[1]) for x in by_id.values())
    assert differs >= 20, "dynamic masking must re-mask every epoch"
    labels, inputs, mask = a[0]["labels"], a[0]["input_ids"], a[0]["attention_mask"]
    predicted = labels != IGNORE
    content = (mask == 1) & (a[0]["input_ids"] != 2) & (a[0]["input_ids"] != SEP)
    rate = predicted.sum().item() / content.sum().item()
    assert 0.10 < rate < 0.22
    assert (inputs[predicted] == MASK).float().mean() > 0.6


def test_truncation_to_a_shorter_seq_len_keeps_sep(dataset):
    index = read_index(dataset)
    for b in take(iter(stream(index, seq_len=12)), 4):
        ids, lengths = b["input_ids"], b["attention_mask"].sum(1)
        assert ids.shape[1] <= 12
        assert bool((ids[torch.arange(len(ids)), lengths - 1] == SEP).all())
        assert bool((b["labels"][torch.arange(len(ids)), lengths - 1] == IGNORE).all())


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
    from train.config import DataArgs
    from train.data import validation_stream

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


def test_format_reader_is_beam_free(tmp_path):
    """The trainer reads a local dataset through pipeline.format without importing Beam."""
    import subprocess
    import sys

    root = write_dataset(tmp_path / "data")
    code = (
        "import sys, train.data; from pipeline.format import read_index, load_shard; "
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
    from pipeline.format import reader
    from pipeline.format.store import configure, current
    from train.config import DataArgs
    from train.data import validation_stream

    monkeypatch.setattr("pipeline.format.store.settings._current", None)  # restored after
    configure(current().replace(cache_dir=str(tmp_path / "node-cache")))
    hashed = []
    real = reader.sha256_file
    monkeypatch.setattr(
        reader, "sha256_file", lambda path, *a: hashed.append(path) or real(path, *a)
    )
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


def test_rows_are_shuffled_within_windows_of_record_batches():
    """A reader needs one window's record batches at a time, never a whole shard (EpochOrder)."""
    from train.data import SHUFFLE_WINDOW, EpochOrder

    rows, b = [5120, 2900], 256  # 20 whole blocks; 11 whole ones and a short one
    order = EpochOrder(rows, seed=7, shuffle=True, block_rows=b)
    again = EpochOrder(rows, seed=7, shuffle=True, block_rows=b)
    for epoch in range(2):
        shard_of, row_of = order.locate(epoch, np.arange(sum(rows)))
        np.testing.assert_array_equal(row_of, again.locate(epoch, np.arange(sum(rows)))[1])
        for s, n in enumerate(rows):
            seq = row_of[shard_of == s]
            assert sorted(seq) == list(range(n)) and list(seq) != sorted(seq)
            window = SHUFFLE_WINDOW * b
            for lo in range(0, n if s == 0 else 0, window):  # whole blocks: windows align
                assert len(np.unique(seq[lo : lo + window] // b)) <= SHUFFLE_WINDOW
    first = order.locate(0, np.arange(5000))[1]
    assert not np.array_equal(first, order.locate(1, np.arange(5000))[1])
    plain = EpochOrder(rows, seed=7, shuffle=False, block_rows=b)
    np.testing.assert_array_equal(plain.locate(0, np.arange(5000))[1], np.arange(5000))


def test_record_batches_are_located_by_their_headers_and_decoded_one_at_a_time(tmp_path):
    """open_shard reads message headers only; a block is one record batch; damage is named."""
    import pyarrow as pa

    from pipeline.format.reader import open_shard

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
    from pipeline.format.blocks import BlockReader

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
