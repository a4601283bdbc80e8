"""Streaming the shard dataset into masked-LM batches: an IterableDataset with an exact position.

The training stream is one endless sequence of samples, epoch after epoch. Epoch e visits every
row once: the shards in an order drawn from (seed, e), the rows of each shard by windows of its
record batches (`EpochOrder`), read one record batch at a time (`pipeline.format.blocks`: a
worker's memory does not grow with the shard size). Global stream position q (samples consumed
since the run began) is sample q mod N of epoch q div N. An optimizer step of A micro-batches of
B rows on each of W ranks consumes the next W·A·B positions: micro-batch a of rank r takes slot
v = a·W + r, i.e. the positions start + v, start + v + W·A, ... (with A = 1: rank r takes
start + r, start + r + W, ...). So a step's micro-batches are the same rows on 2 ranks × 1
micro-batch as on 1 rank × 2, and a run resumed on another world size with the same global batch
trains on the same batches. Its DataLoader worker w of K builds local batches w, w + K, ...,
which the DataLoader interleaves back into order. So ranks and workers never overlap, no sample is skipped (batches may straddle
epochs), and a resume from position q starts exactly at the next sample: the state is one integer,
saved in every checkpoint (`StreamPosition`), and resuming reads only the rows it needs.

Like MosaicML streaming (deterministic sample-space partitioning, resumable position) and
academic-budget-bert (static masks with a dupe factor, dynamic masking option).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.format import DatasetError, Index, Shard
from pipeline.format.blocks import BlockReader
from pipeline.format.store import is_remote
from pipeline.format.writer import record_batch_rows
from train.masking import IGNORE, PAD, SEP, dynamic_mask, ragged_gather, static_mask
from train.plm import plm_batch, static_plm_batch


@dataclass(frozen=True)
class StreamPosition:
    """Where the training stream stands: `samples` consumed since the run began, all ranks together."""

    samples: int
    epoch_size: int  # rows of the train split

    @property
    def epoch(self) -> int:
        return self.samples // self.epoch_size

    @property
    def in_epoch(self) -> int:
        return self.samples % self.epoch_size

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "epoch": self.epoch,
            "in_epoch": self.in_epoch,
            "epoch_size": self.epoch_size,
        }

    @classmethod
    def from_dict(cls, state: dict, epoch_size: int) -> StreamPosition:
        if state["epoch_size"] != epoch_size:
            raise DatasetError(
                f"the checkpoint's data position is for a train split of {state['epoch_size']} rows, "
                f"the data now has {epoch_size}: resuming on different data cannot be exact"
            )
        return cls(samples=int(state["samples"]), epoch_size=epoch_size)


@dataclass(frozen=True)
class MaskingSpec:
    mode: str  # "static" or "dynamic"
    fixed_copy: int | None = None  # static: always this stored masking (validation uses 0)
    mask_prob: float = 0.15
    whole_word: bool = False
    objective: str = "mlm"  # "plm": targets and a factorisation order instead (train/plm.py)
    plm_targets: str = "spans"
    plm_ratio: int = 6
    plm_max_span: int = 5


# a batch's key, present when a look-ahead download from the object store failed for good: its
# one-line message; the step loop stops at the next step boundary (a checkpoint) and reports it
STORE_ERROR = "store_error"
SHUFFLE_WINDOW = 4  # record batches whose rows are shuffled together (blocks.CACHE_BLOCKS is twice)


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


class ShardStream(IterableDataset):
    """Batches (named dicts of tensors) of one rank's share of a split; see the module docstring."""

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
    ):
        if seq_len > index.seq_len:
            raise DatasetError(
                f"--seq-len {seq_len} exceeds the data's seq_len {index.seq_len} ({index.path})"
            )
        self.index, self.shards = index, index.shards(split)
        self.batch_size, self.seq_len, self.masking = batch_size, seq_len, masking
        self.seed, self.rank, self.world, self.start = seed, rank, world_size, start
        self.grad_accum = grad_accum
        self.finite, self.verify = finite, verify
        block_rows = index.raw.get("record_batch_rows") or record_batch_rows(index.seq_len)
        self.order = EpochOrder([s.rows for s in self.shards], seed, shuffle, int(block_rows))
        total = self.order.size if max_samples is None else min(max_samples, self.order.size)
        self.end = start + total if finite else None  # finite streams stop after one pass
        self._reader, self._pid = None, None

    def __getstate__(self):  # a spawned DataLoader worker makes its own reader and threads
        return {**self.__dict__, "_reader": None, "_pid": None}

    @property
    def reader(self) -> BlockReader:
        """This process's reader: a forked DataLoader worker starts its own (and its threads)."""
        if self._pid != os.getpid():
            paths = [self.index.shard_path(info) for info in self.shards]
            self._reader, self._pid = BlockReader(paths, self.shards, self.verify), os.getpid()
        return self._reader

    def local_batches(self):
        """Global positions of this rank's local batch j, for j = worker, worker + workers, ...

        A finite stream gives every rank as many batches as rank 0, which has the most: a rank
        whose rows ran out gets an empty array instead (a padding batch, see `__iter__`), so a
        loop of collectives over it (a ZeRO-3 forward gathers the weights) ends on every rank
        at the same batch."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        per = self.world * self.batch_size
        batches = None if self.end is None else -(-(self.end - self.start) // per)
        j = worker
        W, A, B = self.world, self.grad_accum, self.batch_size
        while batches is None or j < batches:
            step, micro = divmod(j, A)
            q = self.start + step * W * A * B + micro * W + self.rank + W * A * np.arange(B)
            yield q if self.end is None else q[q < self.end]
            j += workers

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

    def _locate(self, q: np.ndarray):
        """(epoch, positions in q, shard, rows) for each (epoch, shard) that positions q touch."""
        epoch_of, offset = q // self.order.size, q % self.order.size
        for epoch in np.unique(epoch_of):
            in_epoch = np.flatnonzero(epoch_of == epoch)
            shard_of, row_of = self.order.locate(int(epoch), offset[in_epoch])
            for s in np.unique(shard_of):
                hit = shard_of == s
                yield int(epoch), in_epoch[hit], int(s), row_of[hit]

    def prefetch(self, q: np.ndarray) -> None:
        """Start decoding what the batch of positions q needs, and opening the shard after it
        (from a store: the two after it; a download that fails for good is named in the next
        batch, under STORE_ERROR)."""
        for epoch, _, s, rows in self._locate(q):
            self.reader.prefetch(s, rows)
            ahead = self.order.next_shard(epoch, s)
            self.reader.open_ahead(ahead)
            if is_remote(self.index.root):
                self.reader.open_ahead(self.order.next_shard(epoch, ahead))

    def padding_batch(self) -> dict[str, torch.Tensor]:
        """One row of zero weight: the stream's first row with nothing to predict (labels all
        IGNORE) and sample_id -1. It runs the same forward as a real batch and adds nothing to
        a metric's sums."""
        batch = self.batch(np.array([self.start]))
        batch["labels"].fill_(IGNORE)
        batch["sample_id"].fill_(-1)
        return batch

    def _gather(self, shard: Shard, rows: np.ndarray):
        idx, valid = ragged_gather(shard.ids_off, rows)
        length = valid.sum(1)
        L = self.seq_len
        if idx.shape[1] > L:  # truncation to --seq-len: keep [CLS] … and end with [SEP]
            idx, valid = idx[:, :L], valid[:, :L]
            cut = length > L
            length = np.minimum(length, L)
        else:
            cut = None
        ids = np.where(valid, shard.ids[idx], PAD).astype(np.int64)
        word_start = valid & shard.word_start[idx]
        if cut is not None and cut.any():
            ids[cut, L - 1] = SEP
        return ids, word_start, length

    def batch(self, q: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of global stream positions q: padded to its longest row."""
        B = len(q)
        m = self.masking
        stored = m.plm_targets == "static" if m.objective == "plm" else m.mode == "static"
        parts, gathered = [], {}
        for epoch, where, s, shard_rows in self._locate(q):
            for block, rows, hit in self.reader.rows(s, shard_rows):
                ids, ws, length = self._gather(block, rows)
                uid = self.order.base[s] + shard_rows[hit]
                if stored:  # the record batch's stored masks
                    inputs, labels, *rank = self._mask(ids, ws, length, uid, block, rows, epoch)
                    parts.append((where[hit], inputs, labels, length, uid, epoch, rank))
                else:  # masks from (seed, epoch, uid) alone: one call per epoch, not per block
                    gathered.setdefault(epoch, []).append((where[hit], ids, ws, length, uid))
        for epoch, pieces in gathered.items():
            where, ids, ws, length, uid = _stack(pieces)
            inputs, labels, *rank = self._mask(ids, ws, length, uid, None, None, epoch)
            parts.append((where, inputs, labels, length, uid, epoch, rank))
        L = max(p[1].shape[1] for p in parts)
        input_ids = np.full((B, L), PAD, np.int64)
        labels = np.full((B, L), IGNORE, np.int64)
        lengths, uids, epochs = np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64)
        rank = np.full((B, L), -1, np.int64) if parts[0][6] else None  # plm: perm_rank
        for where, inp, lab, length, uid, epoch, part_rank in parts:
            input_ids[where, : inp.shape[1]] = inp
            labels[where, : lab.shape[1]] = lab
            lengths[where], uids[where], epochs[where] = length, uid, epoch
            if rank is not None:
                rank[where, : inp.shape[1]] = part_rank[0]
        attention_mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.int64)
        extra = {"perm_rank": torch.from_numpy(rank)} if rank is not None else {}
        return {
            **extra,
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention_mask),
            "labels": torch.from_numpy(labels),
            "sample_id": torch.from_numpy(uids),  # canonical row id: base of its shard + row
            "epoch": torch.from_numpy(epochs),
        }

    def _mask(self, ids, ws, length, uid, shard, rows, epoch):
        m = self.masking
        if m.objective == "plm":
            return self._plm(ids, length, uid, shard, rows, epoch)
        if m.mode == "static":
            copy = m.fixed_copy if m.fixed_copy is not None else epoch % self.index.dupe_factor
            return static_mask(ids, length, shard, rows, copy)
        return dynamic_mask(
            ids,
            length,
            ws,
            uid,
            epoch=epoch,
            seed=self.seed,
            vocab_size=self.index.vocab_size,
            mask_prob=m.mask_prob,
            whole_word=m.whole_word,
        )

    def _plm(self, ids, length, uid, shard, rows, epoch):
        """(ids, labels, perm_rank) of the permutation LM (train/plm.py)."""
        m = self.masking
        if m.plm_targets == "static":
            copy = m.fixed_copy if m.fixed_copy is not None else epoch % self.index.dupe_factor
            return static_plm_batch(
                ids, length, shard, rows, copy, uid, epoch=epoch, seed=self.seed
            )
        return plm_batch(
            ids,
            length,
            uid,
            epoch=epoch,
            seed=self.seed,
            ratio=m.plm_ratio,
            max_span=m.plm_max_span,
        )


def _stack(pieces):
    """(where, ids, word_start, length, uid) of several gathers, padded to the widest."""
    if len(pieces) == 1:
        return pieces[0]
    n, L = sum(len(p[0]) for p in pieces), max(p[1].shape[1] for p in pieces)
    ids, ws = np.full((n, L), PAD, np.int64), np.zeros((n, L), bool)
    at = 0
    for _, part_ids, part_ws, *_ in pieces:
        k, w = part_ids.shape
        ids[at : at + k, :w], ws[at : at + k, :w] = part_ids, part_ws
        at += k
    where, length, uid = (np.concatenate([p[i] for p in pieces]) for i in (0, 3, 4))
    return where, ids, ws, length, uid


def _plm_fields(d) -> dict:
    return dict(
        objective=d.objective or "mlm",
        plm_targets=d.plm_targets,
        plm_ratio=d.plm_ratio,
        plm_max_span=d.plm_max_span,
    )


def masking_spec(data_args) -> MaskingSpec:
    d = data_args
    return MaskingSpec(d.masking, None, d.mask_prob, d.whole_word, **_plm_fields(d))


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
) -> DataLoader:
    """The endless training DataLoader of one rank, starting at global stream position `start`,
    `grad_accum` micro-batches a step (`pin_memory` on a GPU: page-locked batches, copied with
    `non_blocking=True`)."""
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
        masking=MaskingSpec("static", fixed_copy=0, **_plm_fields(data_args)),
        seed=0,
        rank=rank,
        world_size=world_size,
        shuffle=False,
        finite=True,
        max_samples=data_args.eval_samples,
        verify=data_args.verify_shards,
    )
