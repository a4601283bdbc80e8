"""The Beam PTransforms of `shatter-data build`: read → clean → tokenize → pack → mask (→ `pipeline.sink`).

Each transform is a thin DoFn over a pure function of `pipeline.readers`, `cleaning`, `wikitext`,
`tokenizer`, `packing`, `masking` and `shards` (the seqio / Beam-examples pattern). Elements are
batches (about `batch_chars` of text, or all rows of such a batch), because Beam's cost is per
element. Expensive state (the sentencepiece processor) is loaded in `DoFn.setup()`. Every skip or
drop increments a Metrics counter in the "shatter" namespace; nothing is swallowed silently.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import uuid
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from pipeline import cleaning, masking, packing, progress, readers, shards, tokenizer
from pipeline.wiki import InputError
from pipeline.wikitext import clean_wikitext

NAMESPACE = "shatter"
log = logging.getLogger(__name__)


class _Counter:
    """A Beam Metrics counter of the "shatter" namespace that also feeds the live progress tally
    (`pipeline.progress`; display only: the build's counts are Beam's committed metrics)."""

    __slots__ = ("name", "_beam")

    def __init__(self, name: str):
        self.name, self._beam = name, Metrics.counter(NAMESPACE, name)

    def __getstate__(self):
        return self.name

    def __setstate__(self, name: str):
        self.__init__(name)

    def inc(self, n: int = 1) -> None:
        self._beam.inc(n)
        progress.add(self.name, n)


def counter(name: str) -> _Counter:
    return _Counter(name)


class _Counters:
    """Lazily created counters by name: `count(name, n)` is the readers' callback."""

    def __init__(self):
        self._made = {}

    def __call__(self, name: str, n: int = 1) -> None:
        if n:
            if name not in self._made:
                self._made[name] = counter(name)
            self._made[name].inc(n)


@dataclass(frozen=True)
class DocBatch:
    """Documents from one read spec; `split` is "train", "validation" or "auto" (by hash)."""

    corpus: str
    split: str
    docs: tuple[str, ...]


@dataclass(frozen=True)
class Tokenized:
    split: str
    docs: tuple[np.ndarray, ...]  # one id array per document


@dataclass(frozen=True)
class Packed:
    split: str
    keys: np.ndarray  # uint64 content key per row
    rows: tuple[np.ndarray, ...]  # [CLS] ... [SEP] id arrays


