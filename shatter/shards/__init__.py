"""The shard dataset format (docs/format.md, "The shard dataset"): one home for its schema, its
`index.json`, its reader and its writer, side by side as in MosaicML streaming's
`streaming/base/format/mds/{reader,writer}.py`.

    schema.py   names, version, columns, `ShardInfo`, the one error type `DatasetError`
    index.py    `build_index` (index.json's content), `read_index` -> `Index` (checked:
                format, version, fields), `write_index`
    reader.py   `open_shard` -> `ShardFile` (record batches located by their headers, decoded
                one at a time), `load_shard` (a whole shard decoded), `read_shard`
    blocks.py   `BlockReader`: a loader worker's bounded cache of decoded record batches, with
                the next ones decoded and the next shard verified in the background
    writer.py   `ShardWriter` (temp file + rename), `write_shard`, `rows_table`,
                `record_batch_rows`
    store/      object storage: fsspec file access (`s3://`, `gs://`, `hf://`), the node cache,
                `StoreError`

Beam-free: the trainer imports it, local or remote, without Apache Beam.
"""

from shatter.shards.index import Index, build_index, read_index, write_index
from shatter.shards.reader import (
    Shard,
    ShardFile,
    load_shard,
    open_shard,
    read_shard,
    sha256_file,
)
from shatter.shards.schema import (
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
from shatter.shards.writer import ShardWriter, record_batch_rows, write_shard

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "TOKENIZER_FILE",
    "VERSION",
    "DatasetError",
    "Index",
    "Shard",
    "ShardFile",
    "ShardWriter",
    "ShardInfo",
    "build_index",
    "id_type",
    "load_shard",
    "open_shard",
    "read_index",
    "read_shard",
    "record_batch_rows",
    "schema",
    "sha256_file",
    "shard_name",
    "write_index",
    "write_shard",
]
