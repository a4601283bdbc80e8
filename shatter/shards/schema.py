"""Names, version and columns of the shard format, the per-shard record, and its error type."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

FORMAT, VERSION = "shatter-shards", 1
INDEX_FILE, TOKENIZER_FILE = "index.json", "tokenizer.model"
# what every reader needs; further columns are allowed (docs/format.md)
REQUIRED_COLUMNS = ("input_ids", "mask_positions", "mask_labels", "mask_inputs", "word_start")


class DatasetError(RuntimeError):
    """A shard dataset that is missing, incomplete, damaged or not in this format; the message
    names the file and what to do."""


@dataclass(frozen=True)
class ShardInfo:
    """What index.json records per shard."""

    file: str  # name relative to the dataset directory
    rows: int  # training sequences
    tokens: int  # ids, [CLS]/[SEP] included
    bytes: int  # file size
    sha256: str  # of the file's bytes


def id_type(vocab_size: int) -> pa.DataType:
    """uint16 ids while they fit, int32 beyond (docs/format.md)."""
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
