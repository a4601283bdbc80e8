"""Live progress of a running build from its "shatter" counters (display only).

Beam's in-process FnApiRunner (the default, also with `--direct_num_workers N` in either running
mode) runs a whole pipeline inside `Pipeline.run()` and exposes its metrics only at the end, so a
long local build would print nothing for minutes. Hence every increment of a "shatter" counter
(`shatter.pipeline.transforms.counter`) is also added to a tally of its process:

- lock-free: each thread adds to its own dict (only that thread writes it); a reader sums copies;
- the driver reads its own tally (in-process and `multi_threading` workers run there);
- a local worker subprocess (`--direct_running_mode multi_processing`, or any SDK worker started
  with the driver's environment) finds `SHATTER_PROGRESS` in its environment, and its first
  increment starts a daemon thread that writes the process's tally to `DIR/<pid>.json` (temp name,
  then rename) every `every` seconds; the driver sums those files;
- a runner whose `run()` returns while the job runs (Dataflow, Flink, Spark, the
  BundleBasedDirectRunner) is followed through Beam's own `PipelineResult.metrics()` instead.

`LiveReport` prints `[stage 20s] counter=value ...  (N docs/s, M tokens/s)` every
`--progress_seconds` through the build's `report` callback, and is stopped before the final line.
The final counts (index.json) still come from Beam's committed metrics, never from this tally.

The same loop watches for a stall (`StallWatch`, `--stall-seconds`): when no counter has moved for
that long, it raises `Stalled` in the main thread (a signal, which also wakes a thread blocked on a
lock), so the build unwinds as from any failure. Why: a `multi_processing` worker killed by the
kernel's OOM killer leaves the FnApiRunner waiting for it for good, while these lines go on.
Upstream: no apache/beam issue found as of 2026-11-27 for a killed SDK worker hanging the
FnApiRunner; a killed worker of a bundle in flight fails the run ("Channel closed prematurely"),
one killed before its first bundle hangs it.
Reference: Beam's FnApiRunner has a `progress_request_frequency`, but it exposes no callback, so
it cannot feed a display without patching Beam internals.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from apache_beam.options.pipeline_options import PipelineOptions

log = logging.getLogger(__name__)
ENV = "SHATTER_PROGRESS"  # JSON {"dir", "driver", "every"} set by the driver while a pipeline runs
DEFAULT_SECONDS = 10.0
DOC_COUNTERS = ("documents_read", "documents_tokenized")  # the first present gives docs/s
TOKEN_COUNTER = "document_tokens"


class ProgressOptions(PipelineOptions):
    """`--progress_seconds` rides with the Beam options, so it reaches `run_and_report` unchanged."""

    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument(
            "--progress_seconds",
            type=float,
            default=DEFAULT_SECONDS,
            help="seconds between progress lines while a pipeline runs (0: none)",
        )


# --- the tally of this process -------------------------------------------------------------------

_local = threading.local()
_tallies: list[
    dict
] = []  # one dict per thread that ever counted (so no count is lost with a thread)
_register = threading.Lock()  # taken once per thread, never per increment
_writer: threading.Thread | None = None


def add(name: str, n: int) -> None:
    """Add `n` to counter `name` of this process (the hot path: a thread-local dict update)."""
    try:
        tally = _local.tally
    except AttributeError:
        tally = _new_thread_tally()
    tally[name] = tally.get(name, 0) + n


def _new_thread_tally() -> dict:
    tally = _local.tally = {}
    with _register:
        _tallies.append(tally)
        _maybe_start_writer()
    return tally


def snapshot() -> dict[str, int]:
    """This process's totals so far (a consistent copy per thread; each dict copy is atomic)."""
    total: dict[str, int] = {}
    for tally in list(_tallies):
        for name, n in dict(tally).items():
            total[name] = total.get(name, 0) + n
    return total


def _after_fork() -> None:  # a forked child starts from nothing: its parent reports its own counts
    global _local, _tallies, _register, _writer
    _local, _tallies, _register, _writer = threading.local(), [], threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork)


# --- worker subprocesses: write the tally where the driver reads it ------------------------------


def _maybe_start_writer() -> None:
    """In a worker process of a driver that is showing progress, start the tally writer (once)."""
    global _writer
    if _writer is not None or ENV not in os.environ:
        return
    try:
        spec = json.loads(os.environ[ENV])
        if spec["driver"] == os.getpid():
            return
        _writer = threading.Thread(
            target=_write_loop,
            args=(spec["dir"], float(spec["every"])),
            name="shatter-progress-writer",
            daemon=True,
        )
    except (ValueError, KeyError, TypeError):
        log.debug("ignoring a malformed %s", ENV)
        return
    _writer.start()


def _write_loop(directory: str, every: float) -> None:
    path, last = os.path.join(directory, f"{os.getpid()}.json"), None
    while True:
        time.sleep(every)
        values = snapshot()
        if values == last:
            continue
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(values, f)
            os.replace(path + ".tmp", path)
        except OSError:  # the driver finished this pipeline and removed the directory
            return
        last = values


