"""The order: which global rows make step s, slot k, on any world size.

The training stream is one endless sequence of samples, epoch after epoch. Epoch e visits every
row once: the shards in an order drawn from (seed, e), the rows of each shard by windows of its
record batches (`EpochOrder`). Global stream position q (samples consumed since the run began)
is sample q mod N of epoch q div N. An optimizer step of A micro-batches of B rows on each of W
ranks consumes the next W·A·B positions: micro-batch a of rank r takes slot v = a·W + r, i.e.
the positions start + v, start + v + W·A, ... (with A = 1: rank r takes start + r,
start + r + W, ...). So a step's micro-batches are the same rows on 2 ranks × 1 micro-batch as
on 1 rank × 2, and a run resumed on another world size with the same global batch trains on the
same batches. DataLoader worker w of K builds local batches w, w + K, ..., which the DataLoader
interleaves back into order (`local_batches`). So ranks and workers never overlap, no sample is
skipped (batches may straddle epochs), and a resume from position q starts exactly at the next
sample: the state is one integer, saved in every checkpoint (`StreamPosition`).

Everything here is arithmetic on the seed and the row counts: no file is read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shatter.shards import DatasetError


def cut_factor(stored_len: int, seq_len: int) -> int:
    """k: the pieces each stored row is cut into when training at `seq_len` below the data's
    `stored_len` (L // l; 1 = a length above L/2 truncates, as it did before cutting)."""
    return max(1, stored_len // seq_len)


def cut(q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Global stream positions of a cut stream -> (stored-row positions, piece numbers).

    Cut by k, an epoch has k·N positions and position q is piece q mod k of stored position
    q div k: a row's pieces are consecutive positions (read from one record batch, the same
    batch or the next), and since (e·k·N + o) div k = e·N + o div k, the stored rows keep the
    order, epochs and shuffle of the uncut stream. A resumed or re-sized run finds its rows
    from the one integer, as before."""
    return q // k, q % k


def cut_by_shard(order: EpochOrder, q: np.ndarray, k: int) -> Iterator[tuple]:
    """(epoch, indices into q, shard, rows, piece numbers, k) for each (epoch, shard) that the
    positions q of `order`'s stream cut by k touch (`cut`; the epoch is the stored rows')."""
    stored, piece = cut(q, k)
    for epoch, where, s, rows in order.by_shard(stored):
        yield epoch, where, s, rows, piece[where], k


SHUFFLE_WINDOW = 4  # record batches whose rows are shuffled together (blocks.CACHE_BLOCKS is twice)


@dataclass(frozen=True)
class StreamPosition:
    """Where the training stream stands: `samples` consumed since the run began, all ranks together."""

    samples: int
    epoch_size: int  # rows of the train split (of every mixed dataset together)
    mix: tuple[tuple[int, float], ...] | None = None  # mixed datasets: (rows, weight) of each

    @property
    def epoch(self) -> int:
        return self.samples // self.epoch_size

    @property
    def in_epoch(self) -> int:
        return self.samples % self.epoch_size

    def to_dict(self) -> dict:
        state = {
            "samples": self.samples,
            "epoch": self.epoch,
            "in_epoch": self.in_epoch,
            "epoch_size": self.epoch_size,
        }
        if self.mix is not None:
            state["mix"] = [[rows, weight] for rows, weight in self.mix]
        return state

    @classmethod
    def from_dict(cls, state: dict, epoch_size: int, mix=None) -> StreamPosition:
        if state["epoch_size"] != epoch_size:
            raise DatasetError(
                f"the checkpoint's data position is for a train split of {state['epoch_size']} rows, "
                f"the data now has {epoch_size}: resuming on different data cannot be exact"
            )
        mix = None if mix is None else tuple((int(r), float(w)) for r, w in mix)
        saved = state.get("mix")
        saved = None if saved is None else tuple((int(r), float(w)) for r, w in saved)
        if saved != mix:
            raise DatasetError(
                f"the checkpoint's data position is for datasets of (rows, weight) {saved}, the "
                f"run now mixes {mix}: resuming on other datasets or weights cannot be exact"
            )
        return cls(samples=int(state["samples"]), epoch_size=epoch_size, mix=mix)


@dataclass(frozen=True)
class Slots:
    """Which global stream positions one rank's micro-batches hold (see the module docstring)."""

    rank: int
    world: int
    batch_size: int
    grad_accum: int = 1
    start: int = 0
    end: int | None = None  # a finite stream stops before this position

    def positions(self, j: int) -> np.ndarray:
        """Global positions of this rank's local batch j (micro-batch j mod A of step j div A)."""
        W, A, B = self.world, self.grad_accum, self.batch_size
        step, micro = divmod(j, A)
        q = self.start + step * W * A * B + micro * W + self.rank + W * A * np.arange(B)
        return q if self.end is None else q[q < self.end]

    def local_batches(self, worker: int = 0, workers: int = 1) -> Iterator[np.ndarray]:
        """Positions of local batches j = worker, worker + workers, ...

        A finite stream gives every rank as many batches as rank 0, which has the most: a rank
        whose rows ran out gets an empty array instead (a padding batch, `ShardStream`), so a
        loop of collectives over it (a ZeRO-3 forward gathers the weights) ends on every rank
        at the same batch."""
        per = self.world * self.batch_size
        batches = None if self.end is None else -(-(self.end - self.start) // per)
        j = worker
        while batches is None or j < batches:
            yield self.positions(j)
            j += workers


class EpochOrder:
    """The permutation of (shard, row) pairs for each epoch, derived from the seed alone.

    Epoch e visits the shards in the order permutation(seed, e). Within shard s, its blocks of
    `block_rows` rows (its record batches) are visited in the order permutation(seed, e, s), and
    the rows of each window of `SHUFFLE_WINDOW` consecutive blocks in that order are shuffled
    among themselves: a reader then needs a window's record batches at a time, never the whole
    shard. Rows are sorted by a hash of their content in a shard, so a block is already a random
    sample of the shard's rows.
    """

    def __init__(self, rows_per_shard: list[int], seed: int, shuffle: bool, block_rows: int):
        self.rows = np.asarray(rows_per_shard, dtype=np.int64)
        self.base = np.concatenate(
            [[0], np.cumsum(self.rows)]
        )  # canonical sample id = base[s] + row
        self.size = int(self.base[-1])
        self.seed, self.shuffle, self.block_rows = seed, shuffle, block_rows
        self._orders, self._row_perms = OrderedDict(), OrderedDict()

    def shards(self, epoch: int):
        """(order, start): the epoch's shard order and each slot's first in-epoch offset."""
        if epoch not in self._orders:
            n = len(self.rows)
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._orders[epoch] = order, np.concatenate([[0], np.cumsum(self.rows[order])])
            while len(self._orders) > 2:  # this epoch and the next (`next_shard`)
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def _row_perm(self, epoch: int, shard: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        key = (epoch, shard)
        if key not in self._row_perms:
            rng = np.random.default_rng([self.seed, epoch, shard])
            n, b = int(self.rows[shard]), self.block_rows
            blocks = rng.permutation(-(-n // b))
            perm = np.empty(n, np.int64)
            at = 0
            for w in range(0, len(blocks), SHUFFLE_WINDOW):  # O(window) temporaries
                rows = np.concatenate(
                    [np.arange(k * b, min(n, (k + 1) * b)) for k in blocks[w : w + SHUFFLE_WINDOW]]
                )
                perm[at : at + len(rows)] = rows[rng.permutation(len(rows))]
                at += len(rows)
            self._row_perms[key] = perm
            while len(self._row_perms) > 4:  # a few shards' worth: not the whole split's rows
                self._row_perms.popitem(last=False)
        self._row_perms.move_to_end(key)
        return self._row_perms[key]

    def next_shard(self, epoch: int, shard: int) -> int:
        """The shard read after `shard` (the next epoch's first after the last)."""
        order, _ = self.shards(epoch)
        slot = int(np.flatnonzero(order == shard)[0])
        if slot + 1 < len(order):
            return int(order[slot + 1])
        return int(self.shards(epoch + 1)[0][0])

    def locate(self, epoch: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) arrays for in-epoch offsets of one epoch."""
        order, start = self.shards(epoch)
        slot = np.searchsorted(start, offsets, side="right") - 1
        shard = order[slot]
        row = offsets - start[slot]
        for s in np.unique(shard):
            perm = self._row_perm(epoch, int(s))
            if perm is not None:
                hit = shard == s
                row[hit] = perm[row[hit]]
        return shard, row

    def by_shard(self, q: np.ndarray) -> Iterator[tuple[int, np.ndarray, int, np.ndarray]]:
        """(epoch, indices into q, shard, rows) for each (epoch, shard) that positions q touch."""
        epoch_of, offset = q // self.size, q % self.size
        for epoch in np.unique(epoch_of):
            in_epoch = np.flatnonzero(epoch_of == epoch)
            shard_of, row_of = self.locate(int(epoch), offset[in_epoch])
            for s in np.unique(shard_of):
                hit = shard_of == s
                yield int(epoch), in_epoch[hit], int(s), row_of[hit]
