"""The shard sink: Packed rows → balanced, key-sorted, masked Arrow shards (the shard, mask and write steps).

Workers spill key-sorted rows (key, length and padded ids only) to temporary Arrow IPC files with
a histogram of their keys; the summed histograms give balanced key ranges (`shatter.pipeline.sharding`); each shard's
writer reads its range of every spill, sorts it, adds the `dupe_factor` static maskings chunk by
chunk (`transforms.mask_table`) and writes one file through `pipeline.ShardWriter` (temp +
rename). Masking last keeps the sorts and spills cheap: until it is written, a row is a key, a
length and a fixed-width id array (sorted with numpy, spilled and read back without copies),
and a chunk's masks exist only while it is written.
Only file names and histograms go through a GroupByKey, never rows: Beam's local runners hold a
GroupByKey's whole input in memory. Each writer also leaves its shard's ShardInfo in the work
directory (`read_manifest`), from which the driver writes index.json: no step of the pipeline
gathers them. Pattern: Beam's `fileio.WriteToFiles` (temp files, then
finalise), with MosaicML streaming's shard writer.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems

from shatter.pipeline import sharding, tokenizer
from shatter.pipeline.transforms import MaskSpec, Packed, counter, mask_table
from shatter.shards import schema, shard_name
from shatter.shards.writer import ROWS_PER_RECORD_BATCH, ShardWriter


@dataclass(frozen=True)
class Spill:
    """A key-sorted temporary Arrow IPC file of one split's rows, with its key histogram (sparse)."""

    split: str
    path: str
    rows: int
    buckets: np.ndarray  # distinct key buckets (ascending) ...
    counts: np.ndarray  # ... and their row counts
    tokens: int = 0  # ids of its rows (the split's size decides its shard count)


SPILL_BATCH_ROWS = 4096  # record batch size of spill files, so a key range is read batch by batch
MAX_SHARD_IDS = (
    2**31 - 1
)  # Arrow list offsets are int32: a reader combining a shard's batches overflows past this


MANIFEST_DIR = "shards"  # in the work directory: one JSON ShardInfo per shard written


def manifest_path(work_dir: str, name: str) -> str:
    return FileSystems.join(work_dir, MANIFEST_DIR, f"{name}.json")


def read_manifest(work_dir: str) -> list[dict]:
    """The ShardInfo (with split and shard) of every shard that `WriteShardFn` wrote."""
    pattern = FileSystems.join(work_dir, MANIFEST_DIR, "*.json")
    entries = []
    for found in FileSystems.match([pattern])[0].metadata_list:
        with FileSystems.open(found.path, compression_type="uncompressed") as f:
            entries.append(json.loads(f.read()))
    return entries


def spill_table(keys: np.ndarray, ids: np.ndarray, lengths: np.ndarray) -> pa.Table:
    """Padded rows as an Arrow table (key, length, fixed-size ids), zero-copy from the arrays."""
    return pa.Table.from_arrays(
        [
            pa.array(keys, type=pa.uint64()),
            pa.array(lengths, type=pa.int32()),
            pa.FixedSizeListArray.from_arrays(
                pa.array(ids.reshape(-1), type=pa.int32()), ids.shape[1]
            ),
        ],
        names=["key", "length", "ids"],
    )


