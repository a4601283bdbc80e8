"""`shatter-data build`: the driver that runs the Beam pipelines and writes index.json last.

Two pipelines when a tokenizer must be trained (it necessarily sits between them), one otherwise:
  1. read → clean → sample lines (the n smallest line hashes), count the documents for the
     validation hold-out (`shatter.pipeline.holdout`) and cache the clean text → the driver
     trains sentencepiece and decides the hold-out;
  2. read the cache (or, with a given tokenizer, --tokenizer or --hf-tokenizer, read → clean) →
     tokenize → pack → shard → mask → write, then index.json from the shards' manifest (each writer leaves its shard's entry in the
     work directory) and Beam's counters.
No side input is computed over the documents (a runner buffers every element that waits on one),
and no branch beside the build reads them (Dask keeps a task's output until all its readers have
run), so a worker's memory does not grow with the corpus. With a given tokenizer, the build holds
out whole documents by hash and counts the documents as it tokenizes them; where the count calls
for another hold-out (whole documents would make under half or over twice the fraction), it runs again with that one.
Any Beam runner works (`shatter.pipeline.runners`: the options beyond ours become `PipelineOptions`;
without `--runner` the in-process FnApiRunner). A runner without metrics (Dask) gets the counts
that the written shards give. `--overwrite` builds beside the old dataset and swaps on success.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import posixpath
import resource
import time
import uuid
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from shatter.pipeline import hf_tokenizer, progress, readers, runners, store, tokenizer
from shatter.pipeline.config import BuildConfig
from shatter.pipeline.holdout import HoldOut, HoldOutStats, decide, whole_document_share
from shatter.pipeline.inspect import held_out_share, validation_warnings
from shatter.pipeline.sharding import ShardSize
from shatter.pipeline.sink import ShardAndWrite, read_manifest
from shatter.pipeline.transforms import (
    NAMESPACE,
    CacheFn,
    Clean,
    MaskSpec,
    MergeStats,
    Pack,
    ReadCache,
    ReadDocuments,
    SampleLines,
    Tokenize,
    batch_hold_out_stats,
)
from shatter.shards import INDEX_FILE, TOKENIZER_FILE, build_index, write_index
from shatter.shards.store import fs
from shatter.shards.tokenizer import TOKENIZER_JSON
from shatter.shards.writer import record_batch_rows

log = logging.getLogger(__name__)
SAMPLE_FILE, WORK_DIR = ".tokenizer-sample.txt", ".work"
STATS_FILE = ".hold-out-stats.json"
CACHE_LIST = ".work/clean-files.json"
# every name a build writes in OUT: what --overwrite replaces (never other files kept there)
BUILD_FILES = (
    INDEX_FILE,
    TOKENIZER_FILE,
    TOKENIZER_JSON,
    "train-*-of-*.arrow",
    "validation-*-of-*.arrow",
    ".tmp-*",
    SAMPLE_FILE,
    STATS_FILE,
    WORK_DIR,
)
# the counters a runner without metrics cannot give (index.json says so); rows and shards_written
# are then counted from the written shards
RUNNER_ONLY_COUNTERS = (
    "documents_read",
    "documents_tokenized",
    "document_tokens",
    "masked_positions",
    "spill_files",
    "tokens_dropped",
    "invalid_utf8_replaced",
    "skipped_* (every skip, by reason)",
)


class BuildError(Exception):
    """A build that cannot go on; the message says why (the CLI prints it without a traceback)."""


def run_and_report(
    pipeline: beam.Pipeline, stage: str, config: BuildConfig, report=print
) -> dict | None:
    """Run to completion, reporting the "shatter" counters every `--progress_seconds` meanwhile
    (`shatter.pipeline.progress`: the live tally of a local runner, or Beam's metrics of a running job)
    and Beam's committed counters at the end; None if the runner has no metrics (Dask). A BuildError
    when no counter moves for `--stall-seconds` (a job still running elsewhere is cancelled)."""
    start = time.time()
    seconds = pipeline.options.view_as(progress.ProgressOptions).progress_seconds
    # the local runner's counters are always seen; another's may not be until its first one
    local = isinstance(pipeline.runner, FnApiRunner)
    watch = progress.StallWatch(
        config.stall_seconds, config.output, armed=local, end_workers=runners.end_local_workers
    )
    live, result = progress.LiveReport(stage, report, seconds, watch=watch), None
    try:
        with live:
            result = pipeline.run()  # the FnApiRunner runs the whole pipeline here
            if not beam.runners.runner.PipelineState.is_terminal(result.state):
                live.follow(lambda: runners.counters(result, NAMESPACE))
            result.wait_until_finish()  # also drives the BundleBasedDirectRunner's state to DONE
    except BaseException:  # `Stalled`, or the error of a worker that the stall ended
        if live.stall is None:
            raise
        if result is not None and not beam.runners.runner.PipelineState.is_terminal(result.state):
            try:
                result.cancel()
            except Exception as c:  # the stall is the error to show
                log.warning("could not cancel the stalled job: %s", c)
        raise BuildError(live.stall) from None
    values = runners.counters(result, NAMESPACE)
    shown = (
        format_counters(values)
        if values is not None
        else f"({type(pipeline.runner).__name__} reports no counters)"
    )
    report(f"[{stage} done in {time.time() - start:.1f}s] {shown}")
    return values


def format_counters(values: dict) -> str:
    """The counters at the end of a stage (a stage that read nothing has none)."""
    return " ".join(f"{k}={v}" for k, v in values.items()) or "(nothing read: no counters)"


def _delete_tree(path: str) -> None:
    """Remove a directory and everything under it (any filesystem)."""
    if not fs.is_remote(path):
        fs.delete(path)
        return
    found = FileSystems.match([FileSystems.join(path, "**")])[0].metadata_list
    if found:
        FileSystems.delete([m.path for m in found])
    if FileSystems.exists(path):
        FileSystems.delete([path])


def _owned(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in BUILD_FILES)


def _sweep_build_files(out: str) -> None:
    """Delete what a build writes in `out` (its shards and work files, not its tokenizer or an
    index.json), never other files kept there: before a build, and before a build made again."""
    stale = [
        m.path
        for pattern in BUILD_FILES
        if pattern not in (INDEX_FILE, TOKENIZER_FILE, TOKENIZER_JSON, WORK_DIR)
        for m in FileSystems.match([fs.join(out, pattern)])[0].metadata_list
    ]
    if stale:
        FileSystems.delete(stale)
    _delete_tree(fs.join(out, WORK_DIR))


def _prepare_output(config: BuildConfig, overwrite: bool) -> str:
    """The directory to build into: OUT itself, or, when OUT holds a dataset that --overwrite
    replaces, a new directory beside it (swapped in by `_swap_in` once the build has succeeded)."""
    out = config.output.rstrip("/")
    if FileSystems.exists(fs.join(out, INDEX_FILE)):
        if not overwrite:
            raise BuildError(
                f"{out} already holds a dataset (index.json); pass --overwrite to replace it"
            )
        parent, name = posixpath.split(out) if fs.is_remote(out) else os.path.split(out)
        staging = (posixpath if fs.is_remote(out) else os.path).join(
            parent, f".{name}.building-{uuid.uuid4().hex[:12]}"
        )
        FileSystems.mkdirs(staging)
        return staging
    _sweep_build_files(out)  # an interrupted build's (no index.json)
    if not FileSystems.exists(out):
        FileSystems.mkdirs(out)
    return out


def _swap_in(staging: str, out: str) -> None:
    """Replace the dataset in `out` with the finished build in `staging`.

    Local: the files of `out` that a build does not write move into `staging`, then two renames
    swap the directories (`out` is never a mix of old and new files) and the old one is deleted.
    Remote (gs://, s3://: no directory rename): the old index.json is deleted first, then the
    old build files, then the new files are renamed in (copy and delete), index.json last; a
    failure meanwhile leaves `out` without index.json, i.e. unfinished, never a mixed dataset."""
    if not fs.is_remote(out):
        for name in os.listdir(out):
            if not _owned(name):
                os.rename(os.path.join(out, name), os.path.join(staging, name))
        aside = f"{staging}.replaced"
        os.rename(out, aside)
        os.rename(staging, out)
        fs.delete(aside)
        return
    FileSystems.delete([fs.join(out, INDEX_FILE)])
    old = [
        m.path
        for pattern in BUILD_FILES
        if pattern not in (INDEX_FILE, WORK_DIR)
        for m in FileSystems.match([fs.join(out, pattern)])[0].metadata_list
    ]
    if old:
        FileSystems.delete(old)
    new = [m.path for m in FileSystems.match([fs.join(staging, "*")])[0].metadata_list]
    new.sort(key=lambda p: posixpath.basename(p) == INDEX_FILE)  # index.json last
    for path in new:
        FileSystems.rename([path], [fs.join(out, posixpath.basename(path))])
    _delete_tree(staging)


def _read_clean(p: beam.Pipeline, config: BuildConfig):
    """Read and clean every input: train (or auto-split) and the separate validation inputs."""
    train_specs = readers.expand_inputs(config.inputs, config.split_bytes, config.text_mode)
    split = "train" if config.validation_inputs else "auto"
    docs = p | "read" >> ReadDocuments(train_specs, split, config) | "clean" >> Clean()
    if not config.validation_inputs:
        return docs
    val_specs = readers.expand_inputs(
        config.validation_inputs, config.split_bytes, config.text_mode
    )
    val = (
        p
        | "read validation" >> ReadDocuments(val_specs, "validation", config)
        | "clean validation" >> Clean()
    )
    return (docs, val) | "mix" >> beam.Flatten()


def _write_text(path: str, text: str) -> None:
    with FileSystems.create(path) as f:
        f.write(text.encode())


def _read_text(path: str) -> str:
    with FileSystems.open(path) as f:
        return f.read().decode()


def cache_clean_text(
    config: BuildConfig, out: str, beam_args: list[str], report=print, sample: int = 0
) -> dict | None:
    """The first pipeline: read → clean → cached clean text (`CacheFn`) and the documents'
    `HoldOutStats`, plus the tokenizer's sample of `sample` lines if asked; returns its
    counters. The build pipeline then reads the cache: the hold-out is decided before it starts,
    so it needs no side input over the corpus (which would make the runner buffer every document
    until it is known), and the text is cleaned once."""
    p = runners.make_pipeline(beam_args)
    cache_list = fs.join(out, CACHE_LIST)
    docs = _read_clean(p, config)
    fraction = config.validation_fraction
    stats = (
        docs
        | "batch stats" >> beam.Map(batch_hold_out_stats, fraction)
        | "corpus stats" >> MergeStats()
    )
    extra = {}
    if sample:
        max_bytes = int(config.tokenizer_sample_mb * 1e6)
        lines = SampleLines(sample, max_bytes)
        extra["sample"] = beam.pvalue.AsSingleton(docs | "sample" >> lines)

    def write_outputs(paths, stats, sample=None):
        if sample is not None:
            _write_text(fs.join(out, SAMPLE_FILE), json.dumps(sample))
        _write_text(cache_list, json.dumps({"files": paths, "hold_out_stats": stats.to_dict()}))

    _ = (  # one sink (runners that compute only what a sink needs run every branch)
        docs
        | "cache clean text" >> beam.ParDo(CacheFn(fs.join(out, WORK_DIR)))
        | "cache files" >> beam.combiners.ToList()
        | "write cache list"
        >> beam.Map(write_outputs, stats=beam.pvalue.AsSingleton(stats), **extra)
    )
    return run_and_report(p, "tokenizer sample" if sample else "clean text", config, report)


def train_tokenizer(config: BuildConfig, out: str, beam_args: list[str], report=print):
    """The first pipeline with the tokenizer's sample, and the training; returns the counters.
    Writes OUT/tokenizer.model."""
    sample_path = fs.join(out, SAMPLE_FILE)
    values = cache_clean_text(config, out, beam_args, report, sample=config.tokenizer_sample)
    sample = json.loads(_read_text(sample_path))
    if not sample:
        inputs = ", ".join(f"{spec.path} (read as {spec.corpus})" for spec in config.inputs)
        if values == {}:  # not a single document, page or file was counted
            raise BuildError(
                f"no documents found in {inputs}: is --corpus right for these files? (wiki: a "
                "MediaWiki XML dump; books: a directory of .txt books; text: .txt, .jsonl, .parquet)"
            )
        why = f" ({format_counters(values)})" if values else ""
        raise BuildError(
            f"no text to train the tokenizer on in {inputs}: every document was empty, binary or "
            f"skipped{why}; check --input and --corpus, or pass --tokenizer"
        )
    mb = sum(len(line.encode()) for line in sample) / 1e6
    report(
        f"training sentencepiece ({config.tokenizer_model_type}, vocab {config.vocab_size}, "
        f"{'cased' if config.cased else 'lower-cased'}) "
        f"on {len(sample)} lines, {mb:.1f} MB (--tokenizer-sample {config.tokenizer_sample}, "
        f"--tokenizer-sample-mb {config.tokenizer_sample_mb:g})"
    )
    start = time.time()
    seconds = progress.PipelineOptions(beam_args).view_as(progress.ProgressOptions).progress_seconds
    with progress.Heartbeat("training sentencepiece", report, seconds):
        model = tokenizer.train(
            sample, config.vocab_size, config.tokenizer_model_type, config.cased
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    report(
        f"sentencepiece trained in {time.time() - start:.1f}s; the driver's peak RSS {peak:.2f} GB"
    )
    with FileSystems.create(fs.join(out, TOKENIZER_FILE)) as f:
        f.write(model)
    FileSystems.delete([sample_path])
    return values


def given_tokenizer(config: BuildConfig) -> bytes:
    """The bytes of the dataset's tokenizer file when the build is given one: the sentencepiece
    model of --tokenizer, or the tokenizer.json of --hf-tokenizer with the toolkit's special ids."""
    if config.hf_tokenizer:
        try:
            return hf_tokenizer.prepare(config.hf_tokenizer)
        except hf_tokenizer.HFTokenizerError as e:
            raise BuildError(str(e)) from None
    with FileSystems.open(config.tokenizer) as f:
        return f.read()


def check_store(config: BuildConfig, beam_args: list[str]) -> None:
    """Remote inputs and output: the filesystems get the command line's options (`store`), and
    each path is checked before any work starts (credentials, bucket, input prefix)."""
    inputs = [spec.path for spec in (*config.inputs, *config.validation_inputs)]
    inputs = [p for p in inputs if not readers.is_fsspec(p)]  # the Hub: listed when expanded
    if not any(fs.is_remote(p) for p in (*inputs, config.output, config.tokenizer or "")):
        return
    options = store.configure(beam_args)
    for path in (*inputs, *([config.tokenizer] if config.tokenizer else [])):
        store.check(path, options)
    store.check(config.output, options, must_exist=False)


def build(config: BuildConfig, beam_args: list[str], overwrite: bool = False, report=print) -> dict:
    """Build the dataset of `config` and return its index (also written to OUT/index.json).
    With `overwrite`, an existing dataset is replaced only once the new one is complete."""
    out = config.output.rstrip("/")
    check_store(config, beam_args)
    work = _prepare_output(config, overwrite)
    if work == out:
        return _build_into(config, work, beam_args, report)
    try:
        index = _build_into(config, work, beam_args, report)
    except BaseException:
        try:
            _delete_tree(work)
        except Exception as e:  # the build's own error is the one to show
            log.warning("could not remove the unfinished build %s: %s", work, e)
        raise
    _swap_in(work, out)
    return index


def _build_into(config: BuildConfig, out: str, beam_args: list[str], report=print) -> dict:
    """The build itself, writing into `out` (OUT, or the new directory beside it), in four
    stages: the tokenizer, the shards, their manifest checked, index.json."""
    tok = _tokenizer_stage(config, out, beam_args, report)
    plan = _plan(config, out, tok)
    build_counters, hold_out = _shards_stage(plan, beam_args, report)
    shards = _written_shards(plan)
    index = _index(config, tok, shards, build_counters, plan.batch_rows)
    share = held_out_share(index)
    if hold_out.fraction > 0 and share is not None:  # how, and how much, was held out
        index["counters"]["validation_hold_out"] = hold_out.describe()
        index["counters"]["validation_fraction_obtained"] = round(share, 6)
    warnings = validation_warnings(index)
    for warning in warnings:
        log.warning("%s", warning)
    if warnings:  # in index.json too, where a later reader of the dataset sees them
        index["counters"]["warnings"] = warnings
    write_index(out, index)
    return json.loads(json.dumps(index))  # exactly what index.json holds (lists, not tuples)


@dataclass(frozen=True)
class TokenizerStage:
    """The first stage's result: OUT/tokenizer.model or OUT/tokenizer.json (given, or a
    sentencepiece model trained on the cleaned text)."""

    file: str  # its name in OUT: TOKENIZER_FILE, or TOKENIZER_JSON with --hf-tokenizer
    model: bytes  # the file's bytes
    vocab_size: int  # its ids (a trained one may have fewer than --vocab-size)
    cached: dict | None  # the cleaned text's cache {files, hold_out_stats}, when one was written
    counters: dict | None  # the sampling pipeline's counters ({} with a given tokenizer)
    trained: bool  # trained here: --vocab-size is what was asked for, not what it has


def _tokenizer_stage(config: BuildConfig, out: str, beam_args: list[str], report) -> TokenizerStage:
    """Copy the given tokenizer (`given_tokenizer`), or run the first pipeline and train one
    (`train_tokenizer`)."""
    tokenizer_file = TOKENIZER_JSON if config.hf_tokenizer else TOKENIZER_FILE
    model_path = fs.join(out, tokenizer_file)
    counters, cached = {}, None
    trained = not (config.tokenizer or config.hf_tokenizer)
    if not trained:
        model = given_tokenizer(config)
        with FileSystems.create(model_path) as f:
            f.write(model)
    else:
        counters = train_tokenizer(config, out, beam_args, report)
        cached = json.loads(_read_text(fs.join(out, CACHE_LIST)))
    with FileSystems.open(model_path) as f:
        model = f.read()
    vocab_size = tokenizer.encoder(tokenizer_file, model).vocab_size
    if trained and vocab_size < config.vocab_size:
        # tokenizer.train lets sentencepiece stop short (hard_vocab_limit=False) rather than fail
        log.warning(
            "--vocab-size %d is more than this corpus supports: sentencepiece made a vocabulary of "
            "%d pieces (index.json records both). Train on more text (--tokenizer-sample, more "
            "input) or pass --vocab-size %d or less to silence this",
            config.vocab_size,
            vocab_size,
            vocab_size,
        )
    return TokenizerStage(tokenizer_file, model, vocab_size, cached, counters, trained)


@dataclass(frozen=True)
class BuildPlan:
    """What the build pipeline is given: where it writes, how it holds out, shards and masks."""

    config: BuildConfig
    out: str
    model_path: str  # OUT/tokenizer.model or OUT/tokenizer.json
    fraction: float  # --validation-fraction (0 with --validation-input)
    cached: dict | None  # TokenizerStage.cached
    given: dict  # {split: shard count or None (from the size target)}
    size: ShardSize
    batch_rows: int  # rows per record batch, at most
    mask: MaskSpec

    @property
    def work_dir(self) -> str:
        return fs.join(self.out, WORK_DIR)


def _plan(config: BuildConfig, out: str, tok: TokenizerStage) -> BuildPlan:
    model_path = fs.join(out, tok.file)
    size = ShardSize(
        int(config.shard_size_mb * 2**20),
        2 if tok.vocab_size <= 65535 else 4,
        config.dupe_factor,
        config.mask_rate,
    )
    return BuildPlan(
        config,
        out,
        model_path,
        fraction=0.0 if config.validation_inputs else config.validation_fraction,
        cached=tok.cached,
        given={"train": config.num_shards, "validation": config.num_validation_shards},
        size=size,
        batch_rows=record_batch_rows(config.seq_len),
        mask=MaskSpec(
            model_path, config.seed, config.dupe_factor, config.mask_rate, config.whole_word
        ),
    )


def _shards_stage(plan: BuildPlan, beam_args: list[str], report) -> tuple[dict | None, HoldOut]:
    """Run the build pipeline; returns its counters (None: a runner without metrics) and the
    validation hold-out it applied (`shatter.pipeline.holdout.decide`).

    With the cleaned text cached, its statistics decide the hold-out before the build starts.
    With a given tokenizer: one pipeline, holding out whole documents by hash and counting the
    documents as it tokenizes them; only where the count decides otherwise (whole documents would make less than
    half or more than twice the fraction of the text) it runs again with that hold-out. No second branch reads the documents beside the
    build: a runner that keeps an output until all its readers are done (Dask) would hold them."""
    if plan.fraction == 0:
        return _run_build(plan, HoldOut(0.0), beam_args, report), HoldOut(0.0)
    if plan.cached is not None:
        stats = HoldOutStats(**plan.cached["hold_out_stats"])
        hold_out = decide(stats, plan.fraction)
        _report_hold_out(hold_out, stats, report)
        return _run_build(plan, hold_out, beam_args, report), hold_out
    by_hash, stats_path = HoldOut(plan.fraction), fs.join(plan.out, STATS_FILE)
    counters = _run_build(plan, by_hash, beam_args, report, stats_path)
    stats = HoldOutStats(**json.loads(_read_text(stats_path)))
    FileSystems.delete([stats_path])
    hold_out = decide(stats, plan.fraction)
    if hold_out != by_hash:
        _report_hold_out(hold_out, stats, report)
        report("building again with that hold-out")
        _sweep_build_files(plan.out)  # the first build's shards: their count may differ
        counters = _run_build(plan, hold_out, beam_args, report)
    return counters, hold_out


def _report_hold_out(hold_out: HoldOut, stats: HoldOutStats, report) -> None:
    """Say how the validation split is held out where it is not whole documents by hash."""
    f, n = hold_out.fraction, stats.documents
    if hold_out.tails:
        report(
            f"validation: the last {f:.1%} of each document's text (--validation-fraction {f:g}), "
            f"as whole documents would make {whole_document_share(stats):.1%} of it ({n} "
            f"document{'s' if n != 1 else ''}); to hold out text of your own, give "
            "--validation-input FILE"
        )
    elif hold_out.smallest_key is not None:
        report(
            f"validation: no document of {n} is held out by hash at --validation-fraction {f:g}, "
            f"so the one of smallest key ({whole_document_share(stats):.1%} of the text)"
        )


def _run_build(
    plan: BuildPlan, hold_out: HoldOut, beam_args: list[str], report, stats_path: str = ""
) -> dict | None:
    """The build pipeline: (cached or freshly cleaned) documents → tokenize (split by `hold_out`)
    → pack → shard, mask and write; with `stats_path`, the documents' `HoldOutStats` there."""
    config, p = plan.config, runners.make_pipeline(beam_args)
    if plan.cached is None:
        docs = _read_clean(p, config)
    else:
        docs = p | "read cleaned" >> ReadCache(plan.cached["files"])
    tokenized = docs | "tokenize" >> Tokenize(plan.model_path, hold_out, stats=bool(stats_path))
    if stats_path:
        _ = (
            tokenized.stats
            | "corpus stats" >> MergeStats()
            | "write stats" >> beam.Map(lambda s: _write_text(stats_path, json.dumps(s.to_dict())))
        )
        tokenized = tokenized.tokenized
    write = ShardAndWrite(
        plan.out, plan.work_dir, plan.given, plan.mask, config.spill_rows, plan.size,
        plan.batch_rows,
    )  # fmt: skip
    _ = (
        tokenized
        | "pack" >> Pack(config.seq_len, config.cross_document)
        | "shard, mask and write" >> write
    )
    return run_and_report(p, "build", config, report)


def _written_shards(plan: BuildPlan) -> dict[str, list[dict]]:
    """Each split's shards from the writers' manifest, every one of them there (a runner that
    lost a shard's write must not give an index.json without it); the work directory removed."""
    infos = sorted(read_manifest(plan.work_dir), key=lambda r: (r["split"], r["shard"]))
    # each shard's manifest records its split's shard count (given, or from the split's size)
    counts = {s: max((r["count"] for r in infos if r["split"] == s), default=1) for s in plan.given}
    missing = sorted(
        {(split, i) for split, n in counts.items() for i in range(n)}
        - {(r["split"], r["shard"]) for r in infos}
    )
    if missing:
        raise BuildError(
            f"the build wrote {len(infos)} of {sum(counts.values())} shards in {plan.out} "
            f"(missing: {', '.join(f'{s} {i}' for s, i in missing[:5])}): the runner dropped "
            "work; build again"
        )
    _delete_tree(plan.work_dir)
    return {split: [r for r in infos if r["split"] == split] for split in counts}


# the options of the sentencepiece model a build trains: not recorded for a given tokenizer
TRAINING_ONLY = (
    "vocab_size",
    "cased",
    "tokenizer_sample",
    "tokenizer_sample_mb",
    "tokenizer_model_type",
)


def _index(
    config: BuildConfig,
    tok: TokenizerStage,
    shards: dict[str, list[dict]],
    build_counters: dict | None,
    batch_rows: int,
) -> dict:
    """index.json's content: the config, the tokenizer, the shards and the counters (a runner
    without metrics: the rows and shards the manifest gives, and which counters are missing)."""
    recorded = config.to_dict()
    if tok.trained:
        recorded["requested_vocab_size"] = config.vocab_size  # tokenizer.vocab_size: what it has
    else:  # a given tokenizer: the options of training one were not used (its own size is
        for key in TRAINING_ONLY:  # tokenizer.vocab_size, its case its own normalization's)
            recorded.pop(key, None)
    unavailable = None
    if tok.counters is None or build_counters is None:  # a runner without metrics (Dask)
        every = [r for split in shards.values() for r in split]
        counters = {"rows": sum(r["rows"] for r in every), "shards_written": len(every)}
        unavailable = RUNNER_ONLY_COUNTERS
    else:  # the reading counters come from the sampling pipeline when it cached the clean text
        keys = sorted(set(tok.counters) | set(build_counters))
        counters = {k: tok.counters.get(k, 0) + build_counters.get(k, 0) for k in keys}
    return build_index(
        shards,
        seq_len=config.seq_len,
        dupe_factor=config.dupe_factor,
        tokenizer_file=tok.file,
        tokenizer_sha256=hashlib.sha256(tok.model).hexdigest(),
        vocab_size=tok.vocab_size,
        special_ids=tokenizer.SPECIAL_PIECES,
        config=recorded,
        counters=counters,
        counters_unavailable=unavailable,
        record_batch_rows=batch_rows,  # at most; the loader shuffles rows by such blocks
    )
