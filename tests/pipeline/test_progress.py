"""Live progress (`shatter.pipeline.progress`): the tally, its formatting, and real builds on every local runner."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from click.testing import CliRunner

from shatter.pipeline import progress
from shatter.pipeline.build import build
from shatter.pipeline.cli import main
from shatter.pipeline.config import InputSpec
from shatter.pipeline.runners import make_pipeline
from tests.jobs import Job

from .corpus import generated_documents, quiet, small_config
from .test_build import _files

LINE = re.compile(
    r"^\[(?P<stage>[a-z ]+?) (?P<done>done in )?[0-9.]+s\] (?P<counts>.*?)(  \((?P<rates>.*)\))?$"
)


def _parse(lines, stage):
    """The counters of each progress line of `stage`, and those of its final line."""
    live, final = [], None
    for line in lines:
        m = LINE.match(line)
        if not m or m["stage"] != stage:
            continue
        counts = (
            {}
            if m["counts"] == "(no counters yet)"
            else {k: int(v) for k, v in (kv.split("=") for kv in m["counts"].split())}
        )
        if m["done"]:
            assert final is None, "a line after the final one"
            final = counts
        else:
            assert final is None, f"progress printed after the final line: {line}"
            live.append(counts)
    return live, final


def _assert_sane(live, final):
    assert final and any(live), "no progress line with counts before the final line"
    for before, after in zip(live, live[1:]):
        assert all(after.get(k, 0) >= n for k, n in before.items()), (before, after)
    for counts in live:
        assert all(n <= final.get(k, 0) for k, n in counts.items()), (counts, final)


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
    """Enough text that a build lasts about a second: several progress lines at 0.1 s."""
    root = tmp_path_factory.mktemp("long")
    docs = generated_documents(6000, seed=3)
    (root / "a.txt").write_text("\n\n".join(d.replace("\n", " ") for d in docs[:3000]) + "\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[3000:]))
    return root


def test_pure_formatting():
    assert progress.merge({"a": 2, "b": 1}, {"a": 3}, minus={"b": 1}) == {"a": 5}
    assert progress.rates(
        {"documents_read": 10}, {"documents_read": 30, "document_tokens": 500}, 2.0
    ) == {"docs": 10.0, "tokens": 250.0}
    assert progress.rates({}, {"documents_tokenized": 4, "documents_read": 8}, 4.0) == {"docs": 2.0}
    assert progress.rates({}, {"rows": 3}, 0.0) == {}
    assert [progress.human(x) for x in (999, 12_345, 3_400_000)] == ["999", "12.3k", "3.4M"]
    line = progress.format_line(
        "build", 20.7, {"rows": 5, "documents_read": 3}, {"docs": 1.5, "tokens": 12_000}
    )
    assert line == "[build 20s] documents_read=3 rows=5  (2 docs/s, 12.0k tokens/s)"
    assert progress.format_line("build", 1, {}, {}) == "[build 1s] (no counters yet)"


def test_tally_is_exact_across_threads():
    before = progress.snapshot().get("t_threads", 0)

    def work():
        for _ in range(20_000):
            progress.add("t_threads", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert progress.snapshot()["t_threads"] - before == 80_000  # no update lost, no lock per add


def test_live_report_stops_before_exit_and_zero_disables():
    lines = []
    with progress.LiveReport("stage", lines.append, 0.02):
        for _ in range(10):
            progress.add("t_live", 7)
            time.sleep(0.01)
        time.sleep(0.1)
    n = len(lines)
    time.sleep(0.1)
    assert n >= 2 and len(lines) == n  # nothing once the block has ended
    assert "t_live=70" in lines[-1] and all(line.startswith("[stage ") for line in lines)
    silent = []
    with progress.LiveReport("stage", silent.append, 0):
        progress.add("t_live", 1)
        time.sleep(0.1)
    assert silent == []


@pytest.mark.slow
def test_worker_process_tally_reaches_the_driver():
    """A subprocess started with the driver's environment writes its tally for the driver to sum."""
    lines = []
    code = "import time; from shatter.pipeline import progress; progress.add('t_worker', 5); time.sleep(1.0)"
    with progress.LiveReport("stage", lines.append, 0.1):
        subprocess.run([sys.executable, "-c", code], check=True)
    assert any("t_worker=5" in line for line in lines), lines


