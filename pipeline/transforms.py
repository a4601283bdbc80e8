"""The Beam PTransforms of `shatter-data build`: read → clean → tokenize → pack (→ `shatter.pipeline.sink`).

Each transform is a thin DoFn over a pure function of `shatter.pipeline.readers`, `cleaning`, `wikitext`,
`tokenizer`, `packing`, `masking` and `shards` (the seqio / Beam-examples pattern). Elements are
batches (about `batch_chars` of text, or all rows of such a batch), because Beam's cost is per
element. Expensive state (the sentencepiece processor) is loaded in `DoFn.setup()`. Every skip or
drop increments a Metrics counter in the "shatter" namespace; nothing is swallowed silently.
"""

from __future__ import annotations

import heapq
import logging
import uuid
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from shatter.pipeline import cleaning, hf_tokenizer, masking, packing, progress, readers, tokenizer
from shatter.pipeline.holdout import HoldOut, HoldOutStats, batch_stats, content_key, merge
from shatter.pipeline.wiki import InputError
from shatter.pipeline.wikitext import clean_wikitext
from shatter.shards.writer import rows_table

NAMESPACE = "shatter"
log = logging.getLogger(__name__)


class _Counter:
    """A Beam Metrics counter of the "shatter" namespace that also feeds the live progress tally
    (`shatter.pipeline.progress`; display only: the build's counts are Beam's committed metrics)."""

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
    """Packed rows of one split, padded to the longest: what the shard sink sorts, masks and writes."""

    split: str
    keys: np.ndarray  # uint64 [n]: row_keys(ids, lengths), the content key the shards are sorted by
    ids: np.ndarray  # int32 [n, width <= seq_len]: [CLS] ... [SEP], then [PAD] (0) after `lengths`
    lengths: np.ndarray  # int32 [n]


@dataclass(frozen=True)
class MaskSpec:
    """How rows are masked when their shard is written (`dupe_factor` static maskings, docs/pipeline.md)."""

    model_path: str  # the tokenizer file: vocabulary size and word starts
    seed: int  # global seed; copy d of a row draws from row_seeds(seed, key, d)
    dupe_factor: int  # static maskings per row
    rate: float  # share of non-special tokens masked (BERT §3.1)
    whole_word: bool  # mask whole words (word_start) instead of single tokens


class ReadFn(beam.DoFn):
    def __init__(
        self, split: str, on_error: str, text_field: str, text_mode: str, batch_chars: int
    ):
        self.split, self.on_error, self.text_field = split, on_error, text_field
        self.text_mode, self.batch_chars = text_mode, batch_chars

    def setup(self):
        self.count = _Counters()

    def process(self, spec: readers.ReadSpec):
        docs, chars = [], 0
        try:
            for doc in readers.read_documents(
                spec, self.count, self.on_error, self.text_field, self.text_mode
            ):
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
    """Read specs → DocBatch; the specs are spread over the workers first (a Create of more than
    one element reshuffles them itself: a Reshuffle of our own would be a second one)."""

    def __init__(self, specs, split: str, config):
        super().__init__()
        self.specs, self.split, self.config = specs, split, config

    def expand(self, pbegin):
        c = self.config
        return (
            pbegin
            | "specs" >> beam.Create(self.specs)
            | "read"
            >> beam.ParDo(ReadFn(self.split, c.on_error, c.text_field, c.text_mode, c.batch_chars))
        )


class CacheFn(beam.DoFn):
    """DocBatch → Arrow files of cleaned text under `work_dir` (one record batch per DocBatch).

    The build's first pipeline (the tokenizer's sample, the hold-out statistics) caches the cleaned text
    and the build pipeline reads the cache. DocBatches are kept whole, so the build's output is
    the same bytes as when cleaning runs in the build pipeline itself (a given --tokenizer and
    --validation-fraction 0).
    """

    SCHEMA = pa.schema(
        [("corpus", pa.string()), ("split", pa.string()), ("text", pa.large_string())]
    )

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
                writer.write_batch(
                    pa.record_batch(
                        [
                            pa.array([b.corpus] * n),
                            pa.array([b.split] * n),
                            pa.array(list(b.docs), pa.large_string()),
                        ],
                        schema=self.SCHEMA,
                    )
                )
        self.pending = []
        return path


class ReadCacheFn(beam.DoFn):
    def process(self, path: str):
        with FileSystems.open(path, compression_type="uncompressed") as f:
            reader = pa.ipc.open_file(f)
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                yield DocBatch(
                    batch.column(0)[0].as_py(),
                    batch.column(1)[0].as_py(),
                    tuple(batch.column(2).to_pylist()),
                )


