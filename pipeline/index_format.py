"""The shard dataset's `index.json` format (DESIGN.md "Shard dataset layout"): names and checks.

One place for the format name, the version and the checks every reader makes, shared by the
pipeline's Beam `FileSystems` reader (`pipeline.shards.read_index`) and the trainer's local reader
(`train.shards.read_index`). Beam-free on purpose: the trainer imports it without importing Beam.
Like MosaicML streaming's index (`streaming.base.format.index`), readers check format and version
before trusting anything else in the file.
"""

from __future__ import annotations

import json

FORMAT, VERSION = "shatter-shards", 1
INDEX_FILE, TOKENIZER_FILE = "index.json", "tokenizer.model"


class DatasetError(Exception):
    """A shard dataset that is missing, incomplete or not in the expected format."""


def missing_index(path: str, out: str) -> DatasetError:
    """The error for a dataset directory `out` without its index.json `path`."""
    return DatasetError(
        f"{path} not found: {out} is not a finished shatter dataset "
        "(index.json is written last by `shatter-data build`; an interrupted build has none)"
    )


def parse_index(data: bytes, path: str) -> dict:
    """The checked content of index.json `path` (its bytes `data`): JSON, this format and version."""
    try:
        index = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(index, dict):
        raise DatasetError(f"{path}: not a JSON object")
    if index.get("format") != FORMAT:
        raise DatasetError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    if index.get("version") != VERSION:
        raise DatasetError(
            f"{path}: version {index.get('version')!r}; this reader knows version {VERSION}"
        )
    return index
