"""The shard dataset layout of DESIGN.md: Arrow IPC stream shards (zstd) and `index.json`.

MosaicML streaming style (`streaming.base.format`): the shard writer is a context manager that
writes to a temporary name and renames on success, recording bytes, rows and sha256; `index.json`
is written last and atomically, and the reader checks its format and version. All I/O goes through
Beam's `FileSystems`, so `gs://` and other remote outputs work as local ones do.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from apache_beam.io.filesystems import FileSystems

from pipeline.index_format import (  # noqa: F401  (FORMAT, VERSION, DatasetError: re-exported)
    FORMAT,
    INDEX_FILE,
    TOKENIZER_FILE,
    VERSION,
    DatasetError,
    missing_index,
    parse_index,
)
from pipeline.masking import MaskedBatch

ROWS_PER_RECORD_BATCH = 1024  # fixed, so bytes never depend on how rows arrived
IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)


def id_type(vocab_size: int) -> pa.DataType:
    """uint16 ids while they fit, int32 beyond (DESIGN.md)."""
    return pa.uint16() if vocab_size <= 65535 else pa.int32()


def schema(vocab_size: int) -> pa.Schema:
    ids = id_type(vocab_size)
    return pa.schema(
        [
            ("key", pa.uint64()),  # the row's content key: shards are sorted by it
            ("input_ids", pa.list_(ids)),
            ("word_start", pa.list_(pa.bool_())),
            ("mask_positions", pa.list_(pa.list_(pa.uint16()))),
            ("mask_labels", pa.list_(pa.list_(ids))),
            ("mask_inputs", pa.list_(pa.list_(ids))),
        ]
    )


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.arrow"


def join(out: str, name: str) -> str:
    return FileSystems.join(out, name)


def rows_table(
    keys: np.ndarray,
    lengths: np.ndarray,
    flat_ids: np.ndarray,
    flat_word_start: np.ndarray,
    masks: MaskedBatch,
    dupe_factor: int,
    vocab_size: int,
) -> pa.Table:
    """One Arrow table from packed rows (flat ids and word starts, row lengths) and their
    `dupe_factor` maskings (vectorised, no per-row Python)."""
    ids_t = id_type(vocab_size)
    ids_np = (
        np.uint16 if ids_t == pa.uint16() else np.int32
    )  # numpy casts first: pa.array is then zero-copy
    # every pa.array gets its type: untyped, pyarrow 25 infers it element by element (slow)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    outer = pa.array(np.arange(len(lengths) + 1, dtype=np.int32) * dupe_factor, type=pa.int32())
    inner = pa.array(masks.offsets.astype(np.int32), type=pa.int32())

    def nested(values, typ):
        values = pa.array(np.asarray(values).astype(typ.to_pandas_dtype()), type=typ)
        return pa.ListArray.from_arrays(outer, pa.ListArray.from_arrays(inner, values))

    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(keys, dtype=np.uint64), type=pa.uint64()),
            pa.ListArray.from_arrays(
                offsets, pa.array(np.asarray(flat_ids).astype(ids_np), type=ids_t)
            ),
            pa.ListArray.from_arrays(
                offsets, pa.array(np.asarray(flat_word_start, bool), type=pa.bool_())
            ),
            nested(masks.positions, pa.uint16()),
            nested(masks.labels, ids_t),
            nested(masks.inputs, ids_t),
        ],
        schema=schema(vocab_size),
    )


@dataclass(frozen=True)
class ShardInfo:
    """What index.json records per shard."""

    file: str  # name relative to the dataset directory
    rows: int  # training sequences
    tokens: int  # ids, [CLS]/[SEP] included
    bytes: int  # file size
    sha256: str  # of the file's bytes


class _HashingFile:
    """A write-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, raw):
        self.raw, self.sha, self.size, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = bytes(data)
        self.sha.update(data)
        self.size += len(data)
        self.raw.write(data)
        return len(data)

    def flush(self):
        self.raw.flush()

    def close(self):
        if not self.closed:
            self.raw.close()
            self.closed = True


class ShardWriter:
    """`with ShardWriter(out, name, schema) as w: w.write(table)`: temp file, renamed on success.

    The final name appears only if the block completes; on an exception the temp file is removed.
    After the block, `w.info` is the shard's ShardInfo.
    """

    def __init__(self, out: str, name: str, schema_: pa.Schema):
        self.out, self.name, self.schema = out, name, schema_
        self.final = join(out, name)
        self.temp = join(out, f".tmp-{uuid.uuid4().hex}-{name}")
        self.rows = self.tokens = 0
        self.info: ShardInfo | None = None

    def __enter__(self) -> ShardWriter:
        self._file = _HashingFile(FileSystems.create(self.temp))
        self._writer = pa.ipc.new_stream(self._file, self.schema, options=IPC_OPTIONS)
        return self

    def write(self, table: pa.Table) -> None:
        table = table.select(self.schema.names).cast(self.schema)
        for batch in table.to_batches(max_chunksize=ROWS_PER_RECORD_BATCH):
            self._writer.write_batch(batch)
        self.rows += table.num_rows
        self.tokens += int(
            pa.compute.sum(pa.compute.list_value_length(table["input_ids"])).as_py() or 0
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._file.close()
            FileSystems.delete([self.temp])
            return
        self._writer.close()
        self._file.close()
        FileSystems.rename([self.temp], [self.final])
        self.info = ShardInfo(
            self.name, self.rows, self.tokens, self._file.size, self._file.sha.hexdigest()
        )


def write_shard(out: str, name: str, table: pa.Table, vocab_size: int) -> ShardInfo:
    """Write `table`, already in its final row order, as one shard; return its ShardInfo."""
    with ShardWriter(out, name, schema(vocab_size)) as writer:
        # record batches of a fixed size: the bytes never depend on how the table was chunked
        writer.write(table.combine_chunks())
    return writer.info


def read_shard(path: str) -> pa.Table:
    """A whole shard as an Arrow table."""
    with FileSystems.open(path) as f:
        return pa.ipc.open_stream(f).read_all()


def write_index(out: str, index: dict) -> None:
    """Write index.json atomically (temp + rename): its presence marks the dataset complete."""
    temp = join(out, f".tmp-{uuid.uuid4().hex}-{INDEX_FILE}")
    with FileSystems.create(temp) as f:
        f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    FileSystems.rename([temp], [join(out, INDEX_FILE)])


def read_index(out: str) -> dict:
    """The dataset's index.json, checked: a clear DatasetError if missing, incomplete or foreign."""
    path = join(out, INDEX_FILE)
    if not FileSystems.exists(path):
        raise missing_index(path, out)
    with FileSystems.open(path) as f:
        return parse_index(f.read(), path)


def shard_paths(out: str, split: str, index: dict | None = None) -> list[str]:
    """Full paths of a split's shards, in order."""
    index = index or read_index(out)
    return [join(out, s["file"]) for s in index["splits"].get(split, {}).get("shards", [])]
