"""`index.json`: built by `build_index` (the build, the benchmarks and the tests' datasets alike),
written last and atomically (its presence marks a finished dataset), read with the format and
version checked before anything else in it is trusted (as MosaicML streaming's index)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass

from shatter.shards.reader import sha256_file
from shatter.shards.schema import (
    FORMAT,
    INDEX_FILE,
    TOKENIZER_FILE,
    VERSION,
    DatasetError,
    ShardInfo,
)
from shatter.shards.store import fs


@dataclass(frozen=True)
class Index:
    """A checked index.json."""

    root: str  # the dataset directory (a local path or a URL)
    seq_len: int  # longest row, [CLS] and [SEP] included
    dupe_factor: int  # static maskings stored per row
    vocab_size: int  # tokenizer vocabulary (the model's vocab_size)
    tokenizer: str  # path of OUT/tokenizer.model
    tokenizer_sha256: str  # its sha256, as recorded
    special_ids: dict  # {"[PAD]": 0, ...}
    splits: dict  # split name -> tuple[ShardInfo, ...]
    raw: dict  # the whole index.json

    @property
    def path(self) -> str:
        """The index.json file itself, for messages."""
        return fs.join(self.root, INDEX_FILE)

    def shard_path(self, info: ShardInfo) -> str:
        return fs.join(self.root, info.file)

    def shards(self, split: str) -> tuple[ShardInfo, ...]:
        """A split's shards; a DatasetError if it has none."""
        if not self.splits.get(split):
            raise DatasetError(f"{self.path}: no {split!r} shards (splits: {sorted(self.splits)})")
        return self.splits[split]

    def rows(self, split: str) -> int:
        """Rows of `split`: for "train", the epoch size of the training stream."""
        return sum(s.rows for s in self.shards(split))

    def check_vocabulary(self) -> None:
        """index.json's vocab_size (the model's embedding rows) is its tokenizer file's: an edited
        or mismatched one stops a run at start-up, not as an IndexError (on a GPU, a device-side
        assert) at the first id past the embedding."""
        from shatter.shards.tokenizer import file_vocab_size

        with fs.open_read(self.tokenizer) as f:
            data = f.read()
        try:
            size = file_vocab_size(data, self.tokenizer)
        except ValueError as e:  # HFTokenizerError too
            raise DatasetError(f"{e} (the tokenizer of {self.path}); rebuild the data") from None
        if size != self.vocab_size:
            raise DatasetError(
                f"{self.path}: vocab_size {self.vocab_size} is not its tokenizer's {size} "
                f"({self.tokenizer}): rebuild the data with `shatter-data build`, or put back the "
                "tokenizer file the shards were built with"
            )

    def check_files(self) -> None:
        """Every shard of every split exists with the size index.json records: cheap (no read),
        so a deleted or truncated shard stops a run at start-up, not when the stream reaches it.
        The sha256 is checked when a shard is first opened (`load_shard`)."""
        for split, shards in self.splits.items():
            for info in shards:
                path = self.shard_path(info)
                if not fs.exists(path):
                    raise DatasetError(
                        f"{path}: {split} shard listed in {self.path} is missing; "
                        "restore it or rebuild the dataset with `shatter-data build`"
                    )
                size = fs.size(path)
                if size != info.bytes:
                    raise DatasetError(
                        f"{path}: {size} bytes, {self.path} records {info.bytes} (truncated or "
                        "replaced); restore it or rebuild the dataset with `shatter-data build`"
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


def read_index(root: str, verify_tokenizer: bool = True) -> Index:
    """Parse and check OUT/index.json; every problem is a DatasetError naming the file.
    `verify_tokenizer` also checks that tokenizer.model exists with the recorded sha256."""
    root = str(root)
    path = fs.join(root, INDEX_FILE)
    if not fs.is_remote(root) and not fs.exists(root):
        raise DatasetError(f"data directory not found: {root}")
    if not fs.exists(path):
        raise DatasetError(
            f"{path} not found: {root} is not a finished shatter dataset "
            "(index.json is written last by `shatter-data build`; an interrupted build has none)"
        )
    with fs.open_read(path) as f:
        raw = parse_index(f.read(), path)
    try:
        tok = raw["tokenizer"]
        splits = {
            name: tuple(
                ShardInfo(
                    str(s["file"]),
                    int(s["rows"]),
                    int(s["tokens"]),
                    int(s["bytes"]),
                    str(s["sha256"]),
                )
                for s in split["shards"]
            )
            for name, split in raw["splits"].items()
        }
        index = Index(
            root=root,
            seq_len=int(raw["seq_len"]),
            dupe_factor=int(raw["dupe_factor"]),
            vocab_size=int(tok["vocab_size"]),
            tokenizer=fs.join(root, tok.get("file", TOKENIZER_FILE)),
            tokenizer_sha256=str(tok.get("sha256", "")),
            special_ids=dict(tok.get("special_ids", {})),
            splits=splits,
            raw=raw,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise DatasetError(f"{path}: malformed index ({type(err).__name__}: {err})") from None
    check_entries(raw, path)
    if verify_tokenizer:
        if not fs.exists(index.tokenizer):
            raise DatasetError(f"{index.tokenizer}: tokenizer listed in {path} is missing")
        if sha256_file(index.tokenizer) != index.tokenizer_sha256:
            raise DatasetError(
                f"{index.tokenizer}: sha256 differs from {path}; the tokenizer is not the one "
                "the shards were built with"
            )
    return index


SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # a flat dataset's file: no / or ..


def check_entries(raw: dict, path: str) -> None:
    """Every `file` of index.json `path` a plain name inside the dataset and every `sha256` 64 hex
    digits: an index is data, and its fields become paths (the files read, the node cache's
    names), so one crafted index must not reach outside the dataset or the cache."""
    tok = raw["tokenizer"]
    entries = [("tokenizer", tok.get("file", TOKENIZER_FILE), tok.get("sha256"))]
    for name, split in raw["splits"].items():
        for i, shard in enumerate(split["shards"]):
            entries.append((f"{name} shard {i}", shard["file"], shard["sha256"]))
    for what, file, sha256 in entries:
        if not isinstance(file, str) or not FILE_NAME.fullmatch(file):
            raise DatasetError(
                f"{path}: {what}'s file {file!r} is not a plain file name inside the dataset "
                "(no directory, no '..'); this index was not written by `shatter-data build`: "
                "rebuild the dataset or restore its index.json"
            )
        if not isinstance(sha256, str) or not SHA256.fullmatch(sha256):
            raise DatasetError(
                f"{path}: {what}'s sha256 {str(sha256)[:80]!r} is not 64 hex digits; this index "
                "was not written by `shatter-data build`: rebuild the dataset or restore its "
                "index.json"
            )


SHARD_FIELDS = tuple(f.name for f in fields(ShardInfo))  # what index.json records per shard


def build_index(
    splits: Mapping[str, Iterable[Mapping | ShardInfo]],
    *,
    seq_len: int,
    dupe_factor: int,
    tokenizer_sha256: str,
    vocab_size: int,
    special_ids: Mapping[str, int],
    config: Mapping | None = None,
    counters: Mapping[str, int] | None = None,
    counters_unavailable: Sequence[str] | None = None,
    record_batch_rows: int | None = None,
    tokenizer_file: str = TOKENIZER_FILE,
) -> dict:
    """The content of index.json: format and version, the tokenizer, and each split's shards
    (`ShardInfo`s, or mappings with at least its fields) with the split's row and token totals.

    `counters_unavailable` names the counters a runner without metrics could not give;
    `record_batch_rows` the most rows a shard's record batch holds (the loader shuffles rows by
    such blocks; without it the loader assumes `writer.record_batch_rows(seq_len)`);
    `tokenizer_file` the tokenizer's name in the dataset (tokenizer.model, or tokenizer.json)."""
    index = {
        "format": FORMAT,
        "version": VERSION,
        "seq_len": seq_len,
        "dupe_factor": dupe_factor,
        "tokenizer": {
            "file": tokenizer_file,
            "sha256": tokenizer_sha256,
            "vocab_size": vocab_size,
            "special_ids": dict(special_ids),
        },
        "config": dict(config or {}),
        "splits": {},
        "counters": dict(counters or {}),
    }
    if record_batch_rows is not None:
        index["record_batch_rows"] = record_batch_rows
    if counters_unavailable is not None:
        index["counters_unavailable"] = list(counters_unavailable)
    for split, shards in splits.items():
        entries = [_shard_entry(s) for s in shards]
        index["splits"][split] = {
            "shards": entries,
            "rows": sum(s["rows"] for s in entries),
            "tokens": sum(s["tokens"] for s in entries),
        }
    return index


def _shard_entry(shard: Mapping | ShardInfo) -> dict:
    record = asdict(shard) if is_dataclass(shard) else shard
    return {k: record[k] for k in SHARD_FIELDS}


def write_index(out: str, index: dict) -> None:
    """Write index.json atomically (temp + rename): its presence marks the dataset complete."""
    temp = fs.join(out, f".tmp-{uuid.uuid4().hex}-{INDEX_FILE}")
    with fs.create(temp) as f:
        f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    fs.rename(temp, fs.join(out, INDEX_FILE))
