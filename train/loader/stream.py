"""The stream: one rank's share of a split read as batches, through `shatter.shards`.

`ShardStream` asks the order (`shatter.train.loader.order`) which rows its next batches hold, reads
their record batches one at a time (`shatter.shards.blocks`: a worker's memory does not grow
with the shard size) while the next batch's blocks and the next shards are read ahead, and
hands the rows to the collate (`shatter.train.loader.collate`). A dataset in an object store is read
through the node's cache (`shatter.shards.store`); a download that fails for good reaches the
trainer in-band, in the next batch under STORE_ERROR. Like MosaicML streaming: deterministic
sample-space partitioning and a resumable position.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shatter.shards import DatasetError, Index
from shatter.shards.blocks import BlockReader
from shatter.shards.store import is_remote
from shatter.shards.writer import record_batch_rows
from shatter.train.loader.collate import (
    Collator,
    MaskingSpec,
    gather,
    make_masker,
    masking_spec,
    validation_masking,
)
from shatter.train.loader.mix import MixedOrder
from shatter.train.loader.order import EpochOrder, Slots, cut_by_shard, cut_factor
from shatter.train.masking import IGNORE

# a batch's key, present when a download from the object store failed for good (its one-line
# message): the step loop stops at the next step boundary, with a checkpoint, and reports it
STORE_ERROR = "store_error"
# a rank waits on its loader's workers this share of run.collective_timeout_s at most, so that a
# stuck worker is said by its own rank before its peers' collectives time out waiting on that rank
LOADER_WAIT_SHARE = 0.75


class ShardStream(IterableDataset):
    """Batches (named dicts of tensors) of one rank's share of a split; see `shatter.train.loader.order`
    for which rows each batch holds."""

    def __init__(
        self,
        index: Index,
        split: str,
        *,
        batch_size: int,
        seq_len: int,
        masking: MaskingSpec,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start: int = 0,
        grad_accum: int = 1,
        shuffle: bool = True,
        finite: bool = False,
        max_samples: int | None = None,
        verify: bool = True,
        mix: Sequence[tuple[Index, float]] | None = None,
    ):
        indexes = [index] if mix is None else [ix for ix, _ in mix]
        for ix in indexes:
            if seq_len > ix.seq_len:
                raise DatasetError(
                    f"--seq-len {seq_len} exceeds the data's seq_len {ix.seq_len} ({ix.path})"
                )
        # each stored row: k rows of the stream (mixed: each dataset's own, `MixedOrder.cuts`)
        self.k = cut_factor(index.seq_len, seq_len)
        self.index = index
        self.shards = tuple(info for ix in indexes for info in ix.shards(split))
        self.paths = [ix.shard_path(info) for ix in indexes for info in ix.shards(split)]
        self.remote = any(is_remote(ix.root) for ix in indexes)
        self.batch_size, self.seq_len, self.masking = batch_size, seq_len, masking
        self.seed, self.rank, self.world, self.start = seed, rank, world_size, start
        self.grad_accum = grad_accum
        self.finite, self.verify = finite, verify
        orders = [
            EpochOrder(
                [s.rows for s in ix.shards(split)],
                seed,
                shuffle,
                int(ix.raw.get("record_batch_rows") or record_batch_rows(ix.seq_len)),
            )
            for ix in indexes
        ]
        # several datasets: global positions drawn from them by weight, each cut by its own
        # k (`shatter.train.loader.mix`)
        cuts = [cut_factor(ix.seq_len, seq_len) for ix in indexes]
        self.order = (
            orders[0] if mix is None else MixedOrder(orders, [w for _, w in mix], seed, cuts)
        )
        size = self.order.size * self.k if mix is None else self.order.size
        total = size if max_samples is None else min(max_samples, size)
        self.end = start + total if finite else None  # finite streams stop after one pass
        self.slots = Slots(rank, world_size, batch_size, grad_accum, start, self.end)
        masker = make_masker(  # stored masks: the copies every source has
            masking,
            seed=seed,
            dupe_factor=min(ix.dupe_factor for ix in indexes),
            vocab_size=index.vocab_size,
        )
        self.collate = Collator(masker)
        self._reader, self._pid = None, None

    def __getstate__(self):  # a spawned DataLoader worker makes its own reader and threads
        return {**self.__dict__, "_reader": None, "_pid": None}

    @property
    def reader(self) -> BlockReader:
        """This process's reader: a forked DataLoader worker starts its own (and its threads)."""
        if self._pid != os.getpid():
            self._reader, self._pid = BlockReader(self.paths, self.shards, self.verify), os.getpid()
        return self._reader

    def local_batches(self):
        """Global positions of this rank's local batches that this DataLoader worker builds."""
        info = get_worker_info()
        return self.slots.local_batches(*((info.id, info.num_workers) if info else (0, 1)))

    def __iter__(self):
        batches = self.local_batches()
        q = next(batches, None)
        while q is not None:
            ahead = next(batches, None)
            if ahead is not None and len(ahead):
                self.prefetch(ahead)
            batch = self.batch(q) if len(q) else self.padding_batch()
            failure = self.reader.store_failure()
            if failure:  # a look-ahead download failed: the trainer stops at a step boundary
                batch[STORE_ERROR] = failure
            yield batch
            q = ahead

    def prefetch(self, q: np.ndarray) -> None:
        """Start decoding what the batch of positions q needs, and opening the shard after it
        (from a store: the two after it; one that fails for good is named in the next batch)."""
        for epoch, _, s, rows, _, _ in self.by_shard(q):
            self.reader.prefetch(s, rows)
            ahead = self.order.next_shard(epoch, s)
            self.reader.open_ahead(ahead)
            if self.remote:
                self.reader.open_ahead(self.order.next_shard(epoch, ahead))

    def padding_batch(self) -> dict[str, torch.Tensor]:
        """One row of zero weight: the stream's first row with nothing to predict (labels all
        IGNORE) and sample_id -1. It runs the same forward as a real batch and adds nothing to
        a metric's sums."""
        batch = self.batch(np.array([self.start]))
        batch["labels"].fill_(IGNORE)
        batch["predicted"] = batch["predicted"][:0]
        batch["sample_id"].fill_(-1)
        return batch

    def pieces(self, q: np.ndarray):
        """The unmasked `Piece`s of the rows at global positions q, one per record batch read."""
        for epoch, where, s, shard_rows, piece, k in self.by_shard(q):
            for block, rows, hit in self.reader.rows(s, shard_rows):
                uid, at = self.order.base[s] + shard_rows[hit], where[hit]
                yield gather(
                    block, rows, self.seq_len, where=at, uid=uid, epoch=epoch,
                    piece=piece[hit], k=k,
                )  # fmt: skip

    def by_shard(self, q: np.ndarray):
        """(epoch, indices into q, shard, rows, piece numbers, k) for each (epoch, shard)
        that global positions q touch: one dataset's stream cut by k, or the mixture's."""
        if isinstance(self.order, MixedOrder):
            return self.order.by_shard(q)
        return cut_by_shard(self.order, q, self.k)

    def batch(self, q: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of global stream positions q: padded to its longest row."""
        return self.collate(self.pieces(q), len(q))


def train_loader(
    index: Index,
    data_args,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    rank: int,
    world_size: int,
    start: int,
    grad_accum: int = 1,
    pin_memory: bool = False,
    mix: Sequence[tuple[Index, float]] | None = None,
) -> DataLoader:
    """The endless training DataLoader of one rank, starting at global stream position `start`,
    `grad_accum` micro-batches a step (`pin_memory` on a GPU: page-locked batches, copied with
    `non_blocking=True`); with `mix`, of several datasets drawn by weight (`shatter.train.loader.mix`)."""
    stream = ShardStream(
        index,
        "train",
        batch_size=batch_size,
        seq_len=seq_len,
        masking=masking_spec(data_args),
        seed=seed,
        rank=rank,
        world_size=world_size,
        start=start,
        grad_accum=grad_accum,
        shuffle=data_args.shuffle,
        verify=data_args.verify_shards,
        mix=mix,
    )
    workers = data_args.num_workers
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
        pin_memory=pin_memory,
    )


class WorkerBatches:
    """A training DataLoader's batches, in order. With workers, the wait for each batch after
    the first (which waits for the workers' start and their first shards) is bounded by
    `timeout_s`, through DataLoader's own timeout: a worker that sends nothing for that long (a
    hung read, a deadlock) or dies (the OOM killer, at once) ends the run in one line naming the
    worker and the shards of the batch it owes, not as a peer's collective timeout. `close()`
    ends the workers now rather than at exit (blocked on their index queues, they would be
    joined)."""

    def __init__(self, loader: DataLoader, timeout_s: float):
        self.loader, self.timeout_s, self.received = loader, timeout_s, 0
        self.it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            batch = next(self.it)
        except RuntimeError as err:
            stuck = self.failure(str(err))
            if stuck is None:
                raise
            raise stuck from None
        if self.received == 0 and self.loader.num_workers:
            self.it._timeout = self.timeout_s  # DataLoader's `timeout`, read at each wait
        self.received += 1
        return batch

    def failure(self, text: str) -> DatasetError | None:
        """The one-line error for DataLoader's own timeout or dead-worker message, else None."""
        timed_out = text.startswith("DataLoader timed out after")
        if not (timed_out or text.startswith("DataLoader worker (pid")):
            return None
        pids = [w.pid for w in getattr(self.it, "_workers", [])]
        # a timeout: the worker of the next batch (an endless stream's workers send in turn);
        # a death: the worker of the pid DataLoader names
        named = [int(p) for p in re.findall(r"\d+", text.partition(")")[0])]
        dead = next((pids.index(p) for p in named if p in pids), None)
        workers = self.loader.num_workers
        worker = self.received % workers if timed_out or dead is None else dead
        j = self.received + (worker - self.received) % workers  # the first batch it owes
        stream = self.loader.dataset
        shards = {stream.paths[s] for _, _, s, *_ in stream.by_shard(stream.slots.positions(j))}
        pid = pids[worker] if worker < len(pids) else "?"
        owed = f"loader worker {worker} (pid {pid}; the next batch it owes, {j}, reads "
        owed += f"{', '.join(sorted(shards))})"
        if timed_out:
            return DatasetError(
                f"{owed} sent no batch for {self.timeout_s:.0f} s: a "
                "stuck loader worker (a read of the data or its store that hangs; `py-spy dump "
                "--pid` shows where). If the data is that slow to read, raise "
                f"run.collective_timeout_s (a rank waits on its loader {LOADER_WAIT_SHARE:g} of it)"
            )
        return DatasetError(
            f"{owed} died ({text.rstrip('.')}): killed by the OOM killer or "
            "a signal (see `dmesg`); lower data.num_workers or the micro-batch if memory is short"
        )

    def close(self) -> None:
        shutdown = getattr(self.it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def validation_stream(
    index: Index, data_args, *, batch_size: int, seq_len: int, rank: int, world_size: int
) -> ShardStream:
    """The validation split in file order with the fixed static masks (copy 0): comparable across
    runs. With the permutation LM, its targets and orders drawn at seed 0, epoch 0 (or masks copy 0)."""
    return ShardStream(
        index,
        "validation",
        batch_size=batch_size,
        seq_len=seq_len,
        masking=validation_masking(data_args),
        seed=0,
        rank=rank,
        world_size=world_size,
        shuffle=False,
        finite=True,
        max_samples=data_args.eval_samples,
        verify=data_args.verify_shards,
    )
