"""Streaming MediaWiki XML dumps: pages out of `.xml`, `.xml.bz2` and multistream `.bz2` (+ index).

The dump is never held in memory: decompressed bytes are scanned for `<page>...</page>` spans and
each page is parsed on its own with ElementTree (so a broken page costs that page, and a stream of
a multistream dump, which has no root element, parses like any other). The multistream index
(`offset:page_id:title` per line, Wikimedia's `*-multistream-index.txt.bz2`) gives the byte
offsets of the independent bz2 streams, which `stream_ranges` groups into ranges for parallel
reads. Reference: https://meta.wikimedia.org/wiki/Data_dumps/Dump_format
"""

from __future__ import annotations

import bz2
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass

from apache_beam.io.filesystems import FileSystems

from shatter.pipeline.wikitext import is_disambiguation

CHUNK = 1 << 20
_OPEN, _CLOSE = b"<page>", b"</page>"


class InputError(Exception):
    """Unreadable input (truncated compressed stream, broken XML, ...), with the file it came from."""


@dataclass(frozen=True)
class Page:
    title: str
    ns: int
    page_id: int
    redirect: bool
    text: str


def skip_reason(page: Page) -> str | None:
    """Why a page is not an article (None if it is): namespace, redirect or disambiguation."""
    if page.ns != 0:
        return "not_article_namespace"
    if page.redirect or page.text.lstrip().lower().startswith("#redirect"):
        return "redirect"
    if is_disambiguation(page.title, page.text):
        return "disambiguation"
    return None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse_page(raw: bytes) -> Page:
    """One `<page>` element's bytes to a Page (raises ET.ParseError if broken)."""
    elem = ET.fromstring(raw)
    fields = {"title": "", "ns": "0", "id": "0", "text": ""}
    redirect = False
    for child in elem.iter():
        name = _local(child.tag)
        if name == "redirect":
            redirect = True
        elif name in ("title", "ns") or (name == "id" and fields["id"] == "0"):
            fields[name] = child.text or ""
        elif name == "text":
            fields["text"] = child.text or ""
    return Page(
        fields["title"], int(fields["ns"] or 0), int(fields["id"] or 0), redirect, fields["text"]
    )


def scan_pages(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """`<page>...</page>` byte spans out of a stream of byte chunks (bounded buffer)."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        start = 0
        while True:
            i = buf.find(_OPEN, start)
            if i < 0:
                start = max(start, len(buf) - len(_OPEN))
                break
            j = buf.find(_CLOSE, i)
            if j < 0:
                start = i
                break
            yield buf[i : j + len(_CLOSE)]
            start = j + len(_CLOSE)
        buf = buf[start:]


def _read_chunks(fileobj) -> Iterator[bytes]:
    while True:
        chunk = fileobj.read(CHUNK)
        if not chunk:
            return
        yield chunk


def open_decompressed(path: str):
    """A binary file object of the decompressed dump (bz2 handles concatenated/multistream files)."""
    raw = FileSystems.open(path, compression_type="uncompressed")
    if path.endswith(".bz2"):
        return bz2.BZ2File(raw)
    return raw


def iter_page_bytes(path: str, start: int | None = None, end: int | None = None) -> Iterator[bytes]:
    """Raw pages of a dump, or of the bz2 streams in [start, end) of a multistream dump.

    Raises InputError naming the file when the compressed data is truncated or corrupt.
    """
    try:
        if start is None:
            with open_decompressed(path) as f:
                yield from scan_pages(_read_chunks(f))
            return
        with FileSystems.open(path, compression_type="uncompressed") as raw:
            raw.seek(start)
            data = raw.read(end - start) if end is not None else raw.read()
        with bz2.BZ2File(io.BytesIO(data)) as f:
            yield from scan_pages(_read_chunks(f))
    except (EOFError, OSError) as e:
        where = path if start is None else f"{path} [bytes {start}:{end}]"
        raise InputError(f"{where}: compressed data is truncated or corrupt ({e})") from None


_STREAM_HEADER = re.compile(
    rb"BZh[1-9]1AY&SY"
)  # "BZh" + level + the first block's magic, byte-aligned
SCAN_CHUNK, SCAN_LIMIT = 256 << 10, 16 << 20


def scan_stream_offsets(path: str, size: int, every: int) -> list[int]:
    """Stream starts of a multistream `.bz2` found without its index: the first stream header at
    or after each multiple of `every`. A header is 10 bytes that, byte-aligned, only begin a bz2
    stream (inside compressed data the odds are 2**-80 per position). [] for a single-stream
    file: no header within SCAN_LIMIT bytes of the first boundary (a dump's streams are ~100 pages).
    """
    offsets: list[int] = []
    with FileSystems.open(path, compression_type="uncompressed") as f:
        for boundary in range(every, size, every):
            if offsets and offsets[-1] >= boundary:
                continue
            f.seek(boundary)
            found, tail, pos = None, b"", boundary
            while found is None and pos - boundary < SCAN_LIMIT:
                chunk = f.read(SCAN_CHUNK)
                if not chunk:
                    break
                m = _STREAM_HEADER.search(tail + chunk)
                if m is not None:
                    found = pos - len(tail) + m.start()
                tail, pos = chunk[-9:], pos + len(chunk)
            if found is not None:
                offsets.append(found)
            elif not offsets:
                return []
    return offsets


def read_multistream_index(index_path: str) -> list[int]:
    """Sorted distinct stream offsets from a multistream index (`offset:page_id:title` lines)."""
    offsets = set()
    with open_decompressed(index_path) as f:
        for line in io.TextIOWrapper(f, encoding="utf-8", errors="replace"):
            head = line.split(":", 1)[0]
            if head.isdigit():
                offsets.add(int(head))
    return sorted(offsets)


def stream_ranges(
    offsets: list[int], file_size: int, target_bytes: int
) -> list[tuple[int, int | None]]:
    """Group consecutive streams into [start, end) byte ranges of about `target_bytes` each.

    The first range starts at 0 (the siteinfo header stream has no pages, so it costs nothing);
    the last runs to the end of the file (the closing `</mediawiki>` stream).
    """
    bounds = [0] + [o for o in offsets if 0 < o < file_size]
    ranges, start = [], 0
    for offset in bounds[1:]:
        if offset - start >= target_bytes:
            ranges.append((start, offset))
            start = offset
    ranges.append((start, None))
    return ranges
