"""A launched command whose output lines are time-stamped as they come: the exit-path tests
measure from a line (a failure, the last line) to the exit of every process of the job."""

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def child_env(base: dict | None = None, **extra: str) -> dict:
    """`base` (os.environ) for a child process: the checkout ahead on PYTHONPATH, the caller's
    own entries kept after it, so the child imports what its caller imports (the GPU lane's
    carried packages among them), then `extra` set."""
    env = dict(os.environ if base is None else base)
    paths = [str(REPO), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return {**env, **extra}


def free_port() -> int:
    """A port free now for a launcher's rendezvous: jobs run side by side (pytest-xdist, other
    suites on the machine) and DeepSpeed's default, 29500, would be shared."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKGROUND_THREAD = "background fixtures"  # tests/background.py's thread, and its pool's
# the jobs started and not yet ended: the foreground's (the tests and their fixtures) and the
# background's (tests/background.py), apart: a test's end must not kill the background's jobs
RUNNING: dict[bool, list["Job"]] = {False: [], True: []}


def in_background() -> bool:
    """Whether this thread does tests/background.py's work (its thread, or side_by_side's pool
    started there)."""
    return threading.current_thread().name.startswith(BACKGROUND_THREAD)


def end_jobs() -> None:
    """Kill every job this side (foreground or background) started that still runs, with its
    ranks and workers: a test that failed or ran out of its time (pytest-timeout) mid-job must
    not leave one busy (tests/conftest.py, per test; tests/background.py, per producer)."""
    running = RUNNING[in_background()]
    while running:
        job = running.pop()
        if job.proc.poll() is None:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            job.proc.wait(30)


@pytest.fixture(autouse=True)
def jobs_end_with_their_test():
    """A job a test started ends with the test, also one cut by its timeout (tests/conftest.py
    uses this fixture for every test)."""
    yield
    end_jobs()


class Job:
    """A launched command whose output lines are time-stamped as they come. In the background
    (tests/background.py) its environment is the session's, not what a test running meanwhile
    set in os.environ (an in-process engine's RANK and MASTER_PORT, a TMPDIR)."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        from tests.background import SESSION_ENV  # here: tests/background.py imports this module

        background = in_background()
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(SESSION_ENV if background and SESSION_ENV else None, **(env or {})),
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        RUNNING[background].append(self)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((t for t, line in self.lines if text in line), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r}:\n" + self.text[-4000:])

    def finish(self, timeout: float) -> tuple[int, float]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher, its ranks, their workers
            raise AssertionError("the job did not end:\n" + self.text[-4000:]) from None
        self.reader.join(5)
        return code, time.monotonic()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def finish_soon(job: Job, timeout: float, after_last_line_s: float = 30) -> str:
    """The job's output after it ends with exit 0 within `after_last_line_s` of its last line."""
    code, ended = job.finish(timeout)
    assert code == 0, job.text[-4000:]
    last = job.lines[-1][0] if job.lines else ended
    assert ended - last < after_last_line_s, f"exit {ended - last:.0f} s after the last line"
    return job.text


class Outcome:
    """What one of `side_by_side`'s calls returned, or the exception it raised, raised again
    by `get()` in the test that reads it."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


def side_by_side(calls: dict[str, Callable[[], object]]) -> dict[str, Outcome]:
    """Run independent jobs at once, each call in its own thread: a launch keeps about one of
    the machine's two cores busy (imports, start-up, waits on a peer or a timeout), so two or
    three of them side by side take little more than the longest. Every call runs to its end;
    each test then reads (and fails on) its own call's outcome."""

    def outcome(call: Callable[[], object]) -> Outcome:
        try:
            return Outcome(call())
        except BaseException as err:  # noqa: BLE001 (an assert or pytest.fail: the test's own)
            return Outcome(error=err)

    # in the background thread (tests/background.py) one at a time: the foreground's tests run
    # meanwhile, and more jobs than cores slow every process's threaded kernels many times over
    background = in_background()
    at_once = 1 if background else len(calls)
    with ThreadPoolExecutor(at_once, BACKGROUND_THREAD if background else "") as pool:
        futures = {name: pool.submit(outcome, call) for name, call in calls.items()}
    return {name: future.result() for name, future in futures.items()}
