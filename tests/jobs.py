"""Helpers for the tests that launch commands: a child's environment, a free rendezvous port, a
command run to its end within a time limit (its whole process group killed past it), and a
launched command whose output lines are time-stamped as they come (the exit-path tests measure
from a line, a failure or the last line, to the exit of every process of the job)."""

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
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
    """A port free now for a launcher's rendezvous: jobs run side by side (pytest-xdist's
    workers, other suites on the machine) and DeepSpeed's default, 29500, would be shared."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(
    cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`cmd` run to its end in its own process group (in `env`, default child_env()), its output
    captured as text. Past `timeout` seconds the whole group (a launcher, its ranks, their loader
    workers) is killed and subprocess.TimeoutExpired raised, as subprocess.run does for the one
    child it knows."""
    env = child_env() if env is None else env
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    except BaseException:  # an interrupt or pytest-timeout: nothing of the job outlives the test
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


RUNNING: list["Job"] = []  # the jobs started and not yet ended


def end_jobs() -> None:
    """Kill every job started that still runs, with its ranks and workers: a test that failed or
    ran out of its time (pytest-timeout) mid-job must not leave one busy."""
    while RUNNING:
        job = RUNNING.pop()
        if job.proc.poll() is None:
            _kill_group(job.proc)


@pytest.fixture(autouse=True)
def jobs_end_with_their_test():
    """A job a test started ends with the test, also one cut by its timeout (tests/conftest.py
    uses this fixture for every test)."""
    yield
    end_jobs()


class Job:
    """A launched command (in its own process group) whose output lines are time-stamped as
    they come."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env(None, **(env or {})),
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        RUNNING.append(self)

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

    def processes(self, command: bytes) -> list[int]:
        """The pids of the job's processes (its process group) whose command line, its
        arguments joined by NUL bytes, contains `command` (Linux's /proc)."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and os.getpgid(int(entry.name)) == self.proc.pid:
                    if command in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
            except OSError:  # it ended meanwhile
                continue
        return found


def finish_soon(job: Job, timeout: float, after_last_line_s: float = 30) -> str:
    """The job's output after it ends with exit 0 within `after_last_line_s` of its last line."""
    code, ended = job.finish(timeout)
    assert code == 0, job.text[-4000:]
    last = job.lines[-1][0] if job.lines else ended
    assert ended - last < after_last_line_s, f"exit {ended - last:.0f} s after the last line"
    return job.text


class Outcome:
    """What one of `Runs`' calls returned, or the exception it raised, raised again by `get()`
    in each test that reads it."""

    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


class Runs:
    """Independent runs that a module's tests share (a module fixture's value): each call runs
    when a test first reads its name, and its outcome is kept for the tests after it, so a
    selection of the module's tests (`-k`) runs only the calls it reads. Under pytest-xdist a
    module's tests share one worker (make test: --dist loadscope), so each call runs once."""

    def __init__(self, calls: dict[str, Callable[[], object]]):
        self.calls, self.outcomes = calls, {}

    def __getitem__(self, name: str) -> Outcome:
        if name not in self.outcomes:
            try:
                self.outcomes[name] = Outcome(self.calls[name]())
            except (Exception, pytest.fail.Exception, pytest.skip.Exception) as err:  # noqa: BLE001
                self.outcomes[name] = Outcome(error=err)  # an assert or pytest.fail: each test's
            end_jobs()  # a job its call left running (an assert mid-job)
        return self.outcomes[name]
