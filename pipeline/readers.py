"""Readers: input paths to read specs (driver side), and read specs to batches of raw documents.

A read spec is one file, or one byte range of a splittable file (plain `.txt`/`.jsonl`, a
multistream wiki dump: by its index, or by stream headers found in it), so large inputs are read
in parallel. A range owns the
records that *start* in it, as Beam's TextIO does. Each reader yields raw documents (wikitext,
book text, plain text); cleaning is the next transform. Every skip is reported to a `count`
callback by reason, and unreadable input raises `InputError` naming the file.

Files are local, on an object store (Beam's filesystems: `s3://`, `gs://`), or on the Hugging
Face Hub (`hf://datasets/ORG/NAME/...`, through fsspec and huggingface_hub's `HfFileSystem`:
`is_fsspec`, `open_input`).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import posixpath
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow.parquet as pq
import zstandard
from apache_beam.io.filesystems import FileSystems

from shatter.pipeline import wiki
from shatter.pipeline.cleaning import decode, is_binary
from shatter.pipeline.config import InputSpec
from shatter.pipeline.wiki import InputError

log = logging.getLogger(__name__)
Count = Callable[[str, int], None]
SPLITTABLE_TEXT = (".txt", ".jsonl", ".text")
FSSPEC_SCHEMES = ("hf://",)
ONE_WORKER_WARNING_BYTES = (
    256 << 20
)  # a wiki file this large, read whole by one worker, is worth a warning
WIKI_SCAN_BYTES = (
    32 << 20
)  # without an index, a multistream dump is split into ranges of at least this


@dataclass(frozen=True)
class ReadSpec:
    """One unit of reading: a file, or the byte range [start, end) of one."""

    corpus: str
    path: str
    start: int = 0
    end: int | None = None  # None: to the end of the file


def is_fsspec(path: str) -> bool:
    """Whether `path` is read through fsspec rather than Beam's filesystems: the Hugging Face
    Hub's `hf://datasets/ORG/NAME/...` (huggingface_hub's `HfFileSystem`)."""
    return str(path).startswith(FSSPEC_SCHEMES)


def _fsspec(path: str):
    """(the fsspec file system of `path`, the path within it)."""
    try:
        import fsspec

        return fsspec.core.url_to_fs(path)
    except ImportError as e:  # fsspec, or huggingface_hub behind the hf:// protocol
        raise InputError(
            f"input {path}: needs {e.name or 'huggingface_hub'}: pip install 'shatter[pipeline-hf]'"
        ) from None


def _list_fsspec(path: str) -> list[tuple[str, int]]:
    """(URL, size) of the files of an fsspec path: a file, a glob, or every file under a folder."""
    scheme = path.split("://", 1)[0]
    fs, inner = _fsspec(path)
    try:
        if any(c in inner for c in "*?["):
            found = fs.glob(inner, detail=True)
        elif fs.isdir(inner):
            found = fs.find(inner, detail=True)
        else:
            found = {inner: fs.info(inner)}
    except FileNotFoundError:
        return []
    except Exception as e:  # offline, no such repository, no access
        line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise InputError(f"input {path}: cannot list it ({type(e).__name__}: {line})") from None
    return [
        (f"{scheme}://{name}", int(info["size"]))
        for name, info in found.items()
        if info.get("type") == "file" and not posixpath.basename(name).startswith(".")
    ]


def open_input(path: str):
    """A binary file object of an input (uncompressed: Beam would otherwise guess by extension)."""
    if is_fsspec(path):
        fs, inner = _fsspec(path)
        return fs.open(inner, "rb")
    return FileSystems.open(path, compression_type="uncompressed")


def _list_files(path: str) -> list[tuple[str, int]]:
    if is_fsspec(path):
        return _list_fsspec(path)
    if os.path.isdir(path):
        found = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
        return [(p, os.path.getsize(p)) for p in found if not os.path.basename(p).startswith(".")]
    pattern = path.rstrip("/") + "/*" if path.endswith("/") else path
    try:
        results = FileSystems.match([pattern])[0].metadata_list
        if not results and "://" in path and not any(c in path for c in "*?["):
            # an object store's "directory": every object under the prefix, as os.walk would
            results = FileSystems.match([path.rstrip("/") + "/**"])[0].metadata_list
            results = [m for m in results if not posixpath.basename(m.path).startswith(".")]
    except Exception as e:  # Beam raises BeamIOError for a pattern that matches nothing
        raise InputError(f"input {path}: {e}") from None
    return [(m.path, m.size_in_bytes) for m in results]


def expand_inputs(specs: tuple[InputSpec, ...], split_bytes: int, text_mode: str) -> list[ReadSpec]:
    """Read specs for all inputs, in a deterministic order (never dependent on the runner)."""
    out: list[ReadSpec] = []
    for spec in specs:
        if spec.corpus == "wiki" and is_fsspec(spec.path):
            raise InputError(
                f"input {spec.path}: a wiki dump is read from local disk or an object store; the "
                "Hub's corpora are parquet or jsonl files, read with --corpus text --text-column"
            )
        files = sorted(_list_files(spec.path))
        if not files:
            raise InputError(f"input {spec.path}: no files match")
        for path, size in files:
            if spec.corpus == "wiki" and spec.index:
                offsets = wiki.read_multistream_index(spec.index)
                out += [
                    ReadSpec("wiki", path, s, e)
                    for s, e in wiki.stream_ranges(offsets, size, split_bytes)
                ]
            elif (
                spec.corpus == "wiki"
                and path.endswith(".bz2")
                and size > max(split_bytes, WIKI_SCAN_BYTES)
                and (
                    offsets := wiki.scan_stream_offsets(
                        path, size, max(split_bytes, WIKI_SCAN_BYTES)
                    )
                )
            ):
                # a multistream dump given without its index: ranges start at scanned stream headers
                out += [
                    ReadSpec("wiki", path, s, e)
                    for s, e in wiki.stream_ranges(offsets, size, split_bytes)
                ]
            elif spec.corpus == "text" and path.endswith(SPLITTABLE_TEXT) and size > split_bytes:
                out += [
                    ReadSpec("text", path, s, min(s + split_bytes, size))
                    for s in range(0, size, split_bytes)
                ]
            else:
                if spec.corpus == "wiki" and size > ONE_WORKER_WARNING_BYTES:
                    log.warning(
                        "%s (%.1f GB) is one bz2 stream, read whole by one worker: for parallel reads "
                        "use the multistream dump (its index, --wiki-index, is optional) or the dump's "
                        "part files",
                        path,
                        size / 1e9,
                    )
                out.append(ReadSpec(spec.corpus, path))
    return out


def _decode(data: bytes, count: Count) -> str:
    text, bad = decode(data)
    if bad:
        count("invalid_utf8_replaced", bad)
    return text


def read_wiki(spec: ReadSpec, count: Count, on_error: str) -> Iterator[str]:
    """Wikitext of the namespace-0 articles (redirects and disambiguation pages skipped, counted)."""
    ranged = spec.start > 0 or spec.end is not None  # a range of streams of a multistream dump
    for raw in wiki.iter_page_bytes(spec.path, spec.start if ranged else None, spec.end):
        try:
            page = wiki.parse_page(raw)
        except ET.ParseError as e:
            text, bad = decode(raw)
            try:
                page = wiki.parse_page(text.encode()) if bad else None
            except ET.ParseError:
                page = None
            if page is None:
                if on_error == "stop":
                    raise InputError(f"{spec.path}: broken XML page ({e})") from None
                count("skipped_broken_page", 1)
                continue
            count("invalid_utf8_replaced", bad)
        reason = wiki.skip_reason(page)
        if reason:
            count(f"skipped_{reason}", 1)
            continue
        yield page.text


def _whole(path: str) -> bytes:
    with open_input(path) as f:
        return f.read()


def read_book(spec: ReadSpec, count: Count) -> Iterator[str]:
    """The whole file: one book is one document."""
    data = _whole(spec.path)
    if is_binary(data[:8192]):
        count("skipped_binary_file", 1)
        return
    text = _decode(data, count)
    if not text.strip():
        count("skipped_empty_file", 1)
        return
    yield text


def _line_start(f, pos: int) -> int:
    """The first line start at or after `pos`."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    f.readline()
    return f.tell()


