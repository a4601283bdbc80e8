"""The shard dataset format (DESIGN.md "Shard dataset layout"): one home for its schema, its
`index.json`, its reader and its writer, side by side as in MosaicML streaming's
`streaming/base/format/mds/{reader,writer}.py`.

    schema.py   names, version, columns, `ShardInfo`, the one error type `DatasetError`
    fs.py       local paths with the standard library; `gs://` and other schemes through Beam
    index.py    `read_index` -> `Index` (checked: format, version, fields), `write_index`
    reader.py   `load_shard` (decoded, checksummed columns for the trainer), `read_shard`
    writer.py   `ShardWriter` (temp file + rename), `write_shard`, `rows_table`

Beam-free for local paths: the trainer imports it without importing Apache Beam.
"""

from pipeline.format.index import Index, read_index, write_index
from pipeline.format.reader import Shard, load_shard, read_shard, sha256_file
from pipeline.format.schema import (
    FORMAT,
    INDEX_FILE,
    TOKENIZER_FILE,
    VERSION,
    DatasetError,
    ShardInfo,
    id_type,
    schema,
    shard_name,
)
from pipeline.format.writer import ShardWriter, write_shard

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "TOKENIZER_FILE",
    "VERSION",
    "DatasetError",
    "Index",
    "Shard",
    "ShardWriter",
    "ShardInfo",
    "id_type",
    "load_shard",
    "read_index",
    "read_shard",
    "schema",
    "sha256_file",
    "shard_name",
    "write_index",
    "write_shard",
]