class ReadCache(beam.PTransform):
    """Cached cleaned-text files → DocBatch (spread over workers first, by Create's reshuffle)."""

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = sorted(paths)

    def expand(self, pbegin):
        return (
            pbegin
            | "cache files" >> beam.Create(self.paths)
            | "read cache" >> beam.ParDo(ReadCacheFn())
        )


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


class _Sample:
    """A _SmallestLines accumulator: (hash, line) candidates, their UTF-8 bytes, and, once pruned,
    the largest hash kept (`bound`), above which no line can enter the sample any more."""

    __slots__ = ("items", "bound", "size")

    def __init__(self, items=(), bound=None):
        self.items, self.bound = list(items), bound
        self.size = sum(len(line.encode()) for _, line in self.items)

    def __getstate__(self):
        return self.items, self.bound

    def __setstate__(self, state):
        self.items, self.bound = state
        self.size = sum(len(line.encode()) for _, line in self.items)


def sample_prefix(items: list, n: int, max_bytes: int) -> list:
    """The (hash, line) pairs of smallest hash, at most `n` of them and `max_bytes` of text."""
    kept, total = heapq.nsmallest(n, items), 0
    for i, (_, line) in enumerate(kept):
        total += len(line.encode())
        if total > max_bytes:
            return kept[:i]
    return kept


