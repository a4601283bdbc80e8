"""Reading the shard dataset of `shatter-data build`: index.json, checksums, decoded columns.

The layout is fixed in DESIGN.md ("Shard dataset layout"): `index.json` written last (its presence
means the dataset is complete), `tokenizer.model`, and Arrow IPC stream files of rows
`input_ids`, `mask_positions`, `mask_labels`, `mask_inputs`, `word_start`. Like MosaicML
streaming's reader, we check the format version and each shard's sha256 before first use.

A shard is decoded once into flat numpy arrays plus Arrow offsets (`Shard`), so that a batch is
gathered with a few vectorised numpy calls instead of per-row Python.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from pipeline.index_format import (
    INDEX_FILE,
    TOKENIZER_FILE,
    DatasetError,
    missing_index,
    parse_index,
)

REQUIRED_COLUMNS = ("input_ids", "mask_positions", "mask_labels", "mask_inputs", "word_start")


class DataError(RuntimeError):
    """A shard dataset that cannot be trained on; the message names the file and the problem."""


@dataclass(frozen=True)
class ShardInfo:
    file: Path  # absolute path of the Arrow stream file
    rows: int  # training sequences in the shard
    sha256: str  # hex digest from index.json


@dataclass(frozen=True)
class Index:
    root: Path  # the dataset directory
    seq_len: int  # longest row, [CLS] and [SEP] included
    dupe_factor: int  # static maskings stored per row
    vocab_size: int  # tokenizer vocabulary (the model's vocab_size)
    tokenizer: Path  # OUT/tokenizer.model
    special_ids: dict  # {"[PAD]": 0, ...}
    splits: dict  # split name -> tuple[ShardInfo, ...]
    raw: dict  # the whole index.json

    def shards(self, split: str) -> tuple[ShardInfo, ...]:
        if split not in self.splits or not self.splits[split]:
            raise DataError(
                f"{self.root / 'index.json'}: no {split!r} shards (splits: {sorted(self.splits)})"
            )
        return self.splits[split]

    def rows(self, split: str) -> int:
        """Rows of `split`: for "train", the epoch size of the training stream."""
        return sum(s.rows for s in self.shards(split))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_index(root: str | Path, verify_tokenizer: bool = True) -> Index:
    """Parse and check OUT/index.json; every problem is a DataError naming the file."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data directory not found: {root}")
    path = root / INDEX_FILE
    try:
        if not path.is_file():
            raise missing_index(str(path), str(root))
        raw = parse_index(path.read_bytes(), str(path))
    except (
        DatasetError
    ) as err:  # the shared format check (pipeline/index_format.py), as a DataError
        raise DataError(str(err)) from None
    try:
        tok = raw["tokenizer"]
        splits = {
            name: tuple(
                ShardInfo(root / s["file"], int(s["rows"]), s["sha256"]) for s in split["shards"]
            )
            for name, split in raw["splits"].items()
        }
        index = Index(
            root=root,
            seq_len=int(raw["seq_len"]),
            dupe_factor=int(raw["dupe_factor"]),
            vocab_size=int(tok["vocab_size"]),
            tokenizer=root / tok.get("file", TOKENIZER_FILE),
            special_ids=dict(tok.get("special_ids", {})),
            splits=splits,
            raw=raw,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{path}: malformed index ({type(err).__name__}: {err})") from err
    if verify_tokenizer:
        if not index.tokenizer.is_file():
            raise DataError(f"{index.tokenizer}: tokenizer listed in {path} is missing")
        if sha256_file(index.tokenizer) != tok.get("sha256"):
            raise DataError(
                f"{index.tokenizer}: sha256 differs from {path}; the tokenizer is not the one the shards were built with"
            )
    return index


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


def load_shard(info: ShardInfo, verify: bool = True) -> Shard:
    """Check (optionally) the sha256, read the Arrow stream and decode its columns in bulk."""
    if not info.file.is_file():
        raise DataError(f"shard {info.file} listed in index.json is missing")
    if verify and sha256_file(info.file) != info.sha256:
        raise DataError(
            f"shard {info.file} is corrupted: its sha256 differs from index.json; rebuild or restore it"
        )
    try:
        with pa.memory_map(str(info.file)) as source:
            table = ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"shard {info.file}: not a readable Arrow IPC stream ({err})") from err
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"shard {info.file}: missing column(s) {missing}")
    if table.num_rows != info.rows:
        raise DataError(f"shard {info.file}: {table.num_rows} rows, index.json says {info.rows}")
    ids_off, ids = _lists(table["input_ids"])
    ws_off, ws = _lists(table["word_start"])
    outer, pos_lists = _lists(table["mask_positions"])
    inner, pos = _lists(pos_lists)
    _, lab_lists = _lists(table["mask_labels"])
    _, inp_lists = _lists(table["mask_inputs"])
    return Shard(
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
