"""Reading shards: whole tables (`read_shard`), and the trainer's form, one record batch at a
time (`open_shard` -> `ShardFile.block`) or a whole shard (`load_shard`).

The trainer never decodes a shard whole. `open_shard` locates the shard's record batches by
reading only the IPC stream's message headers (each message's flatbuffer metadata gives its body
length and row count), so opening costs a few KB of reads whatever the shard's size; then
`ShardFile.block(i)` reads record batch i's bytes with one positioned read and decodes them (zstd
forces a copy, so a memory map would only add the pages it touched to the process's RSS) into
flat numpy arrays plus Arrow offsets (`Shard`), so that a batch is gathered with a few vectorised
numpy calls instead of per-row Python. A record batch is at most about 2**18 ids
(`writer.record_batch_rows`), so a reader's memory does not grow with the shard. Like MosaicML
streaming's reader, a shard's sha256 is checked against index.json before its first use, here
streamed in 4 MB chunks, once per node (`store.verified`); that pass also takes each record
batch's sha256, and every read of a record batch hashes the bytes it read against it, so a shard
that rots after its check stops the reader naming the shard and the record batch.

A `ShardFile` holds its file open and reads it by `pread` on that descriptor: a shard from the
node cache stays readable (and pinned against eviction) until the ShardFile is closed or
collected.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from shatter.shards.schema import REQUIRED_COLUMNS, DatasetError, ShardInfo
from shatter.shards.store import fs


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with fs.open_read(str(path)) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_shard(path: str) -> pa.Table:
    """A whole shard as an Arrow table."""
    path = str(path)
    if fs.is_remote(path):
        with fs.open_read(path) as f:
            return ipc.open_stream(f).read_all()
    with pa.memory_map(path) as source:
        return ipc.open_stream(source).read_all()


def _lists(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n+1], flat values) of a list column, zero-copy where Arrow allows."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values
    return offsets - offsets[0], values


@dataclass(frozen=True)
class Shard:
    """One decoded shard. Row r has ids[ids_off[r]:ids_off[r+1]]; its static masking c is the
    mask list number masks_outer[r] + c, whose positions are mask_pos[masks_inner[j]:masks_inner[j+1]]."""

    path: str  # the shard file
    info: ShardInfo
    ids_off: np.ndarray  # int64 [rows + 1]
    ids: np.ndarray  # uint16 or int32 [tokens]
    word_start: np.ndarray  # bool [tokens]
    masks_outer: np.ndarray  # int64 [rows + 1], into masks_inner
    masks_inner: np.ndarray  # int64 [rows * dupe_factor + 1], into mask_pos / mask_lab / mask_inp
    mask_pos: np.ndarray  # uint16 positions into the row
    mask_lab: np.ndarray  # original ids at those positions
    mask_inp: np.ndarray  # what the model sees there

    @property
    def rows(self) -> int:
        return len(self.ids_off) - 1


def _missing(path: str) -> DatasetError:
    return DatasetError(f"shard {path} listed in index.json is missing; rebuild or restore it")


def _corrupted(path: str) -> DatasetError:
    return DatasetError(
        f"shard {path} is corrupted: its sha256 differs from index.json; rebuild or restore it"
    )


def _read_whole(path: str, info: ShardInfo, verify: bool) -> bytes:
    """A shard's bytes, their sha256 checked against index.json (with `verify`) as they are read."""
    try:
        with fs.open_read(path) as f:
            data = f.read()
    except FileNotFoundError:
        raise _missing(path) from None
    if verify and hashlib.sha256(data).hexdigest() != info.sha256:
        raise _corrupted(path)
    return data


def _columns(table: pa.Table | pa.RecordBatch, path: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in table.schema.names]
    if missing:
        raise DatasetError(f"shard {path}: missing column(s) {missing}")


def load_shard(path: str, info: ShardInfo, verify: bool = True) -> Shard:
    """A whole shard decoded at once (tools and tests; the trainer reads `open_shard`'s blocks)."""
    path = str(path)
    data = _read_whole(path, info, verify)
    try:
        table = ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"shard {path}: not a readable Arrow IPC stream ({err})") from None
    _columns(table, path)
    if table.num_rows != info.rows:
        raise DatasetError(f"shard {path}: {table.num_rows} rows, index.json says {info.rows}")
    return _decode(table, path, info)