def read_worker_tallies(directory: str) -> dict[str, int]:
    """The sum of the tallies that worker processes wrote to `directory`."""
    total: dict[str, int] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                values = json.load(f)
        except (OSError, ValueError):
            continue
        for k, n in values.items():
            total[k] = total.get(k, 0) + int(n)
    return total


# --- pure formatting -----------------------------------------------------------------------------


def merge(*parts: dict, minus: dict | None = None) -> dict[str, int]:
    """Sum counter dicts, less a baseline, dropping zero entries; sorted by name."""
    out: dict[str, int] = {}
    for part in parts:
        for k, n in part.items():
            out[k] = out.get(k, 0) + n
    for k, n in (minus or {}).items():
        out[k] = out.get(k, 0) - n
    return {k: out[k] for k in sorted(out) if out[k]}


def rates(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Documents and tokens per second between two snapshots (only those that are counted)."""
    out = {}
    if seconds <= 0:
        return out
    doc = next((k for k in DOC_COUNTERS if k in after), None)
    if doc:
        out["docs"] = (after[doc] - before.get(doc, 0)) / seconds
    if TOKEN_COUNTER in after:
        out["tokens"] = (after[TOKEN_COUNTER] - before.get(TOKEN_COUNTER, 0)) / seconds
    return out


def human(x: float) -> str:
    """1234 → "1234", 56789 → "56.8k", 1.2e6 → "1.2M"."""
    if abs(x) < 10_000:
        return f"{x:.0f}"
    if abs(x) < 1_000_000:
        return f"{x / 1e3:.1f}k"
    return f"{x / 1e6:.1f}M"


def format_line(stage: str, elapsed: float, values: dict, per_second: dict) -> str:
    counts = " ".join(f"{k}={v}" for k, v in sorted(values.items())) or "(no counters yet)"
    speed = ", ".join(f"{human(v)} {k}/s" for k, v in per_second.items())
    return f"[{stage} {int(elapsed)}s] {counts}" + (f"  ({speed})" if speed else "")


# --- the stall watch ----------------------------------------------------------------------------

STALL_SIGNAL = signal.SIGUSR1  # sent to the main thread, handled only while a watch runs
STALL_GRACE_SECONDS = 60.0  # for the main thread to unwind (Beam stops its workers) before _exit


class Stalled(BaseException):
    """No counter moved for `--stall-seconds` (raised in the main thread; its message is the line
    to print). A BaseException: Beam's `except Exception` blocks must not wrap or swallow it."""


class StallWatch:
    """When no counter of a pipeline has moved for `limit` seconds (0: never), it has stalled.
    `armed` False: counting starts at the first counter seen, for a runner whose counters may
    never be visible while it runs (a remote Dask cluster): its silence proves nothing."""

    def __init__(
        self,
        limit: float,
        output: str,
        armed: bool = True,
        end_workers: Callable[[], None] = lambda: None,
    ):
        self.limit, self.output, self.armed, self.end_workers = limit, output, armed, end_workers
        self.last: dict = {}
        self.since: float | None = None

    @property
    def poll(self) -> float:
        """Seconds between looks at the counters (0: no watch)."""
        return min(self.limit / 4, 10.0) if self.limit > 0 else 0.0

    def observe(self, values: dict, now: float) -> bool:
        """Whether the pipeline has stalled, given the counters `values` seen at time `now`."""
        if self.since is None or values != self.last:
            self.last, self.since = values, now
            self.armed = self.armed or bool(values)
        return self.armed and self.limit > 0 and now - self.since >= self.limit

    def message(self, stage: str, start: float) -> str:
        """The one line that ends a stalled build (`stage` began at time `start`)."""
        seen = format_line(stage, (self.since or start) - start, self.last, {})
        return (
            f"the build stalled: no work done for {self.limit:g}s (no counter moved; last seen: "
            f"{seen}); a worker process may have died (killed for memory: see `dmesg`, or the "
            f"workers' memory) and the runner waits for it for good. {self.output} got no new "
            "index.json (a dataset already there is kept; a rerun starts over): build again "
            "with more memory per worker (fewer --direct_num_workers), or raise --stall-seconds "
            "if a stage may run this long without counting"
        )


def _ticks(seconds: float, poll: float) -> tuple[float, int]:
    """The reporter's wait between looks at the counters, and how many looks make one progress
    line (0: none): every `poll` seconds or more often, a line exactly every `seconds`."""
    if seconds <= 0:
        return poll, 0
    looks = math.ceil(seconds / poll) if poll > 0 else 1
    return seconds / looks, looks


# --- the driver's reporter -----------------------------------------------------------------------


class Heartbeat:
    """Context manager around one long step that has no counters (sentencepiece's training, in
    C++ without the GIL): `[stage Ns] still running` every `seconds` (0: never), then
    `[stage done in Ns]`."""

    def __init__(self, stage: str, report: Callable[[str], None], seconds: float):
        self.stage, self.report, self.seconds = stage, report, seconds
        self._stop = threading.Event()

    def __enter__(self) -> Heartbeat:
        self.start = time.monotonic()
        if self.seconds > 0:
            threading.Thread(target=self._loop, name="shatter-heartbeat", daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.seconds):
            self.report(f"[{self.stage} {int(time.monotonic() - self.start)}s] still running")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if exc[0] is None:
            self.report(f"[{self.stage} done in {time.monotonic() - self.start:.1f}s]")


class LiveReport:
    """Context manager around one pipeline run: a daemon thread reports the counters every
    `seconds` (0: never) until the block ends, and ends a run that `watch` finds stalled. No line
    is reported, and no stall raised, once `__exit__` has begun."""

    def __init__(
        self,
        stage: str,
        report: Callable[[str], None],
        seconds: float,
        clock: Callable[[], float] = time.monotonic,
        watch: StallWatch | None = None,
    ):
        self.stage, self.report, self.seconds, self.clock = stage, report, seconds, clock
        self.watch = watch if watch is not None and watch.poll > 0 else None
        self._stop = threading.Event()
        self._closing = False
        self._stall: str | None = None
        self._interrupts = False  # the stall signal's handler is ours (set in the main thread)
        self._old_handler = None
        self._print = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dir: str | None = None
        self._saved_env: str | None = None
        self._baseline: dict = {}
        self._source: Callable[[], dict] = self._local_counts

    def __enter__(self) -> LiveReport:
        self.start = self.clock()
        if self.seconds <= 0 and self.watch is None:
            return self
        self._baseline = snapshot()
        self._dir = tempfile.mkdtemp(prefix="shatter-progress-")
        self._saved_env = os.environ.get(ENV)
        every = min(1.0, self.seconds / 2) if self.seconds > 0 else 1.0
        if self.watch is not None and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(STALL_SIGNAL, self._raise_stalled)
            self._interrupts = True
        os.environ[ENV] = json.dumps({"dir": self._dir, "driver": os.getpid(), "every": every})
        self._thread = threading.Thread(target=self._loop, name="shatter-progress", daemon=True)
        self._thread.start()
        return self

    def follow(self, metrics: Callable[[], dict]) -> None:
        """`run()` returned while the job runs: report `metrics()` (Beam's counters of the running
        job) from now on, or this process's tally while the runner has none to show."""
        local = self._local_counts
        self._source = lambda: metrics() or local()

    def _local_counts(self) -> dict:
        workers = read_worker_tallies(self._dir) if self._dir else {}
        return merge(snapshot(), workers, minus=self._baseline)

    def _loop(self) -> None:
        before, then = {}, self.start
        wait, looks = _ticks(self.seconds, self.watch.poll if self.watch else 0.0)
        n = 0
        while not self._stop.wait(wait):
            n += 1
            try:
                values = self._source()
            except Exception as e:  # a metrics query that fails now may work at the next tick
                log.debug("progress: %s", e)
                continue
            now = self.clock()
            if self.watch is not None and self.watch.observe(values, now):
                return self._end_stalled(self.watch.message(self.stage, self.start))
            if not looks or n % looks:
                continue
            line = format_line(
                self.stage, now - self.start, values, rates(before, values, now - then)
            )
            with self._print:
                if self._stop.is_set():
                    return
                self.report(line)
            before, then = values, now

    def _end_stalled(self, line: str) -> None:
        """Raise `Stalled` in the main thread; if it has not unwound through `__exit__` within
        the grace (a hung worker that Beam waits on while it stops), end the process here."""
        with self._print:
            if self._closing:
                return
            self._stall = line
        # the workers end before the main thread unwinds: Beam's shutdown waits for each worker,
        # which a stuck one never ends, and a live one prints its own multi-line gRPC error
        # ("Logging client failed ...") once the runner closes its channels
        try:
            self.watch.end_workers()
        except Exception as e:  # the grace below still bounds the wait
            log.warning("could not end the build's worker processes: %s", e)
        with self._print:
            if self._interrupts and not self._closing:
                signal.pthread_kill(threading.main_thread().ident, STALL_SIGNAL)
        if self._stop.wait(STALL_GRACE_SECONDS if self._interrupts else 0):
            return
        print(f"shatter-data: error: {line}", file=sys.stderr, flush=True)
        os._exit(1)

    @property
    def stall(self) -> str | None:
        """The line that ends the run, once the watch found it stalled."""
        return self._stall

    def _raise_stalled(self, signum, frame) -> None:
        if self._stall is not None and not self._closing:  # the run may just have ended
            raise Stalled(self._stall)

    def __exit__(self, *exc) -> None:
        self._closing = True  # a stall signal still pending is ignored from here on
        with self._print:  # a line being printed finishes first; none starts after this
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._interrupts:
            signal.signal(STALL_SIGNAL, self._old_handler or signal.SIG_DFL)
        if self._dir is not None:
            if self._saved_env is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = self._saved_env
            shutil.rmtree(self._dir, ignore_errors=True)