def _previous_line_blank(f, pos: int) -> bool:
    if pos == 0:
        return True
    back = min(pos, 1 << 16)
    f.seek(pos - back)
    window = f.read(back)[:-1]
    return window.rsplit(b"\n", 1)[-1].strip() == b""


def _text_records(f, start: int, end: int | None, mode: str) -> Iterator[bytes]:
    """Records (lines, or blank-line separated paragraphs) that start in [start, end)."""
    pos = _line_start(f, start)
    in_foreign = mode == "paragraph" and not _previous_line_blank(f, pos)
    f.seek(pos)
    record: list[bytes] = []
    while True:
        line_pos = f.tell()
        line = f.readline()
        if not line:
            break
        blank = not line.strip()
        if mode == "line":
            if end is not None and line_pos >= end:
                break
            if not blank:
                yield line
            continue
        if in_foreign:  # the tail of a paragraph owned by the previous range
            in_foreign = not blank
            continue
        if blank:
            if record:
                yield b"".join(record)
                record = []
            continue
        if not record and end is not None and line_pos >= end:
            break
        record.append(line)
    if record:
        yield b"".join(record)


def _json_text(line: str, field: str, path: str, count: Count, on_error: str) -> str | None:
    try:
        value = json.loads(line)[field]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        if on_error == "stop":
            raise InputError(f"{path}: bad JSON line or no field {field!r} ({e!r})") from None
        count("skipped_bad_json_line", 1)
        return None
    return value if isinstance(value, str) else None


