"""`shatter-data`: build, inspect and verify shard datasets (thin click commands).

Options that click does not know are handed to Beam as `PipelineOptions`, so
`--runner DataflowRunner --project P --region R --temp_location gs://B/tmp --setup_file ./setup.py`
or `--direct_num_workers 2 --direct_running_mode multi_processing` work unchanged. Each must be one
that Beam declares (a typo is an error with a did-you-mean, `shatter.pipeline.runners.check_options`);
what follows `--` goes to the runner unchecked.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import threading
import traceback

import click

from shatter.options import click_options, group
from shatter.pipeline import process
from shatter.pipeline.config import CORPORA, BuildConfig, InputSpec

_USER_GRPC_VERBOSITY = os.environ.get("GRPC_VERBOSITY")  # the user's own setting is kept


class _DropBeamImportNoise(logging.Filter):
    """Importing Beam warns "apitools not found ..." (its optional BigQuery client) on every command.
    Upstream: no apache/beam issue as of 2026-11-27; the open move of Beam's BigQuery off apitools
    would end it: https://github.com/apache/beam/pull/39087."""

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
    threading.excepthook = _log_beam_thread_errors
    # gRPC's C core (Beam's runner and its workers talk over it) prints INFO lines to stderr,
    # e.g. "Got goaway ... err=UNAVAILABLE" when a worker dies; read when it starts, by the
    # workers too. The build's own line says what failed; -v keeps gRPC's INFO.
    if _USER_GRPC_VERBOSITY is None:
        os.environ["GRPC_VERBOSITY"] = "INFO" if verbose else "ERROR"


def _log_beam_thread_errors(args) -> None:
    """An exception that ends one of Beam's own threads (a `multi_processing` worker process that
    died: "Worker subprocess exited with return code 137") goes to Beam's logger, shown with -v,
    not as a bare traceback: the build's one line names the failure. Others: Python's default."""
    frames = traceback.extract_tb(args.exc_traceback)
    if not frames or f"{os.sep}apache_beam{os.sep}" not in frames[-1].filename:
        threading.__excepthook__(args)
        return
    name = args.thread.name if args.thread else "?"
    exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
    logging.getLogger("apache_beam").error("Beam's thread %s failed", name, exc_info=exc_info)


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


@group()
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
@click.option(
    "--validation-input",
    "validation_inputs",
    multiple=True,
    help="separate validation corpus (repeatable); else --validation-fraction is held out",
)
@click_options(BuildConfig, defaults=True)  # pipeline/config.py: its fields declared as options
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
    validation_inputs,
    overwrite,
    verbose,
    progress_seconds,
    **fields,
):
    """Build OUT from corpora. Extra options (e.g. --runner, --direct_num_workers) go to Beam;
    options that only the runner knows go after `--` (passed on unchecked)."""
    configure_logging(verbose)
    from shatter.pipeline.build import BuildError, build as run_build
    from shatter.pipeline.runners import OptionError, check_options
    from shatter.pipeline.wiki import InputError
    from shatter.shards import DatasetError

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
            validation_inputs=_inputs(validation_inputs, corpus, None),
            **fields,
        )
        beam_args = [  # --progress_seconds is a Beam option (shatter.pipeline.progress)
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
        from shatter.pipeline.store import failure

        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        kept = " (the dataset already there is unchanged)" if overwrite else ""
        if store_failed := failure(e):
            _fail(f"{store_failed}; no index.json was written{kept}. Build again once it answers")
        _fail(
            f"the build failed ({type(e).__name__}: {last}); no index.json was written{kept}. "
            "Run again with -v for the full traceback"
        )
    rows = {s: v["rows"] for s, v in index["splits"].items()}
    click.echo(f"wrote {config.output}: rows {rows}, vocab {index['tokenizer']['vocab_size']}")


def _open_store(ctx, out: str) -> None:
    """A remote OUT: Beam's filesystems get the extra options (`--s3_endpoint_url`, ...; else the
    environment's), and OUT is checked (credentials, bucket, prefix) before it is read."""
    from shatter.shards.store import fs

    if fs.is_remote(out):
        from shatter.pipeline import store
        from shatter.pipeline.runners import OptionError, check_options

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
    from shatter.pipeline.inspect import inspect_dataset
    from shatter.shards import DatasetError

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
    from shatter.pipeline.inspect import verify_dataset
    from shatter.shards import DatasetError

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


def entry() -> None:
    """The `shatter-data` program (its console script, and `python -m shatter.pipeline.cli`): `main`,
    with the two workarounds of `shatter.pipeline.process` (a build without pandas, no teardown); on an
    install without Apache Beam (a training node's), one line naming the extra to install."""
    if importlib.util.find_spec("apache_beam") is None:  # a training node's install has none
        sys.exit(
            "shatter-data: error: shatter-data needs Apache Beam (the `pipeline` extra), which is "
            "not installed: pip install 'shatter-toolkit[pipeline]'"
        )
    if sys.argv[1:2] == ["build"]:
        process.hide_pandas(sys.argv[2:])
    process.exit_without_teardown(main)


if __name__ == "__main__":
    entry()
