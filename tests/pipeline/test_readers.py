"""Readers: byte ranges read the same documents as whole files; wiki dumps (plain, multistream,
broken); books; text formats; bad input counted or reported with the file name."""

import bz2
import gzip
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from shatter.pipeline import cleaning, readers, wiki
from shatter.pipeline.config import InputSpec
from shatter.pipeline.wiki import InputError

from .corpus import generated_documents


class Counts(dict):
    def __call__(self, name, n=1):
        self[name] = self.get(name, 0) + n


def _read_all(specs, **kw):
    counts = Counts()
    docs = [
        d
        for s in specs
        for d in readers.read_documents(
            s,
            counts,
            kw.get("on_error", "skip"),
            kw.get("text_field", "text"),
            kw.get("text_mode", "paragraph"),
        )
    ]
    return docs, counts


@pytest.mark.parametrize("mode", ["paragraph", "line"])
def test_byte_ranges_read_each_document_once(tmp_path, mode):
    docs = [d.replace("\n", " ") for d in generated_documents(200, seed=3)]
    sep = "\n\n  \n" if mode == "paragraph" else "\n"
    path = tmp_path / "c.txt"
    path.write_text(sep.join(docs) + "\n")
    whole = readers.expand_inputs((InputSpec("text", str(path)),), 1 << 30, mode)
    split = readers.expand_inputs((InputSpec("text", str(path)),), 997, mode)
    assert len(whole) == 1 and len(split) > 20
    expected, _ = _read_all(whole, text_mode=mode)
    got, _ = _read_all(split, text_mode=mode)
    assert [d.strip() for d in got] == [d.strip() for d in expected] == docs


def test_jsonl_ranges_and_compressed_json(tmp_path):
    docs = generated_documents(100, seed=4)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(lines))
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    for name in ("a.jsonl", "b.jsonl.zst", "c.json.gz", "d.parquet"):
        specs = readers.expand_inputs((InputSpec("text", str(tmp_path / name)),), 1000, "paragraph")
        got, counts = _read_all(specs)
        assert got == docs, name
        assert not counts


def test_bad_json_lines_are_counted_or_stop(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n{"other": 1}\n')
    got, counts = _read_all([readers.ReadSpec("text", str(tmp_path / "a.jsonl"))])
    assert got == ["fine"] and counts["skipped_bad_json_line"] == 2
    with pytest.raises(InputError, match="a.jsonl"):
        _read_all([readers.ReadSpec("text", str(tmp_path / "a.jsonl"))], on_error="stop")


def test_invalid_utf8_empty_and_binary_files(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait\n\nsecond \xff\xfe paragraph\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"\n  \n\n")
    (tmp_path / "image.txt").write_bytes(bytes(range(256)) * 4)
    specs = readers.expand_inputs((InputSpec("text", str(tmp_path)),), 1 << 20, "paragraph")
    got, counts = _read_all(specs)
    assert [d.strip() for d in got] == ["caf\ufffd au lait", "second \ufffd\ufffd paragraph"]
    assert counts == {"invalid_utf8_replaced": 3, "skipped_empty_file": 2, "skipped_binary_file": 1}
    books, counts = _read_all(
        readers.expand_inputs((InputSpec("books", str(tmp_path)),), 1 << 20, "paragraph")
    )
    assert (
        len(books) == 1 and counts["skipped_binary_file"] == 1 and counts["skipped_empty_file"] == 2
    )


def test_missing_input_names_the_path(tmp_path):
    with pytest.raises(InputError, match="nothing-here"):
        readers.expand_inputs(
            (InputSpec("text", str(tmp_path / "nothing-here*.txt")),), 1 << 20, "line"
        )


def test_gutenberg_boilerplate_and_paragraphs():
    text = (
        "The Project Gutenberg EBook of X\n\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
        "First line\nof a paragraph.\n\n\nSecond   one.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\n"
        "licence text\n"
    )
    assert cleaning.clean_book(text) == "First line of a paragraph.\nSecond one."
    assert cleaning.clean_book("No markers.\n\nAt all.") == "No markers.\nAt all."


def test_collapse_spaces_is_split_and_join():
    rng = np.random.default_rng(0)
    alphabet = list("ab .\u00e9") + [c for c in map(chr, range(0x3001)) if c.isspace()]
    for _ in range(500):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 40))))
        assert cleaning.collapse_spaces(text) == " ".join(text.split()), repr(text)


def _page(title, text, ns=0, page_id=1, redirect=False):
    red = '<redirect title="X" />' if redirect else ""
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>{page_id}</id>{red}<revision><id>9</id>"
        f'<text xml:space="preserve">{text}</text></revision></page>\n'
    )


HEADER = '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><siteinfo><sitename>W</sitename></siteinfo>\n'


