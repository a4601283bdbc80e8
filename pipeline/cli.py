"""`shatter-data`: build, inspect and verify shard datasets (thin click commands).

Options that click does not know are handed to Beam as `PipelineOptions`, so
`--runner DataflowRunner --project P --region R --temp_location gs://B/tmp --setup_file ./setup.py`
or `--direct_num_workers 2 --direct_running_mode multi_processing` work unchanged. Each must be one
that Beam declares (a typo is an error with a did-you-mean, `pipeline.runners.check_options`);
what follows `--` goes to the runner unchecked.
"""

from __future__ import annotations

import atexit
import importlib.abc
import logging
import os
import re
import sys
import threading

import click

from pipeline.config import CORPORA, DASK_RUNNERS, SWITCHING_RUNNERS, BuildConfig, InputSpec


class _DropBeamImportNoise(logging.Filter):
    """Importing Beam warns "apitools not found ..." (its optional BigQuery client) on every command."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # ... and Beam's S3 reader logs a failed read on the root logger; the CLI reports it
        return not message.startswith(("apitools not found", "HTTP error while requesting file"))


def configure_logging(verbose: bool) -> None:
    """Our warnings on stderr (INFO with -v); Beam's own logging only with -v, except that it
    dropped an option it could not parse (a typo would otherwise go unnoticed). Called before Beam
    is imported: its import would otherwise configure the root logger first."""
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropBeamImportNoise())
    # a failing worker's traceback is logged by Beam; without -v the CLI prints the cause itself
    logging.getLogger("apache_beam").setLevel(logging.INFO if verbose else logging.CRITICAL)
    logging.getLogger("apache_beam.options.pipeline_options").setLevel(logging.WARNING)


def _inputs(values, default_corpus: str, index: str | None) -> tuple[InputSpec, ...]:
    """`PATH` (the --corpus reader) or `CORPUS=PATH` (mixing corpora in one build)."""
    specs = []
    for value in values:
        corpus, sep, path = value.partition("=")
        if not sep or corpus not in CORPORA:
            corpus, path = default_corpus, value
        specs.append(InputSpec(corpus, path, index if corpus == "wiki" else None))
    return tuple(specs)


def _fail(message: str) -> None:
    click.echo(f"shatter-data: error: {message}", err=True)
    sys.exit(1)


class _BuildCommand(click.Command):
    """`build`: everything after `--` is kept aside, unparsed and unchecked, for the runner."""

    def parse_args(self, ctx, args):
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["runner_args"] = args[:cut], args[cut + 1 :]
        return super().parse_args(ctx, args)


def _clean_message(e: BaseException) -> str:
    """Our own error text out of a runner's wrapped exception (which carries a remote traceback)."""
    text = str(e)
    found = re.findall(
        r"shatter-data input error: ([^\n]+?)(?: \[while running [^\n]*)?$", text, re.M
    )
    return (
        found[-1] if found else text.strip().splitlines()[-1] if text.strip() else type(e).__name__
    )


@click.group()
def main():
    """Shard datasets for pretraining: build (Apache Beam), inspect, verify."""
    configure_logging(verbose=False)