def _decode(table: pa.Table | pa.RecordBatch, path: str, info: ShardInfo) -> Shard:
    """Columns of a table or one record batch as flat numpy arrays and rebased offsets."""
    ids_off, ids = _lists(table["input_ids"])
    _, ws = _lists(table["word_start"])
    outer, pos_lists = _lists(table["mask_positions"])
    inner, pos = _lists(pos_lists)
    _, lab_lists = _lists(table["mask_labels"])
    _, inp_lists = _lists(table["mask_inputs"])
    return Shard(
        path=path,
        info=info,
        ids_off=ids_off,
        ids=ids.to_numpy(),
        word_start=ws.to_numpy(zero_copy_only=False).astype(bool),
        masks_outer=outer,
        masks_inner=inner,
        mask_pos=pos.to_numpy(),
        mask_lab=lab_lists.values.to_numpy(),
        mask_inp=inp_lists.values.to_numpy(),
    )


# Arrow IPC stream framing: each message is 0xFFFFFFFF, an int32 metadata length, a flatbuffer
# `Message` (fields: version, header_type, header, bodyLength), then bodyLength bytes of body;
# 0xFFFFFFFF 0 ends the stream. A `RecordBatch` header's field 0 is its row count.
_CONTINUATION, _RECORD_BATCH, _SCHEMA = 0xFFFFFFFF, 3, 1