def spill_arrays(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of spill_table: (keys, ids [n, width], lengths)."""
    ids = table["ids"].combine_chunks()
    flat = ids.flatten().to_numpy(zero_copy_only=False)
    return (
        table["key"].to_numpy(),
        flat.reshape(len(table), ids.type.list_size),
        table["length"].to_numpy(),
    )


def stack_padded(arrays: list[np.ndarray]) -> np.ndarray:
    """Padded id arrays of possibly different widths, stacked at the widest (padding is 0, [PAD]).
    Masks and keys do not depend on the width (`masking.mask_batch`, `transforms.row_keys`)."""
    width = max(a.shape[1] for a in arrays)
    return np.concatenate(
        [a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays]
    )


class SpillFn(beam.DoFn):
    """Packed → Spill files of at most about `spill_rows` rows, sorted by key."""

    def __init__(self, work_dir: str, spill_rows: int):
        self.work_dir, self.spill_rows = work_dir, spill_rows

    def setup(self):
        self.spilled = counter("spill_files")

    def start_bundle(self):
        self.buffers: dict[str, list[Packed]] = {}
        self.buffered: dict[str, int] = {}  # rows per split in `buffers`

    def process(self, packed: Packed):
        self.buffers.setdefault(packed.split, []).append(packed)
        self.buffered[packed.split] = self.buffered.get(packed.split, 0) + len(packed.keys)
        if self.buffered[packed.split] >= self.spill_rows:
            yield self._flush(packed.split)

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        for split in sorted(self.buffers):
            if self.buffers[split]:
                yield WindowedValue(self._flush(split), 0, [GlobalWindow()])

    def _flush(self, split: str) -> Spill:
        packed = self.buffers.pop(split)
        self.buffered.pop(split)
        keys = np.concatenate([p.keys for p in packed])
        lengths = np.concatenate([p.lengths for p in packed])
        ids = stack_padded([p.ids for p in packed])
        del packed  # the buffered rows: two copies at most while sorting (stacked, sorted)
        order = sharding.sort_order(keys)
        table = spill_table(keys[order], ids[order], lengths[order])
        del ids
        uniq, counts = np.unique(sharding.buckets(keys[order]), return_counts=True)
        path = FileSystems.join(self.work_dir, f"spill-{uuid.uuid4().hex}.arrow")
        with FileSystems.create(path) as f, pa.ipc.new_file(f, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=SPILL_BATCH_ROWS):
                writer.write_batch(batch)
        self.spilled.inc()
        return Spill(split, path, table.num_rows, uniq, counts, int(lengths.sum()))


def spill_histogram(spill: Spill):
    """(split, dense histogram) for the boundary computation."""
    hist = np.zeros(sharding.N_BUCKETS, dtype=np.int64)
    hist[spill.buckets] = spill.counts
    return spill.split, hist


def spill_pieces(spill: Spill, edges: dict):
    """((split, shard), (path, start, stop)): which rows of a spill file go to which shard."""
    cuts = sharding.shard_cuts(spill.buckets, spill.counts, edges[spill.split])
    for shard in range(len(cuts) - 1):
        if cuts[shard + 1] > cuts[shard]:
            yield (spill.split, shard), (spill.path, int(cuts[shard]), int(cuts[shard + 1]))


def read_piece(path: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows [start, stop) of a spill file as (keys, ids, lengths), reading only the record batches
    that hold them, copied out: a slice would keep its whole batches alive, and a shard reads a
    piece of every spill (memory that grew with the number of spills, i.e. with the corpus)."""
    with FileSystems.open(path, compression_type="uncompressed") as f:
        reader = pa.ipc.open_file(f)
        first, last = start // SPILL_BATCH_ROWS, (stop - 1) // SPILL_BATCH_ROWS
        table = pa.Table.from_batches([reader.get_batch(i) for i in range(first, last + 1)])
    rows = table.slice(start - first * SPILL_BATCH_ROWS, stop - start)
    return tuple(np.array(a, copy=True) for a in spill_arrays(rows))


class WriteShardFn(beam.DoFn):
    """The pieces of one shard → merged in key order → masked → one Arrow IPC stream file (temp +
    rename); then its ShardInfo in the work directory's manifest (`read_manifest`), also output."""

    def __init__(self, out: str, work_dir: str, mask: MaskSpec, batch_rows: int):
        self.out, self.work_dir, self.mask = out, work_dir, mask
        self.batch_rows = (
            batch_rows  # rows masked at a time: one record batch, so bytes never depend on it
        )

    def setup(self):
        with FileSystems.open(self.mask.model_path) as f:
            encoder = tokenizer.encoder(self.mask.model_path, f.read())
        self.vocab_size = encoder.vocab_size
        self.word_start = encoder.word_start_table()  # None: flags on the ids
        self.masked, self.written = counter("masked_positions"), counter("shards_written")

    def process(self, element, counts):
        (split, shard), pieces = element
        arrays = [read_piece(*p) for p in sorted(p for p in pieces if p is not None)]
        name = shard_name(split, shard, counts[split])
        with ShardWriter(self.out, name, schema(self.vocab_size), self.batch_rows) as writer:
            if arrays:  # spills may differ in width
                keys, lengths = (np.concatenate([a[i] for a in arrays]) for i in (0, 2))
                ids = stack_padded([a[1] for a in arrays])
                del arrays
                if int(lengths.sum()) > MAX_SHARD_IDS:
                    more = counts[split] * -(-int(lengths.sum()) // MAX_SHARD_IDS) * 2
                    raise ValueError(
                        f"shatter-data input error: {name} would hold {int(lengths.sum())} ids, more "
                        f"than an Arrow list column can index ({MAX_SHARD_IDS}); rebuild with more "
                        f"shards (e.g. {'--num-shards' if split == 'train' else '--num-validation-shards'}"
                        f" {more})"
                    )
                order = sharding.sort_order(keys)
                keys, ids, lengths = keys[order], ids[order], lengths[order]
                pa.default_memory_pool().release_unused()  # the merged copy, freed above: back to the OS
                for lo in range(0, len(keys), self.batch_rows):
                    part = slice(lo, lo + self.batch_rows)
                    chunk = mask_table(
                        keys[part],
                        ids[part],
                        lengths[part],
                        self.word_start,
                        self.vocab_size,
                        self.mask,
                    )
                    writer.write(chunk)
                    self.masked.inc(
                        len(
                            pa.compute.list_flatten(
                                pa.compute.list_flatten(chunk["mask_positions"])
                            )
                        )
                    )
        info = {"split": split, "shard": shard, "count": counts[split]}
        info.update(dataclasses.asdict(writer.info))
        with FileSystems.create(manifest_path(self.work_dir, name)) as f:  # a retry rewrites it
            f.write(json.dumps(info).encode())
        self.written.inc()
        yield info


class ShardAndWrite(beam.PTransform):
    """Packed rows → balanced, key-sorted, masked shards on disk → one dict per shard written
    (also left in `work_dir`'s manifest, `read_manifest`). `counts`: shards per split, where
    None (or 0) means sized by `size` from the split's rows and tokens."""

    def __init__(
        self,
        out: str,
        work_dir: str,
        counts: dict,
        mask: MaskSpec,
        spill_rows: int,
        size: sharding.ShardSize | None = None,
        batch_rows: int = ROWS_PER_RECORD_BATCH,
    ):
        super().__init__()
        self.out, self.work_dir, self.counts, self.size = out, work_dir, counts, size
        self.mask, self.spill_rows, self.batch_rows = mask, spill_rows, batch_rows

    def expand(self, tables):
        spills = tables | "spill" >> beam.ParDo(SpillFn(self.work_dir, self.spill_rows))
        counts = (
            spills
            | "sizes" >> beam.Map(lambda spill: (spill.split, (spill.rows, spill.tokens)))
            | "sum sizes" >> beam.CombinePerKey(sharding.sum_sizes)
            | "sizes by split" >> beam.combiners.ToDict()
            | "shard counts" >> beam.Map(sharding.shard_counts, self.counts, self.size)
        )
        edges = (
            spills
            | "histogram" >> beam.Map(spill_histogram)
            | "sum histograms"
            >> beam.CombinePerKey(lambda hists: sum(hists, np.zeros(sharding.N_BUCKETS, np.int64)))
            | "boundaries"
            >> beam.Map(
                lambda split_hist, n: (
                    split_hist[0],
                    sharding.balanced_boundaries(split_hist[1], n[split_hist[0]]),
                ),
                n=beam.pvalue.AsSingleton(counts),
            )
        )
        pieces = spills | "pieces" >> beam.FlatMap(spill_pieces, edges=beam.pvalue.AsDict(edges))
        every_shard = counts | "every shard" >> beam.FlatMap(
            lambda n: [((split, i), None) for split, k in n.items() for i in range(k)]
        )
        return (
            (pieces, every_shard)
            | "with empty shards" >> beam.Flatten()
            | "group pieces" >> beam.GroupByKey()
            | "mask and write"
            >> beam.ParDo(
                WriteShardFn(self.out, self.work_dir, self.mask, self.batch_rows),
                counts=beam.pvalue.AsSingleton(counts),
            )
        )