def test_wiki_skips_by_reason_and_broken_pages(tmp_path):
    pages = [
        _page("A", "Alpha is a letter."),
        _page("B", "#REDIRECT [[A]]", redirect=True),
        _page("Talk:A", "chat", ns=1),
        _page("C (disambiguation)", "C may mean"),
        _page("D", "D may be {{disambiguation}}"),
        _page("E", "broken &bogus; entity"),
        _page("F", "Foxtrot too."),
    ]
    path = tmp_path / "dump.xml.bz2"
    path.write_bytes(bz2.compress((HEADER + "".join(pages) + "</mediawiki>").encode()))
    got, counts = _read_all([readers.ReadSpec("wiki", str(path))])
    assert got == ["Alpha is a letter.", "Foxtrot too."]
    assert counts == {
        "skipped_redirect": 1,
        "skipped_not_article_namespace": 1,
        "skipped_disambiguation": 2,
        "skipped_broken_page": 1,
    }
    with pytest.raises(InputError, match="dump.xml.bz2: broken XML page"):
        _read_all([readers.ReadSpec("wiki", str(path))], on_error="stop")


def test_truncated_bz2_names_the_file(tmp_path):
    data = bz2.compress((HEADER + _page("A", "x " * 50000) * 20 + "</mediawiki>").encode())
    path = tmp_path / "cut.xml.bz2"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.xml.bz2: compressed data is truncated"):
        list(wiki.iter_page_bytes(str(path)))


@pytest.mark.shared_data
def _multistream_dump(shared_data, tmp_path):
    """The real sample as a multistream dump (10 pages per bz2 stream) and its index."""
    raw = bz2.open(shared_data / "wiki" / "enwiki-sample-pages-articles.xml.bz2").read()
    first = raw.index(b"<page>")
    pages = re.findall(rb"<page>.*?</page>\s*", raw[first:], re.S)
    streams, index_lines = [bz2.compress(raw[:first])], []
    offset = len(streams[0])
    for i in range(0, len(pages), 10):
        for page in pages[i : i + 10]:
            page_id = re.search(rb"<id>(\d+)</id>", page).group(1).decode()
            title = re.search(rb"<title>(.*?)</title>", page).group(1).decode()
            index_lines.append(f"{offset}:{page_id}:{title}\n")
        streams.append(bz2.compress(b"".join(pages[i : i + 10])))
        offset += len(streams[-1])
    streams.append(bz2.compress(b"</mediawiki>\n"))
    dump = tmp_path / "enwiki-multistream.xml.bz2"
    dump.write_bytes(b"".join(streams))
    index = tmp_path / "enwiki-multistream-index.txt.bz2"
    index.write_bytes(bz2.compress("".join(index_lines).encode()))
    return dump, index


@pytest.mark.slow
def test_multistream_ranges_read_the_same_articles(shared_data, tmp_path):
    """A multistream dump (+ index) built from the real sample reads as the plain dump does."""
    dump, index = _multistream_dump(shared_data, tmp_path)
    ranges = readers.expand_inputs(
        (InputSpec("wiki", str(dump), str(index)),), 200_000, "paragraph"
    )
    assert len(ranges) > 3 and ranges[0].start == 0 and ranges[-1].end is None
    got, counts = _read_all(ranges)
    expected, expected_counts = _read_all(
        readers.expand_inputs((InputSpec("wiki", str(dump)),), 1, "paragraph")
    )
    assert got == expected and counts == expected_counts and len(got) > 80


def test_a_large_wiki_file_without_index_warns_that_one_worker_reads_it(tmp_path, caplog):
    big = tmp_path / "enwiki-latest-pages-articles.xml.bz2"
    with open(big, "wb") as f:  # sparse: only the size matters here
        f.truncate(readers.ONE_WORKER_WARNING_BYTES + 1)
    (tmp_path / "small.xml.bz2").write_bytes(b"x")
    with caplog.at_level("WARNING", logger="shatter.pipeline.readers"):
        specs = readers.expand_inputs((InputSpec("wiki", str(tmp_path)),), 1 << 20, "paragraph")
    assert len(specs) == 2
    warned = [r.getMessage() for r in caplog.records]
    assert (
        len(warned) == 1
        and "enwiki-latest-pages-articles.xml.bz2" in warned[0]
        and "--wiki-index" in warned[0]
    )


@pytest.mark.slow
def test_multistream_without_its_index_is_split_at_stream_headers(
    shared_data, tmp_path, monkeypatch
):
    dump, index = _multistream_dump(shared_data, tmp_path)
    monkeypatch.setattr(readers, "WIKI_SCAN_BYTES", 0)  # scan every split_bytes (32 MiB by default)
    scanned = readers.expand_inputs((InputSpec("wiki", str(dump)),), 200_000, "paragraph")
    offsets = set(wiki.read_multistream_index(str(index)))
    assert len(scanned) > 3 and all(
        r.start == 0 or r.start in offsets for r in scanned
    )  # real stream starts
    got, counts = _read_all(scanned)
    whole, whole_counts = _read_all([readers.ReadSpec("wiki", str(dump))])
    assert got == whole and counts == whole_counts and len(got) > 80
    single = tmp_path / "single.xml.bz2"  # one stream: no header after the first, one range
    single.write_bytes(bz2.compress(bz2.open(dump).read()))
    assert len(readers.expand_inputs((InputSpec("wiki", str(single)),), 200_000, "paragraph")) == 1