def _field(buf: bytes, table: int, i: int) -> int | None:
    """Position of field i of the flatbuffer table at `table`, None if absent (default)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    size = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * i >= size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0]
    return table + offset if offset else None


def _header(meta: bytes) -> tuple[int, int, int]:
    """(header type, body length, rows) of a flatbuffer `Message`; rows only for record batches."""
    root = struct.unpack_from("<I", meta, 0)[0]
    at = _field(meta, root, 1)
    kind = meta[at] if at is not None else 0
    at = _field(meta, root, 3)
    body = struct.unpack_from("<q", meta, at)[0] if at is not None else 0
    rows = 0
    at = _field(meta, root, 2)
    if kind == _RECORD_BATCH and at is not None:
        batch = at + struct.unpack_from("<I", meta, at)[0]
        at = _field(meta, batch, 0)
        rows = struct.unpack_from("<q", meta, at)[0] if at is not None else 0
    return kind, body, rows


class ShardFile:
    """One shard's record batches, located by their message headers and decoded one at a time.

    `offsets[i]`, `sizes[i]`: where record batch i's whole message lies in the file;
    `row_start[i]`: its first row (int64 [batches + 1], the last entry is the shard's rows).
    """

    def __init__(self, path: str, info: ShardInfo, fd: int, schema_, offsets, sizes, row_start):
        self.path, self.info, self.fd, self.schema = path, info, fd, schema_
        self.offsets, self.sizes, self.row_start = offsets, sizes, row_start
        self.digests: list[bytes] | None = None  # each record batch's sha256, once verified

    def close(self) -> None:
        """Release the file (and its pin in the node cache); also when collected."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        self.close()

    @property
    def batches(self) -> int:
        return len(self.offsets)

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Record batch of each row."""
        return np.searchsorted(self.row_start, rows, side="right") - 1

    def block(self, i: int) -> Shard:
        """Record batch i, decoded (rows numbered from 0 within it)."""
        try:
            data = os.pread(self.fd, int(self.sizes[i]), int(self.offsets[i]))
            if self.digests is not None and hashlib.sha256(data).digest() != self.digests[i]:
                raise DatasetError(
                    f"shard {self.path}: record batch {i} is corrupted (its sha256 differs from "
                    "the one taken when the whole file matched index.json: the disk changed it "
                    "since); rebuild the dataset or fetch the shard again"
                )
            message = pa.ipc.read_message(pa.py_buffer(data))
            batch = pa.ipc.read_record_batch(message, self.schema)
        except (pa.ArrowInvalid, OSError) as err:
            raise DatasetError(
                f"shard {self.path}: record batch {i} is not readable ({err}); rebuild or restore it"
            ) from None
        if batch.num_rows != self.row_start[i + 1] - self.row_start[i]:
            raise DatasetError(f"shard {self.path}: record batch {i} disagrees with its header")
        return _decode(batch, self.path, self.info)


def _scan(fd: int, path: str) -> tuple:
    """(schema, record batch offsets, sizes, rows, end) of the IPC stream on `fd`, from its
    message headers alone (positioned reads)."""
    offsets, sizes, rows, schema_ = [], [], [], None
    pos = 0
    while True:
        prefix = os.pread(fd, 8, pos)
        if len(prefix) < 8:
            break  # a stream without its end marker still ends at the file's end
        word, length = struct.unpack("<Ii", prefix)
        head = 8
        if word != _CONTINUATION:  # the pre-1.0 framing: the length alone
            length, head = word, 4
        if length == 0:
            break
        meta = os.pread(fd, length, pos + head)
        kind, body, n = _header(meta)
        size = head + length + body
        if kind == _SCHEMA:
            schema_ = pa.ipc.read_schema(pa.py_buffer(prefix[:head] + meta))
        elif kind == _RECORD_BATCH:
            offsets.append(pos)
            sizes.append(size)
            rows.append(n)
        else:
            raise DatasetError(f"shard {path}: unexpected IPC message type {kind}")
        pos += size
    return schema_, offsets, sizes, rows, pos


def _open(path: str, info: ShardInfo) -> tuple[str, int]:
    """(local path, open descriptor) of a shard; a remote one is its node-local copy, whose
    sha256 was checked on download, pinned in the node cache while the descriptor is open."""
    if fs.is_remote(path):
        from shatter.shards.store.cache import NodeCache

        return NodeCache().open(path, info.sha256)
    try:
        return path, os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _missing(path) from None


def _hash_blocks(fd: int, offsets: list[int], sizes: list[int]) -> tuple[str, list[str]]:
    """In one streamed pass over the file: (its sha256, [the sha256 of the bytes before the
    first record batch (the schema), then each record batch's])."""
    whole, head, blocks, pos = hashlib.sha256(), hashlib.sha256(), [], 0
    for start, size in [*zip(offsets, sizes), (os.fstat(fd).st_size, 0)]:
        # before the first record batch: the schema (`head`); after the last: the end marker
        _feed(fd, pos, start, whole, *([head] if pos == 0 else []))
        block = hashlib.sha256()
        _feed(fd, start, start + size, whole, block)
        blocks.append(block.hexdigest())
        pos = start + size
    return whole.hexdigest(), [head.hexdigest(), *blocks[:-1]]


def _feed(fd: int, start: int, end: int, *digests, chunk: int = 1 << 22) -> None:
    while start < end:
        data = os.pread(fd, min(chunk, end - start), start)
        if not data:
            break
        for digest in digests:
            digest.update(data)
        start += len(data)


def _verify(path: str, info: ShardInfo, fd: int, offsets: list[int], sizes: list[int]) -> list:
    """Each record batch's sha256, for its reads to check: taken in the pass that checked the
    whole shard's against index.json (once per node, `store.verified`). The schema's bytes,
    which every open reads, are checked here."""
    from shatter.shards.store.verified import block_digests

    parts = block_digests(path, info.sha256, lambda: _hash_blocks(fd, offsets, sizes))
    if parts is None or len(parts) != len(offsets) + 1:
        raise _corrupted(path)
    head = os.pread(fd, offsets[0] if offsets else os.fstat(fd).st_size, 0)
    if hashlib.sha256(head).hexdigest() != parts[0]:
        raise _corrupted(path)
    return [bytes.fromhex(d) for d in parts[1:]]


def open_shard(path: str, info: ShardInfo, verify: bool = True) -> ShardFile:
    """The one way the trainer opens a shard file (a local path, or a URL through the node
    cache): checks it exists and (optionally) its sha256, and locates its record batches from
    their headers without reading or decoding their bodies. The file stays open (`ShardFile`).
    A shard whose headers do not parse is checked for corruption first, which it then is."""
    path, fd = _open(str(path), info)
    try:
        try:
            schema_, offsets, sizes, rows, pos = _scan(fd, path)
        except (struct.error, IndexError, pa.ArrowInvalid, OSError) as err:
            if verify and _hash_blocks(fd, [], [])[0] != info.sha256:
                raise _corrupted(path) from None
            raise DatasetError(f"shard {path}: not a readable Arrow IPC stream ({err})") from None
        digests = _verify(path, info, fd, offsets, sizes) if verify else None
        if schema_ is None:
            raise DatasetError(f"shard {path}: not an Arrow IPC stream (no schema message)")
        if pos > os.fstat(fd).st_size:
            raise DatasetError(f"shard {path}: truncated (a record batch ends past the file's end)")
        _columns(schema_.empty_table(), path)
        row_start = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        if row_start[-1] != info.rows:
            raise DatasetError(f"shard {path}: {row_start[-1]} rows, index.json says {info.rows}")
    except BaseException:
        os.close(fd)
        raise
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    file = ShardFile(path, info, fd, schema_, offsets, sizes, row_start)
    file.digests = digests
    return file
