"""Writing shards: a context manager that writes to a temporary name and renames on success,
recording bytes, rows, tokens and sha256 (MosaicML streaming's writer), and the vectorised
construction of a shard's table from packed rows and their maskings."""

from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shatter.shards.schema import ShardInfo, id_type, schema
from shatter.shards.store import fs

if TYPE_CHECKING:
    from shatter.pipeline.masking import MaskedBatch

ROWS_PER_RECORD_BATCH = (
    1024  # at most; fixed per seq_len, so bytes never depend on how rows arrived
)
RECORD_BATCH_IDS = 1 << 18  # ids per record batch at most: about 2 MB once decoded (reader.py)
IPC_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)


def record_batch_rows(seq_len: int) -> int:
    """Rows per record batch at rows of up to `seq_len` ids: a reader decodes one record batch at
    a time, so its size bounds the reader's memory whatever the shard's size (1024 at 256)."""
    return max(1, min(ROWS_PER_RECORD_BATCH, RECORD_BATCH_IDS // seq_len))


def _numpy_type(typ: pa.DataType) -> type:
    """The numpy dtype of an id or position type (pyarrow's to_pandas_dtype would import pandas,
    which the core install, and so a remote Beam worker, does not have)."""
    return {pa.uint16(): np.uint16, pa.int32(): np.int32}[typ]


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
    # every pa.array gets its type (untyped, pyarrow 25 infers it element by element), and numpy
    # casts first, so that pa.array is zero-copy
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), type=pa.int32())
    outer = pa.array(np.arange(len(lengths) + 1, dtype=np.int32) * dupe_factor, type=pa.int32())
    inner = pa.array(masks.offsets.astype(np.int32), type=pa.int32())

    def nested(values, typ):
        values = pa.array(np.asarray(values).astype(_numpy_type(typ)), type=typ)
        return pa.ListArray.from_arrays(outer, pa.ListArray.from_arrays(inner, values))

    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(keys, dtype=np.uint64), type=pa.uint64()),
            pa.ListArray.from_arrays(
                offsets, pa.array(np.asarray(flat_ids).astype(_numpy_type(ids_t)), type=ids_t)
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

    def __init__(
        self, out: str, name: str, schema_: pa.Schema, batch_rows: int = ROWS_PER_RECORD_BATCH
    ):
        self.out, self.name, self.schema, self.batch_rows = out, name, schema_, batch_rows
        self.final = fs.join(out, name)
        self.temp = fs.join(out, f".tmp-{uuid.uuid4().hex}-{name}")
        self.rows = self.tokens = 0
        self.info: ShardInfo | None = None

    def __enter__(self) -> ShardWriter:
        self._file = _HashingFile(fs.create(self.temp))
        self._writer = pa.ipc.new_stream(self._file, self.schema, options=IPC_OPTIONS)
        return self

    def write(self, table: pa.Table) -> None:
        table = table.select(self.schema.names).cast(self.schema)
        for batch in table.to_batches(max_chunksize=self.batch_rows):
            self._writer.write_batch(batch)
        self.rows += table.num_rows
        self.tokens += int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._file.close()
            fs.delete(self.temp)
            return
        self._writer.close()
        self._file.close()
        fs.rename(self.temp, self.final)
        self.info = ShardInfo(
            self.name, self.rows, self.tokens, self._file.size, self._file.sha.hexdigest()
        )


def write_shard(out: str, name: str, table: pa.Table, vocab_size: int) -> ShardInfo:
    """Write `table`, already in its final row order, as one shard; return its ShardInfo."""
    with ShardWriter(out, name, schema(vocab_size)) as writer:
        # record batches of a fixed size: the bytes never depend on how the table was chunked
        writer.write(table.combine_chunks())
    return writer.info
