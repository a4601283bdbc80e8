"""The shard sink: (split, table) batches → balanced, key-sorted Arrow shards (the shard + write steps).

Workers spill key-sorted rows to temporary Arrow IPC files with a histogram of their keys; the
summed histograms give balanced key ranges (`pipeline.sharding`); each shard's writer reads its
range of every spill and writes one file through `pipeline.shards.ShardWriter` (temp + rename).
Only file names and histograms go through a GroupByKey, never rows: Beam's local runners hold a
GroupByKey's whole input in memory. Pattern: Beam's `fileio.WriteToFiles` (temp files, then
finalise), with MosaicML streaming's shard writer.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems

from pipeline import sharding, shards
from pipeline.transforms import counter


@dataclass(frozen=True)
class Spill:
    """A key-sorted temporary Arrow IPC file of one split's rows, with its key histogram (sparse)."""

    split: str
    path: str
    rows: int
    buckets: np.ndarray  # distinct key buckets (ascending) ...
    counts: np.ndarray  # ... and their row counts


SPILL_BATCH_ROWS = 4096  # record batch size of spill files, so a key range is read batch by batch


class SpillFn(beam.DoFn):
    """(split, table) → Spill files of at most about `spill_rows` rows, sorted by key."""

    def __init__(self, work_dir: str, spill_rows: int):
        self.work_dir, self.spill_rows = work_dir, spill_rows

    def setup(self):
        self.spilled = counter("spill_files")

    def start_bundle(self):
        self.buffers: dict[str, list[pa.Table]] = {}

    def process(self, element):
        split, table = element
        buffer = self.buffers.setdefault(split, [])
        buffer.append(table)
        if sum(t.num_rows for t in buffer) >= self.spill_rows:
            yield self._flush(split)

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for split in sorted(self.buffers):
            if self.buffers[split]:
                yield WindowedValue(self._flush(split), 0, [GlobalWindow()])

    def _flush(self, split: str) -> Spill:
        table = pa.concat_tables(self.buffers.pop(split))
        keys = table["key"].to_numpy()
        table = table.take(sharding.sort_order(keys))
        uniq, counts = np.unique(sharding.buckets(table["key"].to_numpy()), return_counts=True)
        path = FileSystems.join(self.work_dir, f"spill-{uuid.uuid4().hex}.arrow")
        with FileSystems.create(path) as f, pa.ipc.new_file(f, table.schema) as writer:
            for batch in table.combine_chunks().to_batches(max_chunksize=SPILL_BATCH_ROWS):
                writer.write_batch(batch)
        self.spilled.inc()
        return Spill(split, path, table.num_rows, uniq, counts)


def spill_histogram(spill: Spill):
    """(split, dense histogram) for the boundary computation."""
    hist = np.zeros(sharding.N_BUCKETS, dtype=np.int64)
    hist[spill.buckets] = spill.counts
    return spill.split, hist


def spill_pieces(spill: Spill, edges: dict):
    """((split, shard), (path, start, stop)): which rows of a spill file go to which shard."""
    cum = np.concatenate([[0], np.cumsum(spill.counts)])
    cuts = cum[np.searchsorted(spill.buckets, edges[spill.split], side="left")]
    for shard in range(len(cuts) - 1):
        if cuts[shard + 1] > cuts[shard]:
            yield (spill.split, shard), (spill.path, int(cuts[shard]), int(cuts[shard + 1]))


def read_piece(path: str, start: int, stop: int) -> pa.Table:
    """Rows [start, stop) of a spill file, reading only the record batches that hold them."""
    with FileSystems.open(path, compression_type="uncompressed") as f:
        reader = pa.ipc.open_file(f)
        first, last = start // SPILL_BATCH_ROWS, (stop - 1) // SPILL_BATCH_ROWS
        table = pa.Table.from_batches([reader.get_batch(i) for i in range(first, last + 1)])
    return table.slice(start - first * SPILL_BATCH_ROWS, stop - start)


class WriteShardFn(beam.DoFn):
    """The pieces of one shard → merged in key order → one Arrow IPC stream file (temp + rename)."""

    def __init__(self, out: str, counts: dict, vocab_size: int):
        self.out, self.counts, self.vocab_size = out, counts, vocab_size

    def process(self, element):
        (split, shard), pieces = element
        tables = [read_piece(*p) for p in sorted(p for p in pieces if p is not None)]
        table = pa.concat_tables(tables) if tables else pa.Table.from_pylist([], schema=shards.schema(self.vocab_size))
        table = table.take(sharding.sort_order(table["key"].to_numpy()))
        name = shards.shard_name(split, shard, self.counts[split])
        info = shards.write_shard(self.out, name, table, self.vocab_size)
        counter("shards_written").inc()
        yield {"split": split, "shard": shard, **dataclasses.asdict(info)}


class ShardAndWrite(beam.PTransform):
    """(split, table) batches → balanced, key-sorted shards on disk → one dict per shard written."""

    def __init__(self, out: str, work_dir: str, counts: dict, vocab_size: int, spill_rows: int):
        super().__init__()
        self.out, self.work_dir, self.counts = out, work_dir, counts
        self.vocab_size, self.spill_rows = vocab_size, spill_rows

    def expand(self, tables):
        counts = self.counts
        spills = tables | "spill" >> beam.ParDo(SpillFn(self.work_dir, self.spill_rows))
        edges = (
            spills
            | "histogram" >> beam.Map(spill_histogram)
            | "sum histograms" >> beam.CombinePerKey(lambda hists: sum(hists, np.zeros(sharding.N_BUCKETS, np.int64)))
            | "boundaries" >> beam.MapTuple(lambda split, hist: (split, sharding.balanced_boundaries(hist, counts[split])))
        )
        pieces = spills | "pieces" >> beam.FlatMap(spill_pieces, edges=beam.pvalue.AsDict(edges))
        every_shard = tables.pipeline | "every shard" >> beam.Create(
            [((split, i), None) for split, n in counts.items() for i in range(n)])
        return (
            (pieces, every_shard)
            | "with empty shards" >> beam.Flatten()
            | "group pieces" >> beam.GroupByKey()
            | "write" >> beam.ParDo(WriteShardFn(self.out, counts, self.vocab_size))
        )