@main.command(
    cls=_BuildCommand,
    context_settings=dict(ignore_unknown_options=True, allow_extra_args=True),
)
@click.option(
    "--corpus",
    type=click.Choice(CORPORA),
    default="text",
    show_default=True,
    help="reader for inputs not prefixed with CORPUS=",
)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    required=True,
    help="file, glob or directory (repeatable); CORPUS=PATH mixes corpora, e.g. books=data/books",
)
@click.option(
    "--wiki-index",
    default=None,
    help="multistream index of the wiki dump (parallel reads by stream)",
)
@click.option("--output", required=True, help="dataset directory (local or gs://, s3://, ...)")
@click.option(
    "--validation-input",
    "validation_inputs",
    multiple=True,
    help="separate validation corpus (repeatable); else --validation-fraction is held out",
)
@click.option("--validation-fraction", type=float, default=0.005, show_default=True)
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--vocab-size", type=int, default=32000, show_default=True)
@click.option("--tokenizer", default=None, help="existing sentencepiece model (skips training)")
@click.option(
    "--tokenizer-sample",
    type=int,
    default=2_000_000,
    show_default=True,
    help="lines of cleaned text the tokenizer is trained on",
)
@click.option(
    "--tokenizer-sample-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=BuildConfig.tokenizer_sample_mb,
    show_default=True,
    help="and at most this many MB of them: the tokenizer trainer's memory grows with its sample",
)
@click.option(
    "--tokenizer-model-type",
    type=click.Choice(["unigram", "bpe"]),
    default="unigram",
    show_default=True,
)
@click.option(
    "--cased/--uncased",
    default=False,
    show_default=True,
    help="the sentencepiece model the build trains keeps case (NFKC only), or folds it",
)
@click.option(
    "--hf-tokenizer",
    default=None,
    help="a Hugging Face tokenizer instead of sentencepiece: tokenizer.json, its directory, or a "
    "Hub name (e.g. bert-base-uncased); its special tokens move to ids 0-4",
)
@click.option(
    "--dupe-factor", type=int, default=5, show_default=True, help="static maskings per row"
)
@click.option("--mask-rate", type=float, default=0.15, show_default=True)
@click.option("--whole-word/--no-whole-word", default=False, show_default=True)
@click.option(
    "--cross-document/--no-cross-document",
    default=True,
    show_default=True,
    help="whether rows may span documents",
)
@click.option(
    "--shard-size-mb",
    type=float,
    default=128,
    show_default=True,
    help="shard size target (Arrow data before zstd): the shard count follows from the data",
)
@click.option("--num-shards", type=int, help="train shards (overrides --shard-size-mb)")
@click.option("--num-validation-shards", type=int, help="validation shards (likewise)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--text-field",
    "--text-column",
    "text_field",
    default="text",
    show_default=True,
    help="JSON field / Parquet column (text corpus)",
)
@click.option(
    "--text-mode",
    type=click.Choice(["paragraph", "line"]),
    default="paragraph",
    show_default=True,
    help=".txt documents: blank-line separated, or one per line",
)
@click.option(
    "--on-error",
    type=click.Choice(["skip", "stop"]),
    default="skip",
    show_default=True,
    help="truncated/broken input: skip the rest of that file (counted) or stop",
)
@click.option(
    "--spill-rows",
    type=click.IntRange(min=1),
    default=BuildConfig.spill_rows,
    show_default=True,
    help="rows a worker buffers before it sorts and spills them to a temporary file (memory: "
    "about 3 x rows x --seq-len x 4 bytes at a spill; the shards do not depend on it)",
)
@click.option("--overwrite", is_flag=True, help="replace an existing dataset in --output")
@click.option(
    "--progress-seconds",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="seconds between progress lines (counters, docs/s, tokens/s) while building; 0: none",
)
@click.option("-v", "--verbose", is_flag=True)
@click.pass_context
def build(
    ctx,
    corpus,
    inputs,
    wiki_index,
    output,
    validation_inputs,
    validation_fraction,
    seq_len,
    vocab_size,
    tokenizer,
    tokenizer_sample,
    tokenizer_sample_mb,
    tokenizer_model_type,
    cased,
    hf_tokenizer,
    dupe_factor,
    mask_rate,
    whole_word,
    cross_document,
    shard_size_mb,
    num_shards,
    num_validation_shards,
    seed,
    text_field,
    text_mode,
    on_error,
    spill_rows,
    overwrite,
    verbose,
    progress_seconds,
):
    """Build OUT from corpora. Extra options (e.g. --runner, --direct_num_workers) go to Beam;
    options that only the runner knows go after `--` (passed on unchecked)."""
    configure_logging(verbose)
    from pipeline.build import BuildError, build as run_build
    from pipeline.format import DatasetError
    from pipeline.runners import OptionError, check_options
    from pipeline.wiki import InputError

    try:
        check_options(
            list(ctx.args),
            {name for p in ctx.command.params for o in p.opts for name in [o.lstrip("-")]},
        )
    except OptionError as e:
        _fail(str(e))
    try:
        config = BuildConfig(
            inputs=_inputs(inputs, corpus, wiki_index),
            output=output,
            validation_inputs=_inputs(validation_inputs, corpus, None),
            validation_fraction=validation_fraction,
            seq_len=seq_len,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            tokenizer_sample=tokenizer_sample,
            tokenizer_sample_mb=tokenizer_sample_mb,
            tokenizer_model_type=tokenizer_model_type,
            cased=cased,
            hf_tokenizer=hf_tokenizer,
            dupe_factor=dupe_factor,
            mask_rate=mask_rate,
            whole_word=whole_word,
            cross_document=cross_document,
            num_shards=num_shards,
            num_validation_shards=num_validation_shards,
            shard_size_mb=shard_size_mb,
            seed=seed,
            text_field=text_field,
            text_mode=text_mode,
            on_error=on_error,
            spill_rows=spill_rows,
        )
        beam_args = [  # --progress_seconds is a Beam option (pipeline.progress)
            f"--progress_seconds={progress_seconds}",
            *ctx.args,
            *ctx.meta.get("runner_args", ()),
        ]
        index = run_build(
            config, beam_args, overwrite=overwrite, report=lambda m: click.echo(m, err=True)
        )
    except (ValueError, BuildError, InputError, DatasetError) as e:
        _fail(_clean_message(e))
    except Exception as e:  # a runner wraps worker errors; show ours without the remote traceback
        if "shatter-data input error" in str(e):
            _fail(_clean_message(e))
        if verbose:
            raise
        # anything else (a runner that cannot start, a worker crash): one line; -v shows the traceback
        from pipeline.store import failure

        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        kept = " (the dataset already there is unchanged)" if overwrite else ""
        if store_failed := failure(e):
            _fail(f"{store_failed}; no index.json was written{kept}. Build again once it answers")
        _fail(
            f"the build failed ({type(e).__name__}: {last}); no index.json was written{kept}. "
            "Run again with -v for the full traceback"
        )
    rows = {s: v["rows"] for s, v in index["splits"].items()}
    click.echo(f"wrote {output}: rows {rows}, vocab {index['tokenizer']['vocab_size']}")


