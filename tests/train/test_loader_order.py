"""The loader's order (train/loader/order.py): which global rows make each step's micro-batches,
on any world size, accumulation and worker count; exact resume; the in-shard shuffle windows."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shatter.shards import DatasetError, read_index
from shatter.train.loader import SHUFFLE_WINDOW, EpochOrder, Slots, StreamPosition
from tests.train.loaderutil import stream, take


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


def test_rows_are_shuffled_within_windows_of_record_batches():
    """A reader needs one window's record batches at a time, never a whole shard (EpochOrder)."""
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


@pytest.mark.parametrize("start", [0, 5])
def test_slots_give_step_s_slot_k_the_same_positions_for_any_ranks_times_accumulation(start):
    """Without reading a file: slot a*W + r of step s holds the same positions for W*A = 4, and
    the steps cover their positions once, in order."""
    B, steps, layouts = 3, 3, {}
    for W, A in [(4, 1), (2, 2), (1, 4)]:
        slots = {}
        for r in range(W):
            local = Slots(rank=r, world=W, batch_size=B, grad_accum=A, start=start)
            for j in range(steps * A):
                step, micro = divmod(j, A)
                slots[step, micro * W + r] = local.positions(j).tolist()
        layouts[W, A] = slots
    assert layouts[4, 1] == layouts[2, 2] == layouts[1, 4]
    every = sorted(q for rows in layouts[4, 1].values() for q in rows)
    assert every == list(range(start, start + steps * 4 * B))


def test_workers_split_a_ranks_batches_and_a_finite_stream_pads_short_ranks():
    """Worker w of K builds local batches w, w+K, ...; a finite stream gives every rank rank 0's
    count of batches, empty where its rows ran out."""
    whole = Slots(rank=1, world=2, batch_size=2)
    alone = whole.local_batches()
    firsts = [next(alone).tolist() for _ in range(6)]
    workers = [whole.local_batches(w, 3) for w in range(3)]
    assert [next(workers[j % 3]).tolist() for j in range(6)] == firsts
    ranks = [list(Slots(r, 2, 2, start=3, end=8).local_batches()) for r in range(2)]
    assert [len(b) for b in ranks] == [2, 2]  # ceil(5 rows / (2 ranks x 2))
    assert [q.tolist() for q in ranks[0]] == [[3, 5], [7]]
    assert [q.tolist() for q in ranks[1]] == [[4, 6], []]  # an empty batch: padding


def test_positions_group_by_epoch_and_shard_as_located():
    """by_shard splits positions that straddle an epoch into (epoch, shard) groups whose rows are
    the ones `locate` gives, and every position lands in exactly one group."""
    order = EpochOrder([7, 5, 9, 3], seed=3, shuffle=True, block_rows=2)
    q = np.arange(20, 31)  # epoch 0's last 4 and epoch 1's first 7
    seen = np.zeros(len(q), int)
    for epoch, where, shard, rows in order.by_shard(q):
        seen[where] += 1
        assert set(q[where] // order.size) == {epoch}
        shard_of, row_of = order.locate(epoch, q[where] % order.size)
        assert set(shard_of) == {shard} and list(row_of) == list(rows)
    assert list(seen) == [1] * len(q)