@pytest.mark.slow
def test_in_process_build_reports_progress(long_corpus, tmp_path):
    lines = []
    config = small_config(
        [InputSpec("text", str(long_corpus))], tmp_path / "o", tokenizer_sample=2000
    )
    index = build(config, ["--progress_seconds", "0.1"], report=lines.append)
    for stage in ("tokenizer sample", "build"):
        live, final = _parse(lines, stage)
        _assert_sane(live, final)
    assert (
        index["counters"]["documents_tokenized"] == _parse(lines, "build")[1]["documents_tokenized"]
    )
    assert not [
        t for t in threading.enumerate() if t.name == "shatter-progress"
    ]  # stopped with each pipeline


def _long_config(built, long_corpus, out):
    return small_config(
        [InputSpec("text", str(long_corpus))], out, tokenizer=str(built[0] / "tokenizer.model")
    )


@pytest.fixture(scope="module")
def long_built(built, long_corpus, tmp_path_factory):
    """The long corpus built on the default runner (FnApiRunner, one worker): the reference bytes."""
    out = tmp_path_factory.mktemp("long_built") / "ds"
    build(_long_config(built, long_corpus, out), ["--progress_seconds", "0"], report=lambda _: None)
    return out


@pytest.mark.slow
def test_multi_processing_build_sums_the_workers(built, long_corpus, long_built, tmp_path, capfd):
    lines = []
    capfd.readouterr()
    build(
        _long_config(built, long_corpus, tmp_path / "mp"),
        [
            "--progress_seconds",
            "0.1",
            "--direct_num_workers",
            "2",
            "--direct_running_mode",
            "multi_processing",
        ],
        report=lines.append,
    )
    live, final = _parse(lines, "build")
    _assert_sane(live, final)
    assert any(c.get("documents_read", 0) > 0 for c in live)  # counted in the worker processes
    assert _files(long_built) == _files(tmp_path / "mp")
    # the worker processes log at the driver's level (WARNING, Beam's own logger CRITICAL)
    worker_output = capfd.readouterr().err
    assert "apitools" not in worker_output and "Logging handler" not in worker_output, worker_output


def test_progress_seconds_zero_prints_no_progress(built, corpus_dir, tmp_path):
    out, _ = built
    args = [
        "build",
        "--input",
        str(corpus_dir),
        "--output",
        str(tmp_path / "z"),
        "--seq-len",
        "64",
        "--tokenizer",
        str(out / "tokenizer.model"),
        "--num-shards",
        "2",
    ]
    result = CliRunner().invoke(main, args + ["--progress-seconds", "0"])
    assert result.exit_code == 0, result.output
    assert "[build done in" in result.output and not re.search(
        r"^\[build \d+s\]", result.output, re.M
    )
    assert CliRunner().invoke(main, args + ["--progress-seconds", "-1"]).exit_code == 2


@pytest.mark.slow
def test_bundle_based_direct_runner_writes_the_same_bytes(built, long_corpus, long_built, tmp_path):
    """Its run() returns at once and its state only changes in wait_until_finish (it used to hang).
    The long corpus: on the 300 documents of corpus_dir all counting could fall between two ticks."""
    lines = []
    build(
        _long_config(built, long_corpus, tmp_path / "bb"),
        ["--runner", "BundleBasedDirectRunner", "--progress_seconds", "0.05"],
        report=lines.append,
    )
    assert _files(long_built) == _files(tmp_path / "bb")
    live, final = _parse(lines, "build")
    _assert_sane(live, final)  # followed through Beam's metrics of the running job
    assert final["documents_tokenized"] == 6000


def test_direct_runner_never_downloads_prism(caplog):
    assert isinstance(make_pipeline(["--runner", "DirectRunner"]).runner, FnApiRunner)
    assert "Prism" in caplog.text  # the user is told what runs instead
    assert (
        type(make_pipeline(["--runner", "BundleBasedDirectRunner"]).runner).__name__
        == "BundleBasedDirectRunner"
    )


def test_a_step_without_counters_reports_a_heartbeat():
    lines = []
    with progress.Heartbeat("training sentencepiece", lines.append, 0.05):
        time.sleep(0.3)
    assert lines[0].startswith("[training sentencepiece 0s] still running") and len(lines) >= 3
    assert re.fullmatch(r"\[training sentencepiece done in 0\.\ds\]", lines[-1])
    quiet = []
    with progress.Heartbeat("x", quiet.append, 0):
        time.sleep(0.1)
    assert quiet == ["[x done in 0.1s]"]