def _open_store(ctx, out: str) -> None:
    """A remote OUT: Beam's filesystems get the extra options (`--s3_endpoint_url`, ...; else the
    environment's), and OUT is checked (credentials, bucket, prefix) before it is read."""
    from pipeline.format.store import fs

    if fs.is_remote(out):
        from pipeline import store
        from pipeline.runners import OptionError, check_options

        try:
            check_options(list(ctx.args))
        except OptionError as e:
            _fail(str(e))
        store.check(out, store.configure(ctx.args))


# inspect and verify take Beam's filesystem options (`--s3_*`) for a remote OUT
_STORE_ARGS = dict(ignore_unknown_options=True, allow_extra_args=True)


@main.command(context_settings=_STORE_ARGS)
@click.argument("out")
@click.option("--rows", type=int, default=3, show_default=True, help="sample rows to decode")
@click.option("--split", default="train", show_default=True)
@click.pass_context
def inspect(ctx, out, rows, split):
    """Stats, a length histogram and decoded sample rows with their masks."""
    from pipeline.format import DatasetError
    from pipeline.inspect import inspect_dataset

    try:
        _open_store(ctx, out)
        click.echo(inspect_dataset(out, rows, split))
    except DatasetError as e:
        _fail(str(e))


@main.command(context_settings=_STORE_ARGS)
@click.argument("out")
@click.pass_context
def verify(ctx, out):
    """Check checksums, schema and counts; exit non-zero naming the first bad file."""
    from pipeline.format import DatasetError
    from pipeline.inspect import verify_dataset

    try:
        _open_store(ctx, out)
        problems = verify_dataset(out)
    except DatasetError as e:
        _fail(str(e))
    for problem in problems:
        click.echo(f"FAIL {problem}", err=True)
    if problems:
        sys.exit(1)
    click.echo(f"OK {out}")


# the runners (None: the in-process default) on which the build is tested with a driver that has no
# pandas (the core install: tests/pipeline/test_core_install.py)
_RUNNERS_WITHOUT_PANDAS = (None, *SWITCHING_RUNNERS, *DASK_RUNNERS)


def _runner_named(args: list[str]) -> str | None:
    """The `--runner` of a build's arguments (None: the default)."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith("--runner="):
            return arg.split("=", 1)[1]
        if arg == "--runner" and i + 1 < len(args):
            return args[i + 1]
    return None


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """Imports of pandas fail as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (shatter-data build)", name=name)
        return None


def _build_without_pandas(args: list[str]) -> None:
    """Importing Beam imports pandas, where it is installed, for Beam's optional pandas batch
    converters: a quarter of its import time (0.5 s per build). The build uses none of them, and
    on the runners it is tested on, it runs in the core install, which has no pandas; so a
    `shatter-data build` process on them runs as it does there. Workers of their own (Dask's,
    `multi_processing`'s) import what they have."""
    if "pandas" not in sys.modules and _runner_named(args) in _RUNNERS_WITHOUT_PANDAS:
        sys.meta_path.insert(0, _WithoutPandas())


def _exit_status(code) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, a message is 1 (printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def entry() -> None:
    """The `shatter-data` program (its console script, and `python -m pipeline.cli`): `main`, then
    the exit handlers (logging's, Beam's, temporary directories'), and then the process ends
    without the interpreter's teardown, which frees every module and object one by one: half a
    second after a build, of nothing left to do (every file is closed, stdout and stderr are
    flushed here). With a thread still running, the exit is the interpreter's own."""
    try:
        import apache_beam  # noqa: F401  (a training node's install has none)
    except ImportError:
        sys.exit(
            "shatter-data: error: shatter-data needs Apache Beam (the `pipeline` extra), which is "
            "not installed: pip install 'shatter-toolkit[pipeline]'"
        )
    if sys.argv[1:2] == ["build"]:
        _build_without_pandas(sys.argv[2:])
    status = 0
    try:
        main()  # standalone: ends in SystemExit, or an exception (a traceback, the normal exit)
    except SystemExit as e:
        status = _exit_status(e.code)
        if threading.active_count() > 1:
            raise
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # its reader is gone (`| head`), or it is closed
            pass
    os._exit(status)


if __name__ == "__main__":
    entry()
