"""A loader worker's view of a split: its shards' record batches ("blocks"), decoded on demand
into a small bounded cache, with the next ones decoded ahead on background threads.

Memory does not grow with the shard size: a shard is opened by its headers alone
(`reader.open_shard`) and a block is decoded from one positioned read. At most `capacity`
decoded blocks are kept (least recently used evicted), plus one being decoded in the foreground
and one in the background, so a worker's loader memory is about (capacity + 2) x a decoded
record batch (about 2 MB at 2**18 ids), whatever the shards' size.

A worker keeps at most OPEN_SHARDS shards open (least recently opened closed first): an open
shard of the node cache is pinned against eviction, so what a worker pins stays bounded.

Two daemon threads work ahead: one opens shards (the sha256 of a whole file, streamed, is the
slow part), so the next shard is verified while the current one is read; one decodes the blocks
that the next batch will need. Like MosaicML streaming's per-worker shard prefetch, but per
record batch. The threads start in the process that reads (a DataLoader worker forks after the
stream is built), and die with it.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from shatter.shards.reader import ShardFile, open_shard
from shatter.shards.schema import ShardInfo
from shatter.shards.store.errors import StoreError

CACHE_BLOCKS = 8  # decoded record batches kept per worker: twice the loader's shuffle window
OPEN_SHARDS = 4  # the shard being read, the two opened ahead, and one a batch may straddle


class _Worker:
    """One daemon thread running submitted calls in order (a ThreadPoolExecutor's threads would
    hold up the process's exit until a queued sha256 finished)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            fn, args, future = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed to whoever waits on the future
                future.set_exception(err)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.jobs.put((fn, args, future))
        return future


class BlockReader:
    """Blocks of the shards at `paths` (with their index.json records `infos`), keyed by
    (shard, record batch); `verify` checks each shard's sha256 once, when it is opened."""

    def __init__(
        self,
        paths: list[str],
        infos: tuple[ShardInfo, ...],
        verify: bool,
        capacity: int = CACHE_BLOCKS,
    ):
        self.paths, self.infos, self.verify, self.capacity = paths, infos, verify, capacity
        self._lock = threading.Lock()
        self._files: OrderedDict[int, Future] = OrderedDict()  # opened (and verified) shards
        self._blocks: OrderedDict[tuple[int, int], Future] = OrderedDict()
        self._opener = self._decoder = None

    def _threads(self):
        if self._opener is None:
            self._opener, self._decoder = _Worker(), _Worker()
        return self._opener, self._decoder

    def open_ahead(self, shard: int) -> Future:
        """Start opening (and verifying) `shard` in the background; idempotent."""
        with self._lock:
            if shard not in self._files:
                opener, _ = self._threads()
                info = self.infos[shard]
                self._files[shard] = opener.submit(open_shard, self.paths[shard], info, self.verify)
                while len(self._files) > OPEN_SHARDS:  # closed once no block decode holds it
                    self._files.popitem(last=False)
            else:
                self._files.move_to_end(shard)
            return self._files[shard]

    def store_failure(self) -> str | None:
        """Why a shard open (its download from the object store, ahead or now) failed for good,
        if one did: the stream hands it to the trainer in-band, with its next batch."""
        with self._lock:
            opens = list(self._files.values())
        for future in opens:
            if future.done() and isinstance(future.exception(), StoreError):
                return str(future.exception())
        return None

    def file(self, shard: int) -> ShardFile:
        return self.open_ahead(shard).result()

    def _block(self, shard: int, block: int) -> Future:
        """The block's future; decoded here, in the calling thread, if nobody has started it."""
        key = (shard, block)
        with self._lock:
            future = self._blocks.get(key)
            owner = future is None
            if owner:
                future = self._blocks[key] = Future()
                while len(self._blocks) > self.capacity:
                    self._blocks.popitem(last=False)
            else:
                self._blocks.move_to_end(key)
        if owner:
            try:
                future.set_result(self.file(shard).block(block))
            except BaseException as err:
                future.set_exception(err)
        return future

    def rows(self, shard: int, rows: np.ndarray):
        """(block, local rows, positions in `rows`) for each record batch that `rows` touch."""
        file = self.file(shard)
        which = file.locate(rows)
        for k in np.unique(which):
            hit = np.flatnonzero(which == k)
            yield self._block(shard, int(k)).result(), rows[hit] - file.row_start[k], hit

    def _fill(self, shard: int, rows: np.ndarray) -> None:
        file = self.file(shard)
        for k in np.unique(file.locate(rows))[: self.capacity // 2]:
            self._block(shard, int(k))

    def prefetch(self, shard: int, rows: np.ndarray) -> None:
        """Decode in the background the blocks holding `rows` of `shard` (up to half the cache);
        nothing to hand over (a thread switch) when they are all cached or under way."""
        opened = self.open_ahead(shard)
        if opened.done() and not opened.exception():
            blocks = np.unique(opened.result().locate(rows))
            with self._lock:
                if all((shard, int(k)) in self._blocks for k in blocks):
                    return
        self._threads()[1].submit(self._fill, shard, rows)