def content_key(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class ReadFn(beam.DoFn):
    def __init__(self, split: str, on_error: str, text_field: str, text_mode: str, batch_chars: int):
        self.split, self.on_error, self.text_field = split, on_error, text_field
        self.text_mode, self.batch_chars = text_mode, batch_chars

    def setup(self):
        self.count = _Counters()

    def process(self, spec: readers.ReadSpec):
        docs, chars = [], 0
        try:
            for doc in readers.read_documents(spec, self.count, self.on_error, self.text_field, self.text_mode):
                self.count("documents_read", 1)
                docs.append(doc)
                chars += len(doc)
                if chars >= self.batch_chars:
                    yield DocBatch(spec.corpus, self.split, tuple(docs))
                    docs, chars = [], 0
        except InputError as e:
            if self.on_error == "stop":
                raise InputError(f"shatter-data input error: {e}") from None
            log.warning("%s; skipping the rest of this input (--on-error skip)", e)
            self.count("skipped_rest_of_file", 1)
        if docs:
            yield DocBatch(spec.corpus, self.split, tuple(docs))


class ReadDocuments(beam.PTransform):
    """Read specs → DocBatch; the specs are reshuffled first so that workers share the files."""

    def __init__(self, specs, split: str, config):
        super().__init__()
        self.specs, self.split, self.config = specs, split, config

    def expand(self, pbegin):
        c = self.config
        return (
            pbegin
            | "specs" >> beam.Create(self.specs)
            | "spread" >> beam.Reshuffle()
            | "read" >> beam.ParDo(ReadFn(self.split, c.on_error, c.text_field, c.text_mode, c.batch_chars))
        )


class CacheFn(beam.DoFn):
    """DocBatch → Arrow files of cleaned text under `work_dir` (one record batch per DocBatch).

    When a tokenizer is trained, the text is cleaned once: the sampling pipeline caches it and the
    build pipeline reads the cache. DocBatches are kept whole, so the build's output is the same
    bytes as when cleaning runs in the build pipeline itself (a given --tokenizer).
    """

    SCHEMA = pa.schema([("corpus", pa.string()), ("split", pa.string()), ("text", pa.large_string())])

    def __init__(self, work_dir: str, batches_per_file: int = 16):
        self.work_dir, self.batches_per_file = work_dir, batches_per_file

    def start_bundle(self):
        self.pending: list[DocBatch] = []

    def process(self, batch: DocBatch):
        self.pending.append(batch)
        if len(self.pending) >= self.batches_per_file:
            yield self._flush()

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        if self.pending:
            yield WindowedValue(self._flush(), 0, [GlobalWindow()])

    def _flush(self) -> str:
        path = FileSystems.join(self.work_dir, f"clean-{uuid.uuid4().hex}.arrow")
        with FileSystems.create(path) as f, pa.ipc.new_file(f, self.SCHEMA) as writer:
            for b in self.pending:
                n = len(b.docs)
                writer.write_batch(pa.record_batch([pa.array([b.corpus] * n), pa.array([b.split] * n),
                                                    pa.array(list(b.docs), pa.large_string())], schema=self.SCHEMA))
        self.pending = []
        return path


class ReadCacheFn(beam.DoFn):
    def process(self, path: str):
        with FileSystems.open(path, compression_type="uncompressed") as f:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                yield DocBatch(batch.column(0)[0].as_py(), batch.column(1)[0].as_py(),
                               tuple(batch.column(2).to_pylist()))


class ReadCache(beam.PTransform):
    """Cached cleaned-text files → DocBatch (spread over workers first)."""

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = sorted(paths)

    def expand(self, pbegin):
        return (pbegin | "cache files" >> beam.Create(self.paths) | "spread" >> beam.Reshuffle()
                | "read cache" >> beam.ParDo(ReadCacheFn()))


CLEANERS = {"wiki": clean_wikitext, "books": cleaning.clean_book, "text": cleaning.clean_plain}


class CleanFn(beam.DoFn):
    def setup(self):
        self.empty = counter("skipped_empty_after_cleaning")

    def process(self, batch: DocBatch):
        clean = CLEANERS[batch.corpus]
        docs = []
        for doc in batch.docs:
            text = clean(doc)
            if text:
                docs.append(text)
            else:
                self.empty.inc()
        if docs:
            yield DocBatch(batch.corpus, batch.split, tuple(docs))


def Clean():
    return beam.ParDo(CleanFn())


class _SmallestLines(beam.CombineFn):
    """The n lines with the smallest hashes over all batches: a deterministic tokenizer sample."""

    def __init__(self, n: int):
        self.n = n

    def create_accumulator(self):
        return []

    def add_input(self, acc, batch: DocBatch):
        lines = (line for doc in batch.docs for line in cleaning.sample_lines(doc))
        return heapq.nsmallest(self.n, itertools.chain(acc, ((tokenizer.line_hash(x), x) for x in lines)))

    def merge_accumulators(self, accs):
        return heapq.nsmallest(self.n, itertools.chain.from_iterable(accs))

    def extract_output(self, acc):
        return [line for _, line in sorted(acc)]


def SampleLines(n: int):
    return beam.CombineGlobally(_SmallestLines(n))


class TokenizeFn(beam.DoFn):
    """DocBatch → Tokenized per split, with sentencepiece's batch API; held-out docs by hash."""

    def __init__(self, model_path: str, validation_fraction: float):
        self.model_path, self.validation_fraction = model_path, validation_fraction

    def setup(self):
        with FileSystems.open(self.model_path) as f:
            self.sp = tokenizer.load(f.read())
        self.docs, self.tokens = counter("documents_tokenized"), counter("document_tokens")
        self.empty = counter("skipped_empty_after_tokenizing")

    def process(self, batch: DocBatch):
        encoded = self.sp.encode(list(batch.docs), num_threads=1)
        by_split = {"train": [], "validation": []}
        threshold = self.validation_fraction * 2.0**64
        for text, ids in zip(batch.docs, encoded):
            if not ids:
                self.empty.inc()
                continue
            split = batch.split
            if split == "auto":
                split = "validation" if content_key(text.encode()) < threshold else "train"
            by_split[split].append(np.asarray(ids, dtype=np.int32))
            self.tokens.inc(len(ids))
        self.docs.inc(sum(len(v) for v in by_split.values()))
        for split, docs in by_split.items():
            if docs:
                yield Tokenized(split, tuple(docs))


def Tokenize(model_path: str, validation_fraction: float):
    return beam.ParDo(TokenizeFn(model_path, validation_fraction))


class PackFn(beam.DoFn):
    def __init__(self, seq_len: int, cross_document: bool):
        self.seq_len, self.cross_document = seq_len, cross_document

    def setup(self):
        self.rows, self.dropped = counter("rows"), counter("tokens_dropped")

    def process(self, batch: Tokenized):
        rows = packing.pack_documents(list(batch.docs), self.seq_len, self.cross_document)
        lost = sum(len(d) for d in batch.docs) - packing.content_tokens(rows)
        if lost:  # packing never drops; this guards the invariant in production too
            self.dropped.inc(lost)
        keys = np.array([content_key(r.astype(np.int32).tobytes()) for r in rows], dtype=np.uint64)
        self.rows.inc(len(rows))
        yield Packed(batch.split, keys, tuple(rows))


def Pack(seq_len: int, cross_document: bool):
    return beam.ParDo(PackFn(seq_len, cross_document))


class MaskFn(beam.DoFn):
    """Packed → (split, Arrow table) with `dupe_factor` static maskings and word starts."""

    CHUNK = 512  # rows per vectorised masking call, bounding the [B, D, L] scratch arrays

    def __init__(self, model_path: str, seed: int, dupe_factor: int, rate: float, whole_word: bool):
        self.model_path, self.seed, self.dupe_factor = model_path, seed, dupe_factor
        self.rate, self.whole_word = rate, whole_word

    def setup(self):
        with FileSystems.open(self.model_path) as f:
            sp = tokenizer.load(f.read())
        self.vocab_size = sp.get_piece_size()
        self.word_start = tokenizer.word_start_table(sp)
        self.masked = counter("masked_positions")

    def process(self, batch: Packed):
        tables = []
        for lo in range(0, len(batch.rows), self.CHUNK):
            rows = batch.rows[lo : lo + self.CHUNK]
            keys = batch.keys[lo : lo + self.CHUNK]
            tables.append(mask_table(rows, keys, self.word_start, self.vocab_size, self.seed, self.dupe_factor,
                                     self.rate, self.whole_word))
            self.masked.inc(len(pa.compute.list_flatten(pa.compute.list_flatten(tables[-1]["mask_positions"]))))
        if tables:
            yield batch.split, pa.concat_tables(tables)


def mask_table(rows, keys, word_start_table, vocab_size, seed, dupe_factor, rate, whole_word) -> pa.Table:
    """Rows and keys → the shard schema's table (pure; the Mask step and tests share it)."""
    lengths = np.array([len(r) for r in rows])
    padded = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    ws_padded = word_start_table[padded]
    masks = masking.mask_batch(padded, lengths, ws_padded, masking.row_seeds(seed, keys, dupe_factor),
                               vocab_size, rate, whole_word)
    word_start = [ws_padded[i, : len(r)] for i, r in enumerate(rows)]
    return shards.rows_table(keys, list(rows), word_start, masks, dupe_factor, vocab_size)


def Mask(model_path, seed, dupe_factor, rate, whole_word):
    return beam.ParDo(MaskFn(model_path, seed, dupe_factor, rate, whole_word))
