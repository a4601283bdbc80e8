"""Reading shards: whole tables (`read_shard`), and the trainer's decoded form (`load_shard`).

A shard is decoded once into flat numpy arrays plus Arrow offsets (`Shard`), so that a batch is
gathered with a few vectorised numpy calls instead of per-row Python. Like MosaicML streaming's
reader, each shard's sha256 is checked against index.json before its first use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from pipeline.format import fs
from pipeline.format.schema import REQUIRED_COLUMNS, DatasetError, ShardInfo


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


def load_shard(path: str, info: ShardInfo, verify: bool = True) -> Shard:
    """Check (optionally) the sha256, read the Arrow stream and decode its columns in bulk."""
    path = str(path)
    if not fs.exists(path):
        raise DatasetError(f"shard {path} listed in index.json is missing; rebuild or restore it")
    if verify and sha256_file(path) != info.sha256:
        raise DatasetError(
            f"shard {path} is corrupted: its sha256 differs from index.json; rebuild or restore it"
        )
    try:
        table = read_shard(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"shard {path}: not a readable Arrow IPC stream ({err})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DatasetError(f"shard {path}: missing column(s) {missing}")
    if table.num_rows != info.rows:
        raise DatasetError(f"shard {path}: {table.num_rows} rows, index.json says {info.rows}")
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
