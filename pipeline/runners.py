"""Runners and their options: which Beam runner a build runs on, the checked command-line options
it gets, and the counters it reports.

- No `--runner`: the in-process FnApiRunner (never Prism, which would be downloaded), with the
  options in its provision info so that `multi_processing` workers get them too.
- `--runner DaskRunner` (or Beam's full `apache_beam.runners.dask.dask_runner.DaskRunner`): Beam's
  Dask runner with this pipeline's fixes (`pipeline/dask_runner.py` lists them).
- Any other runner by name, with its options (`--project`, `--flink_master`, ...).

Beam discards the options it cannot parse with a warning, so a misspelled one (`--direct_num_workrs
2`) would build with the default: `check_options` makes that an error naming the option, with a
did-you-mean, except for what follows `--` on the command line (runner-specific flags that Beam's
Python SDK does not declare, which portable runners hand to their job server).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import signal
import socket
import sys

import apache_beam as beam
from apache_beam.options.pipeline_options import (
    PipelineOptions,
    PortableOptions,
    StandardOptions,
    WorkerOptions,
)
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo
from apache_beam.runners.portability.portable_runner import JobServiceHandle
from apache_beam.transforms.environments import SubprocessSDKEnvironment

from shatter.pipeline import (
    progress,  # noqa: F401  (registers --progress_seconds with Beam's options)
    store,
)
from shatter.pipeline.config import DASK_RUNNERS, SWITCHING_RUNNERS

log = logging.getLogger(__name__)

DASK_MODULE = "apache_beam.runners.dask.dask_runner"


class OptionError(ValueError):
    """A command-line option that no Beam options class declares (the message names it)."""


def _runner_name(args: list[str]) -> str | None:
    return PipelineOptions(args).view_as(StandardOptions).runner


def _import_runner_options(runner: str | None) -> None:
    """A runner's options class is declared in its module: import it before parsing (Dask's)."""
    if runner in DASK_RUNNERS:
        try:
            importlib.import_module(DASK_MODULE)
        except ImportError as e:  # Beam imports dask lazily; its own module imports fine without
            raise OptionError(_no_dask(e)) from None
    elif runner and "." in runner:
        try:
            importlib.import_module(runner.rsplit(".", 1)[0])
        except ImportError:
            pass  # Beam names the missing module when it creates the runner


def _no_dask(e: Exception) -> str:
    return (
        f"--runner DaskRunner needs dask.distributed ({e}); install it with "
        "pip install 'shatter-toolkit[pipeline-dask]' (or pip install 'dask[distributed]')"
    )


def check_options(args: list[str], ours: set[str] = frozenset()) -> None:
    """An OptionError for the first option in `args` that no Beam options class declares, or for
    a stray value, with the closest known option (Beam's or, spelled with `_`, one of `ours`)."""
    _import_runner_options(_runner_name(args))
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    class Parser(_BeamArgumentParser):
        def error(self, message):  # argparse would print its usage and exit 2
            raise OptionError(f"Beam pipeline options: {message}")

    parser = Parser(allow_abbrev=False)
    for cls in {str(c): c for c in PipelineOptions.__subclasses__()}.values():
        cls._add_argparse_args(parser)
    _, unknown = parser.parse_known_args(args)
    known = [o for action in parser._actions for o in action.option_strings]
    for arg in unknown:
        if not arg.startswith("-"):
            raise OptionError(
                f"unexpected argument {arg!r} (a value without an option; --input takes one "
                "path each time it is given)"
            )
        name = arg.split("=", 1)[0]
        if name.lstrip("-").replace("_", "-") in ours:
            raise OptionError(
                f"{name} is not an option of shatter-data build: did you mean "
                f"--{name.lstrip('-').replace('_', '-')}?"
            )
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise OptionError(
            f"{name} is not a Beam pipeline option: {hint}(options that only your runner knows "
            "go after `--`, e.g. shatter-data build ... -- --flink_conf_dir DIR)"
        )


def make_pipeline(beam_args: list[str]) -> beam.Pipeline:
    """A pipeline on the runner `beam_args` name (the command line's options beyond ours)."""
    options = store.pipeline_options(
        beam_args
    )  # the S3 endpoint and region: also the environment's
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
    if runner in DASK_RUNNERS:
        return beam.Pipeline(runner=make_dask_runner(), options=options)
    check_job_endpoint(options.view_as(PortableOptions).job_endpoint)
    return beam.Pipeline(options=options)


def check_job_endpoint(endpoint: str | None, timeout: float = 5.0) -> None:
    """An OptionError, within `timeout` seconds, when a portable runner's `--job_endpoint`
    (HOST:PORT) accepts no connection: Beam would wait on it for minutes, in silence."""
    if not endpoint or endpoint in ("embed", "docker") or ":" not in endpoint:
        return
    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise OptionError(
            f"no job server answers at --job_endpoint {endpoint} ({e}); start the runner's job "
            "server there (e.g. Flink's or Spark's), or check the address"
        ) from None


def _fn_api_runner(options: PipelineOptions) -> FnApiRunner:
    """The FnApiRunner with the options in its provision info (as Beam's DirectRunner builds it), so
    that `multi_processing` workers get them too (filesystem options, log level); their log level
    follows the driver's "apache_beam" logger unless `--default_sdk_harness_log_level` is given.
    Upstream: the workers' missing options were fixed for the DirectRunner, which builds its
    FnApiRunner so, by https://github.com/apache/beam/pull/13723; a FnApiRunner built directly,
    as here, still gives its workers none (no apache/beam issue as of 2026-11-27)."""
    harness = options.view_as(WorkerOptions)
    if harness.default_sdk_harness_log_level is None:
        harness.default_sdk_harness_log_level = logging.getLevelName(
            logging.getLogger("apache_beam").getEffectiveLevel()
        )
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    provision = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return _FnApiRunner(provision_info=ExtendedProvisionInfo(provision))


class _FnApiRunner(FnApiRunner):
    """Beam's FnApiRunner, whose `multi_processing` workers start as `shatter.pipeline.beam_worker` (Beam's
    harness with the driver's logging level) instead of Beam's bare harness module."""

    BEAM_WORKER = "-m apache_beam.runners.worker.sdk_worker_main"
    WORKER_MODULE = "shatter.pipeline.beam_worker"

    @property
    def _default_environment(self):
        return self._environment

    @_default_environment.setter
    def _default_environment(self, environment):
        command = getattr(environment, "command_string", "")
        if isinstance(environment, SubprocessSDKEnvironment) and command.endswith(self.BEAM_WORKER):
            levels = [
                logging.getLevelName(logging.getLogger(name).getEffectiveLevel())
                for name in ("", "apache_beam")
            ]
            environment = SubprocessSDKEnvironment.from_command_string(
                f"{sys.executable} -m {self.WORKER_MODULE} {' '.join(levels)}"
            )
        self._environment = environment


def end_local_workers() -> None:
    """SIGKILL this process's `multi_processing` workers (`_FnApiRunner`'s, found by their
    command line among its descendants): a stalled build ends, and Beam's shutdown waits for
    each worker to exit, which a stuck one never does."""
    for pid in _descendants():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if _FnApiRunner.WORKER_MODULE.encode() in f.read():
                    os.kill(pid, signal.SIGKILL)
        except OSError:  # it ended meanwhile
            pass


def _descendants() -> list[int]:
    """The processes this one started, and theirs (Linux's /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc/self") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:  # "pid (comm) state ppid ..."
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def counters(result, namespace: str) -> dict | None:
    """The `namespace` counters of a pipeline result (committed where the runner has them), or
    None when the runner offers no metrics at all (Beam's DaskRunner)."""
    try:
        query = result.metrics().query(beam.metrics.MetricsFilter().with_namespace(namespace))
    except NotImplementedError:
        return None
    out = {}
    for c in query["counters"]:
        try:
            value = c.committed
        except Exception:  # some runners only report attempted values
            value = None
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(
            value if value is not None else c.attempted
        )
    return dict(sorted(out.items()))


# pipeline/dask_runner.py subclasses Beam's Dask runner through private API (its transform
# evaluators, `_OutputHandler`, DaskOptions' bag arguments), which Beam rewrote between 2.62 and
# 2.69: the fork is written for, and tested on, this Beam minor series only. The upstream issue
# (or its absence) of each fault it fixes is in `shatter.pipeline.dask_runner`'s docstring.
DASK_FORK_BEAM = (2, 77)


def check_dask_fork(version: str = beam.__version__) -> None:
    """An OptionError in one line when the installed Beam is not one the Dask fork is tested on."""
    series = tuple(int(p) for p in version.split(".")[:2])
    if series != DASK_FORK_BEAM:
        want = ".".join(map(str, DASK_FORK_BEAM))
        raise OptionError(
            f"--runner DaskRunner: apache-beam {version} is installed, and the toolkit's fixes to "
            f"Beam's Dask runner (pipeline/dask_runner.py) are written for {want}.x; install "
            f"'apache-beam=={want}.*' or use another runner"
        )


def make_dask_runner():
    """Beam's DaskRunner with this pipeline's fixes (an instance; `shatter.pipeline.dask_runner` lists them)."""
    check_dask_fork()
    try:
        from shatter.pipeline import dask_runner
    except ImportError as e:
        raise OptionError(_no_dask(e)) from None
    _dask_logging_follows_the_driver()
    return dask_runner.DaskRunner()


def _dask_logging_follows_the_driver() -> None:
    """`distributed` gives its logger a handler and level of its own (INFO) when imported, and
    Beam's import in a worker logs "apitools not found" through the root logger: a local cluster
    (no --dask_client_address) would print its scheduler's and workers' INFO lines and those into
    the build's output. The driver's level and format hold here and, through dask's environment
    configuration (a `logging.config.dictConfig` dict), in the worker processes it starts."""
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    logging.getLogger("distributed").setLevel(level)
    os.environ["DASK_LOGGING"] = repr(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "filters": {"beam_import": {"()": "shatter.pipeline.cli._DropBeamImportNoise"}},
            "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
            "handlers": {
                "stderr": {
                    "class": "logging.StreamHandler",
                    "formatter": "plain",
                    "filters": ["beam_import"],
                }
            },
            "root": {"level": level, "handlers": ["stderr"]},
            "loggers": {"distributed": {"level": level}},
        }
    )