def read_text(
    spec: ReadSpec, count: Count, on_error: str, text_field: str, text_mode: str
) -> Iterator[str]:
    """Documents of a .txt / .jsonl / .jsonl.zst / .json.gz / .parquet file (or a range of one)."""
    path = spec.path
    if path.endswith(".parquet"):
        with open_input(path) as f:
            table_file = pq.ParquetFile(f)
            if text_field not in table_file.schema_arrow.names:
                raise InputError(
                    f"{path}: no column {text_field!r} (columns: {table_file.schema_arrow.names})"
                )
            for batch in table_file.iter_batches(columns=[text_field]):
                yield from (t for t in batch.column(0).to_pylist() if t)
        return
    if path.endswith((".zst", ".gz")):
        with open_input(path) as raw:
            stream = (
                zstandard.ZstdDecompressor().stream_reader(raw)
                if path.endswith(".zst")
                else gzip.GzipFile(fileobj=raw)
            )
            for line in io.BufferedReader(stream):
                if line.strip():
                    text = _json_text(_decode(line, count), text_field, path, count, on_error)
                    if text:
                        yield text
        return
    with open_input(path) as f:
        if spec.start == 0:
            head = f.read(8192)
            if is_binary(head):
                count("skipped_binary_file", 1)
                return
            if not head.strip():
                count("skipped_empty_file", 1)
                return
        if spec.start != 0 and is_binary(_whole_head(f)):
            return
        mode = "line" if path.endswith(".jsonl") else text_mode
        for record in _text_records(f, spec.start, spec.end, mode):
            text = _decode(record, count)
            if path.endswith(".jsonl"):
                text = _json_text(text, text_field, path, count, on_error)
            if text:
                yield text


def _whole_head(f) -> bytes:
    f.seek(0)
    return f.read(8192)


def read_documents(
    spec: ReadSpec, count: Count, on_error: str, text_field: str, text_mode: str
) -> Iterator[str]:
    """Raw documents of one read spec, by corpus."""
    if spec.corpus == "wiki":
        return read_wiki(spec, count, on_error)
    if spec.corpus == "books":
        return read_book(spec, count)
    return read_text(spec, count, on_error, text_field, text_mode)
