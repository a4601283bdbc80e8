"""What a run keeps in its directory besides checkpoints, in process (no launcher): the lock that
allows one run per directory, metrics and TensorBoard events after resumes, the GPU-hours of
sessions that were killed, and the clock that keeps validation and checkpoints out of the rates."""

import errno
import json
import socket
import subprocess
import sys
import time

import pytest

from shatter.train import lifecycle
from shatter.train.config import ConfigError
from shatter.train.lifecycle import RUN_LOCK, RunLock, hold_run_directory
from shatter.train.metrics import MetricsWriter, RunClock

HOLD = "import sys, time; from shatter.train.lifecycle import RunLock; RunLock(sys.argv[1]).acquire(); "
HOLD += "print('held', flush=True); time.sleep(60)"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def holder(tmp_path):
    """Another live process that holds tmp_path's run lock."""
    job = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert job.stdout.readline().strip() == "held"
    yield job
    job.kill()
    job.wait()


def test_a_second_run_on_a_directory_stops_in_one_line(tmp_path, holder):
    with pytest.raises(ConfigError) as err:
        hold_run_directory(tmp_path, rank=0)
    line = str(err.value)
    assert f"pid {holder.pid} on {socket.gethostname()}" in line and "\n" not in line
    assert "one run per --output" in line and str(tmp_path / RUN_LOCK) in line
    holder.kill()  # its lock goes with it: the next run takes the directory over
    holder.wait()
    lock = hold_run_directory(tmp_path, rank=0)
    assert lock.took_over == f"{socket.gethostname()} {holder.pid}"
    text = (tmp_path / RUN_LOCK).read_text()
    assert text == f"{socket.gethostname()} {__import__('os').getpid()}\n"
    lock.release()
    assert (tmp_path / RUN_LOCK).read_text() == ""  # a clean end leaves no holder named


def test_without_file_locks_the_holders_pid_and_age_decide(tmp_path, monkeypatch, holder):
    """A file system without locks (ENOLCK: some FUSE mounts, Lustre without `flock`)."""

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("fcntl.lockf", no_locks)
    assert RunLock(tmp_path).acquire() == f"{socket.gethostname()} {holder.pid}"  # alive
    (tmp_path / RUN_LOCK).write_text(f"{socket.gethostname()} {_dead_pid()}\n")
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and lock.took_over  # its pid is gone
    lock.release()
    (tmp_path / RUN_LOCK).write_text("node7 12345\n")  # another host: alive while it is touched
    assert RunLock(tmp_path).acquire() == "node7 12345"
    old = time.time() - lifecycle.LOCK_STALE_S - 5
    __import__("os").utime(tmp_path / RUN_LOCK, (old, old))
    lock = RunLock(tmp_path)
    assert lock.acquire() is None and lock.took_over == "node7 12345"
    lock.release()


def _session(run, resumed_step, steps, hours):
    # a session a second: TensorBoard orders event files by name, whose time is in whole seconds
    # and whose last field is a per-process writer count ("10" sorts before "9"); sessions of a
    # real run are processes started seconds apart
    time.sleep(1.05)
    writer = MetricsWriter(run, 0, tensorboard=True, resumed_step=resumed_step)
    for step in steps:
        record = {"step": step, "loss": float(step), "gpu_hours": writer.hours_before + hours}
        writer.write({**record, "gpu_hours_lost": writer.hours_lost})
    writer.close()
    return writer


def test_two_resumes_leave_one_scalar_per_step_and_count_the_lost_hours(tmp_path):
    """Session 1 logs steps 1-6 (checkpoint at 4) and is killed; session 2 resumes at 4, logs
    5-9 (checkpoint at 8) and is killed; session 3 resumes at 8 and ends at 10."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _session(tmp_path, 0, range(1, 7), 1.0)
    second = _session(tmp_path, 4, range(5, 10), 1.0)
    assert (second.hours_before, second.hours_lost) == (1.0, 0.0)  # lines 5-6: lost, no hours
    third = _session(tmp_path, 8, range(9, 11), 1.0)
    assert (third.hours_before, third.hours_lost) == (2.0, 0.0)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 11))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == list(range(1, 11)), [e.step for e in scalars]


def test_lost_hours_are_the_hours_after_the_checkpoints_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    rows = [(2, 1.0, 0.0), (4, 2.0, 0.0), (6, 3.5, 0.0)]  # (step, gpu_hours, lost)
    log.write_text(
        "".join(
            json.dumps(dict(zip(("step", "gpu_hours", "gpu_hours_lost"), r))) + "\n" for r in rows
        )
    )
    writer = MetricsWriter(tmp_path, 0, tensorboard=False, resumed_step=4)
    assert (writer.hours_before, writer.hours_lost) == (3.5, 1.5)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [2, 4]


def test_validation_and_checkpoint_time_are_not_training_time(monkeypatch):
    """On a clock the test moves (exact on a loaded machine, where a sleep overshoots)."""
    now = [1000.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = RunClock(world=2)
    now[0] += 0.05  # training
    with clock.aside("validation"):
        now[0] += 0.2
    with clock.aside("checkpoint"):
        now[0] += 0.1
    lap = clock.lap()
    assert lap == pytest.approx({"training_s": 0.05, "validation_s": 0.2, "checkpoint_s": 0.1})
    assert clock.lap()["validation_s"] == 0.0  # each lap has its own
    assert clock.gpu_hours() > 0  # from the process's start, start-up included


WARN = "import warnings; from shatter.train.engine import quiet_other_ranks; quiet_other_ranks(); "
WARN += "warnings.simplefilter('always'); warnings.warn('said once per node', FutureWarning)"


@pytest.mark.slow
@pytest.mark.parametrize("local_rank,said", [("0", True), ("1", False)])
def test_warnings_are_said_by_one_rank_per_node(local_rank, said):
    """A node's other ranks stay quiet, even after a library adds an `always` filter."""
    env = {**__import__("os").environ, "LOCAL_RANK": local_rank}
    done = subprocess.run(
        [sys.executable, "-c", WARN], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert ("said once per node" in done.stderr) == said, done.stderr
