"""`shatter-data build`: the driver that runs the Beam pipelines and writes index.json last.

Two pipelines when a tokenizer must be trained (it necessarily sits between them), one otherwise:
  1. read → clean → sample lines (the n smallest line hashes) → the driver trains sentencepiece;
  2. read → clean → tokenize → pack → shard → mask → write, then index.json from the shard
     manifest and Beam's counters.
Any Beam runner works: unknown command-line options become `PipelineOptions`; without `--runner`
the in-process FnApiRunner is used (never Prism, which would be downloaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions, WorkerOptions
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo
from apache_beam.runners.portability.portable_runner import JobServiceHandle

from pipeline import progress, readers, tokenizer
from pipeline.config import BuildConfig
from pipeline.format import FORMAT, INDEX_FILE, TOKENIZER_FILE, VERSION, fs, write_index
from pipeline.sink import ShardAndWrite
from pipeline.transforms import (
    NAMESPACE,
    CacheFn,
    Clean,
    MaskSpec,
    Pack,
    ReadCache,
    ReadDocuments,
    SampleLines,
    Tokenize,
)

log = logging.getLogger(__name__)
SAMPLE_FILE, MANIFEST_FILE, WORK_DIR = ".tokenizer-sample.txt", ".shards-manifest.json", ".work"
CACHE_LIST = ".work/clean-files.json"


class BuildError(Exception):
    """A build that cannot go on; the message says why (the CLI prints it without a traceback)."""


# Names that make Beam's SwitchingDirectRunner try Prism first, which it downloads (and which cannot
# be downloaded offline); for this batch pipeline it would then pick the FnApiRunner anyway.
SWITCHING_RUNNERS = ("DirectRunner", "SwitchingDirectRunner")


def make_pipeline(beam_args: list[str]) -> beam.Pipeline:
    options = PipelineOptions(
        beam_args
    )  # the command line's unknown options: runner, workers, project, ...
    runner = options.view_as(StandardOptions).runner
    if runner in SWITCHING_RUNNERS:
        log.warning(
            "--runner %s: running on the in-process FnApiRunner, which DirectRunner picks for this "
            "pipeline, without trying to download Prism first (pass --runner PrismRunner for Prism)",
            runner,
        )
        runner = None
    if runner is None:
        return beam.Pipeline(runner=_fn_api_runner(options), options=options)
    return beam.Pipeline(options=options)


def _fn_api_runner(options: PipelineOptions) -> FnApiRunner:
    """The FnApiRunner with the options in its provision info (as Beam's DirectRunner builds it), so
    that `multi_processing` workers get them too (filesystem options, log level); their log level
    follows the driver's "apache_beam" logger unless `--default_sdk_harness_log_level` is given."""
    harness = options.view_as(WorkerOptions)
    if harness.default_sdk_harness_log_level is None:
        harness.default_sdk_harness_log_level = logging.getLevelName(
            logging.getLogger("apache_beam").getEffectiveLevel()
        )
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    provision = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return FnApiRunner(provision_info=ExtendedProvisionInfo(provision))


def run_and_report(pipeline: beam.Pipeline, stage: str, report=print) -> dict:
    """Run to completion, reporting the "shatter" counters every `--progress_seconds` meanwhile
    (`pipeline.progress`: the live tally of a local runner, or Beam's metrics of a running job)
    and Beam's committed counters at the end."""
    start = time.time()
    seconds = pipeline.options.view_as(progress.ProgressOptions).progress_seconds
    with progress.LiveReport(stage, report, seconds) as live:
        result = pipeline.run()  # the FnApiRunner runs the whole pipeline here
        if not beam.runners.runner.PipelineState.is_terminal(result.state):
            live.follow(lambda: counters(result))
        result.wait_until_finish()  # also what drives the BundleBasedDirectRunner's state to DONE
    values = counters(result)
    report(f"[{stage} done in {time.time() - start:.1f}s] {format_counters(values)}")
    return values


def counters(result) -> dict:
    """The "shatter" namespace counters of a pipeline result (committed where the runner has them)."""
    out = {}
    query = result.metrics().query(beam.metrics.MetricsFilter().with_namespace(NAMESPACE))
    for c in query["counters"]:
        try:
            value = c.committed
        except Exception:  # some runners only report attempted values
            value = None
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(
            value if value is not None else c.attempted
        )
    return dict(sorted(out.items()))


def format_counters(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items()) or "(no counters yet)"


def _delete_tree(path: str) -> None:
    """Remove a work directory and everything under it (any filesystem)."""
    found = FileSystems.match([FileSystems.join(path, "*")])[0].metadata_list
    if found:
        FileSystems.delete([m.path for m in found])
    if FileSystems.exists(path):
        FileSystems.delete([path])


def _prepare_output(config: BuildConfig, overwrite: bool) -> None:
    out = config.output
    index = fs.join(out, INDEX_FILE)
    if FileSystems.exists(index):
        if not overwrite:
            raise BuildError(
                f"{out} already holds a dataset (index.json); pass --overwrite to replace it"
            )
        FileSystems.delete([index])  # first, so an interrupted rebuild never looks complete
    # only what a build writes: never other files a user keeps next to the dataset
    stale = [
        m.path
        for pattern in (
            "train-*-of-*.arrow",
            "validation-*-of-*.arrow",
            ".tmp-*",
            SAMPLE_FILE,
            MANIFEST_FILE,
        )
        for m in FileSystems.match([fs.join(out, pattern)])[0].metadata_list
    ]
    if stale:
        FileSystems.delete(stale)
    _delete_tree(fs.join(out, WORK_DIR))
    if not FileSystems.exists(out):
        FileSystems.mkdirs(out)


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


def train_tokenizer(config: BuildConfig, beam_args: list[str], report=print) -> dict:
    """Pipeline 1 and the training; returns the counters. Writes OUT/tokenizer.model."""
    sample_path = fs.join(config.output, SAMPLE_FILE)
    p = make_pipeline(beam_args)
    cache_list = fs.join(config.output, CACHE_LIST)
    docs = _read_clean(p, config)
    lines = docs | "sample" >> SampleLines(config.tokenizer_sample)
    _ = lines | "write sample" >> beam.Map(lambda ls: _write_text(sample_path, json.dumps(ls)))
    _ = (
        docs
        | "cache clean text" >> beam.ParDo(CacheFn(fs.join(config.output, WORK_DIR)))
        | "cache files" >> beam.combiners.ToList()
        | "write cache list" >> beam.Map(lambda paths: _write_text(cache_list, json.dumps(paths)))
    )
    values = run_and_report(p, "tokenizer sample", report)
    sample = json.loads(_read_text(sample_path))
    report(
        f"training sentencepiece ({config.tokenizer_model_type}, vocab {config.vocab_size}) "
        f"on {len(sample)} lines"
    )
    model = tokenizer.train(sample, config.vocab_size, config.tokenizer_model_type)
    with FileSystems.create(fs.join(config.output, TOKENIZER_FILE)) as f:
        f.write(model)
    FileSystems.delete([sample_path])
    return values


def build(config: BuildConfig, beam_args: list[str], overwrite: bool = False, report=print) -> dict:
    """Build the dataset of `config` and return its index (also written to OUT/index.json)."""
    _prepare_output(config, overwrite)
    model_path = fs.join(config.output, TOKENIZER_FILE)
    sample_counters, cached = {}, None
    if config.tokenizer:
        with FileSystems.open(config.tokenizer) as f:
            model = f.read()
        with FileSystems.create(model_path) as f:
            f.write(model)
    else:
        sample_counters = train_tokenizer(config, beam_args, report)
        cached = json.loads(_read_text(fs.join(config.output, CACHE_LIST)))
    with FileSystems.open(model_path) as f:
        model = f.read()
    sp = tokenizer.load(model)
    vocab_size = sp.get_piece_size()
    counts = {"train": config.num_shards, "validation": config.num_validation_shards}
    work_dir = fs.join(config.output, WORK_DIR)
    manifest_path = fs.join(config.output, MANIFEST_FILE)

    p = make_pipeline(beam_args)
    docs = _read_clean(p, config) if cached is None else p | "read cleaned" >> ReadCache(cached)
    mask = MaskSpec(
        model_path, config.seed, config.dupe_factor, config.mask_rate, config.whole_word
    )
    infos = (
        docs
        | "tokenize"
        >> Tokenize(model_path, 0.0 if config.validation_inputs else config.validation_fraction)
        | "pack" >> Pack(config.seq_len, config.cross_document)
        | "shard, mask and write"
        >> ShardAndWrite(config.output, work_dir, counts, mask, config.spill_rows)
        | "collect" >> beam.combiners.ToList()
    )
    _ = infos | "manifest" >> beam.Map(lambda rows: _write_text(manifest_path, json.dumps(rows)))
    build_counters = run_and_report(p, "build", report)

    infos = sorted(json.loads(_read_text(manifest_path)), key=lambda r: (r["split"], r["shard"]))
    FileSystems.delete([manifest_path])
    _delete_tree(work_dir)
    index = {
        "format": FORMAT,
        "version": VERSION,
        "seq_len": config.seq_len,
        "dupe_factor": config.dupe_factor,
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256": hashlib.sha256(model).hexdigest(),
            "vocab_size": vocab_size,
            "special_ids": dict(tokenizer.SPECIAL_PIECES),
        },
        "config": config.to_dict(),
        "splits": {
            split: {
                "shards": [
                    {k: r[k] for k in ("file", "rows", "tokens", "bytes", "sha256")}
                    for r in infos
                    if r["split"] == split
                ]
            }
            for split in counts
        },
        # the reading counters come from the sampling pipeline when it cached the clean text
        "counters": {
            k: sample_counters.get(k, 0) + build_counters.get(k, 0)
            for k in sorted(set(sample_counters) | set(build_counters))
        },
    }
    for _split, entry in index["splits"].items():
        entry["rows"] = sum(s["rows"] for s in entry["shards"])
        entry["tokens"] = sum(s["tokens"] for s in entry["shards"])
    write_index(config.output, index)
    return json.loads(json.dumps(index))  # exactly what index.json holds (lists, not tuples)