class _SmallestLines(beam.CombineFn):
    """The lines with the smallest hashes over all batches, at most n lines and `max_bytes` of
    text: a deterministic tokenizer sample (the longest prefix, in hash order, within both caps).

    Memory is bounded by the sample, never the corpus: a line whose hash is above the largest kept
    so far is dropped at once, the candidates are pruned back to the caps when they reach 1.5
    times either (so time is linear in the text), and a line that sentencepiece's trainer would
    skip (`tokenizer.trainable`) keeps its place by its hash alone, its text replaced by "" (so
    the corpus itself never piles up here when its lines are whole documents). Pruning a part keeps
    every line of the whole's prefix that it holds, so the merge is exact. The trainer gets the
    same lines in the same order as from `tokenizer.smallest_lines` when the byte cap is not hit.
    """

    def __init__(self, n: int, max_bytes: int):
        self.n, self.max_bytes = n, max_bytes

    def create_accumulator(self):
        return _Sample()

    def _prune(self, acc: _Sample) -> _Sample:
        if len(acc.items) >= self.n or acc.size > self.max_bytes:
            acc.items = sample_prefix(acc.items, self.n, self.max_bytes)
            acc.size = sum(len(line.encode()) for _, line in acc.items)
            acc.bound = acc.items[-1][0] if acc.items else -1
        return acc

    def add_input(self, acc: _Sample, batch: DocBatch):
        items, bound = acc.items, acc.bound
        for doc in batch.docs:
            for line in cleaning.sample_lines(doc):
                h = tokenizer.line_hash(line)
                if bound is None or h <= bound:  # ties kept: a tie is the same line
                    text = line if tokenizer.trainable(line) else ""
                    items.append((h, text))
                    acc.size += len(text.encode())
        if len(items) >= self.n + max(self.n // 2, 1) or acc.size >= 1.5 * self.max_bytes:
            self._prune(acc)
        return acc

    def merge_accumulators(self, accs):
        items = [item for acc in accs for item in acc.items]
        return self._prune(_Sample(items))

    def extract_output(self, acc: _Sample):
        return [line for _, line in sample_prefix(acc.items, self.n, self.max_bytes) if line]


def SampleLines(n: int, max_bytes: int | None = None):
    return beam.CombineGlobally(_SmallestLines(n, 2**62 if max_bytes is None else max_bytes))


class TokenizeFn(beam.DoFn):
    """DocBatch → Tokenized per split, with the tokenizer's batch API; an "auto" batch's documents
    split by the build's `HoldOut` (whole documents by hash, or each one's tail). With `stats`,
    also each "auto" batch's `HoldOutStats` (tagged "stats"): a build with a given tokenizer
    counts the documents as it goes, and is built again only where `decide` says so."""

    def __init__(self, model_path: str, hold_out: HoldOut, stats: bool = False):
        self.model_path, self.hold_out, self.stats = model_path, hold_out, stats

    def setup(self):
        with FileSystems.open(self.model_path) as f:
            self.encoder = tokenizer.encoder(self.model_path, f.read())
        self.docs, self.tokens = counter("documents_tokenized"), counter("document_tokens")
        self.empty = counter("skipped_empty_after_tokenizing")

    def process(self, batch: DocBatch):
        if batch.split == "auto":
            hashed = self.stats or (self.hold_out.fraction and not self.hold_out.tails)
            keys = [content_key(text.encode()) if hashed else 0 for text in batch.docs]
            if self.stats:
                counted = zip(keys, map(len, batch.docs))
                yield beam.pvalue.TaggedOutput(
                    "stats", batch_stats(counted, self.hold_out.fraction)
                )
            pieces = [self.hold_out.split(text, key) for text, key in zip(batch.docs, keys)]
        else:
            pieces = [[(batch.split, text)] for text in batch.docs]
        encoded = iter(self.encoder.encode([text for doc in pieces for _, text in doc]))
        by_split, empty = {"train": [], "validation": []}, 0
        for doc in pieces:  # a document split in two is one document tokenized
            kept = [(split, ids) for split, ids in ((s, next(encoded)) for s, _ in doc) if len(ids)]
            empty += not kept
            for split, ids in kept:
                by_split[split].append(ids)
        if empty:
            self.empty.inc(empty)
        self.docs.inc(len(pieces) - empty)
        self.tokens.inc(sum(len(ids) for docs in by_split.values() for ids in docs))
        for split, docs in by_split.items():
            if docs:
                yield Tokenized(split, tuple(docs))


def Tokenize(model_path: str, hold_out: HoldOut, stats: bool = False):
    """`TokenizeFn`; with `stats`, its outputs are ("tokenized", "stats")."""
    fn = beam.ParDo(TokenizeFn(model_path, hold_out, stats))
    return fn.with_outputs("stats", main="tokenized") if stats else fn


def batch_hold_out_stats(batch: DocBatch, fraction: float) -> HoldOutStats:
    """The `HoldOutStats` of an "auto" batch (another one's: none)."""
    if batch.split != "auto":
        return HoldOutStats()
    return batch_stats(((content_key(d.encode()), len(d)) for d in batch.docs), fraction)


class _MergeStats(beam.CombineFn):
    def create_accumulator(self):
        return HoldOutStats()

    def add_input(self, acc, stats):
        return merge([acc, stats])

    def merge_accumulators(self, accs):
        return merge(accs)

    def extract_output(self, acc):
        return acc


def MergeStats():
    """Per-batch `HoldOutStats` → the corpus's (a singleton; batches are reduced to their
    statistics first, so no text goes through the combine's shuffle)."""
    return beam.CombineGlobally(_MergeStats())


_ROW_KEY_SALT = np.uint64(0x524F574B4559)


def row_keys(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64 content key per padded row: a multilinear hash of its ids (sum of id x odd 64-bit
    constant per column, mod 2**64) and its length, through splitmix64's finaliser. Padding adds
    nothing, so a key depends on the row alone, not on the padded width."""
    multipliers = masking.mix64(
        np.arange(ids.shape[1], dtype=np.uint64) + _ROW_KEY_SALT
    ) | np.uint64(1)
    h = np.asarray(ids).astype(np.uint64) @ multipliers
    return masking.mix64(h ^ masking.mix64(np.asarray(lengths, dtype=np.uint64)))


class PackFn(beam.DoFn):
    def __init__(self, seq_len: int, cross_document: bool):
        self.seq_len, self.cross_document = seq_len, cross_document

    def setup(self):
        self.rows, self.dropped = counter("rows"), counter("tokens_dropped")

    def process(self, batch: Tokenized):
        ids, lengths = packing.pack_documents_padded(
            list(batch.docs), self.seq_len, self.cross_document
        )
        lost = sum(len(d) for d in batch.docs) - packing.content_tokens(ids, lengths)
        if lost:  # packing never drops; this guards the invariant in production too
            self.dropped.inc(lost)
        self.rows.inc(len(lengths))
        ids = ids[
            :, : int(lengths.max(initial=1))
        ]  # short rows only (per-document packing): no wasted padding
        yield Packed(batch.split, row_keys(ids, lengths), ids, lengths)


def Pack(seq_len: int, cross_document: bool):
    return beam.ParDo(PackFn(seq_len, cross_document))


def mask_table(
    keys: np.ndarray,
    ids: np.ndarray,
    lengths: np.ndarray,
    word_start_table: np.ndarray | None,
    vocab_size: int,
    spec: MaskSpec,
) -> pa.Table:
    """Padded rows → the shard schema's table: ids, word starts and `dupe_factor` maskings (pure).
    The word starts come from `word_start_table` (by id), or where it is None from the flags
    on the ids (`hf_tokenizer.CONTINUES`), which are stripped.

    Vectorised over the rows, no per-row Python; the shard writer masks each chunk it writes.
    """
    if word_start_table is None:
        ids, word_start = hf_tokenizer.word_starts(ids)
    else:
        word_start = word_start_table[ids]
    masks = masking.mask_batch(
        ids,
        lengths,
        word_start,
        masking.row_seeds(spec.seed, keys, spec.dupe_factor),
        vocab_size,
        spec.rate,
        spec.whole_word,
    )
    in_row = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    return rows_table(
        keys, lengths, ids[in_row], word_start[in_row], masks, spec.dupe_factor, vocab_size
    )