def test_stall_watch_logic():
    watch = progress.StallWatch(5, "data/out")
    assert watch.poll == 1.25 and not watch.observe({}, 0.0) and not watch.observe({}, 4.9)
    assert watch.observe({}, 5.0)  # the local runner: a stall also before any counter
    assert not watch.observe({"rows": 1}, 6.0) and not watch.observe({"rows": 1}, 10.9)
    assert watch.observe({"rows": 1}, 11.0)  # 5 s since the counters last moved
    line = watch.message("build", 1.0)
    assert "no work done for 5s" in line and "[build 5s] rows=1" in line
    assert "data/out" in line and "--stall-seconds" in line and "\n" not in line
    blind = progress.StallWatch(5, "o", armed=False)  # a runner whose counters may never show
    assert not blind.observe({}, 0.0) and not blind.observe({}, 100.0)
    assert not blind.observe({"rows": 1}, 101.0) and blind.observe({"rows": 1}, 106.0)
    never = progress.StallWatch(0, "o")
    assert never.poll == 0 and not never.observe({}, 0.0) and not never.observe({}, 1e9)
    # a look at the counters every poll or more often, a progress line exactly every `seconds`
    assert progress._ticks(10, 10) == (10, 1) and progress._ticks(10, 0) == (10, 1)
    assert progress._ticks(0, 2.5) == (2.5, 0) and progress._ticks(1, 0.3) == (0.25, 4)


def test_a_stall_interrupts_the_main_thread():
    """A stalled run is ended from the reporter's thread: `Stalled` in the main thread, which
    was blocked, and the workers ended; a run that ends first is left alone."""
    ended = []
    watch = progress.StallWatch(0.2, "o", end_workers=lambda: ended.append(1))
    start = time.monotonic()
    with pytest.raises(progress.Stalled, match="no work done for 0.2s"):
        with progress.LiveReport("build", quiet, 0, watch=watch) as live:
            time.sleep(30)
    assert time.monotonic() - start < 10 and ended == [1] and "build" in (live.stall or "")
    calm = progress.StallWatch(0.5, "o", end_workers=lambda: ended.append(2))
    with progress.LiveReport("build", quiet, 0, watch=calm):  # counting: never stalled
        for _ in range(24):
            progress.add("t_stall", 1)
            time.sleep(0.05)
    assert ended == [1]


def test_a_worker_drops_beams_logging_client_reconnect_messages():
    """A live worker's log stream cancelled by the runner (its shutdown after another worker
    died) makes Beam's logging client print a multi-line gRPC error to stderr, as Beam prints
    it (apache_beam/runners/worker/log_handler.py); the worker's stderr drops it, and keeps the
    rest."""
    import io

    from shatter.pipeline.beam_worker import QuietStderr

    out = io.StringIO()
    stderr = QuietStderr(out)
    ex = 'RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n\tdebug_error_string = "x"\n>'
    print("WARNING a: kept", file=stderr)
    print(f"Logging client failed: {ex}... resetting", file=stderr)
    print("", file=stderr)
    print("ERROR b: kept", file=stderr)
    assert out.getvalue() == "WARNING a: kept\n\nERROR b: kept\n"


@pytest.mark.slow
def test_a_killed_worker_ends_the_build_in_one_line(built, corpus_dir, tmp_path):
    """A `multi_processing` worker killed (as by the OOM killer) before its first bundle leaves
    Beam's FnApiRunner waiting for good: --stall-seconds ends the build in one line, without
    index.json, and a rerun into the same directory writes the same bytes."""
    out, model = tmp_path / "ds", str(built[0] / "tokenizer.model")
    args = ["--input", str(corpus_dir), "--output", str(out), "--tokenizer", model]
    job = Job(
        [sys.executable, "-m", "shatter.pipeline.cli", "build", *args, "--seq-len", "64"]
        + ["--stall-seconds", "3", "--progress-seconds", "1", "--direct_num_workers", "2"]
        + ["--direct_running_mode", "multi_processing"]
    )
    end = time.monotonic() + 120
    while not (workers := job.processes(b"-m\0shatter.pipeline.beam_worker")):
        assert job.proc.poll() is None and time.monotonic() < end, job.text[-4000:]
        time.sleep(0.05)
    os.kill(workers[0], signal.SIGKILL)
    killed = time.monotonic()
    code, ended = job.finish(timeout=120)
    errors = [line for _, line in job.lines if "error" in line.lower()]
    assert code == 1 and len(errors) == 1, job.text[-4000:]
    assert errors[0].startswith("shatter-data: error: the build stalled: no work done for 3s")
    assert str(out) in errors[0] and "--stall-seconds" in errors[0]
    assert ended - killed < 60  # 3 s, and the workers' shutdown
    assert not (out / "index.json").exists() and not job.processes(b"beam_worker")
    again = small_config([InputSpec("text", str(corpus_dir))], out, tokenizer=model)
    build(again, [], report=quiet)
    assert _files(out) == _files(built[0])
