"""How a training process ends: on every path, every rank exits, soon, with one line saying why.

Used by the three entry points (train/pretrain.py, train/finetune.py, train/evaluate_cli.py):

- `StopFlag`: SIGTERM and SIGINT (Ctrl-C) ask for a checkpoint at the next step boundary and an
  exit; a second signal exits at once. A signal arriving within `SAME_REQUEST_S` of the first is
  the same request (Ctrl-C reaches every process of the terminal's group and the deepspeed
  launcher then forwards a SIGTERM to each rank: that is one request, not two).
- `process_exit()`: wraps a CLI's body. Any exception becomes one line (the cause, and the file
  and line it came from; the full traceback with SHATTER_TRACEBACK=1). In a process of its own
  (`run_cli`) a failure then ends the process at once: a deadline is armed first, the line is
  said, the process group is destroyed in a daemon thread given `FAILED_DESTROY_S` (since torch
  2.6 `destroy_process_group` flushes pending NCCL work, which a failed rank's peers never
  complete), and `os._exit`. A successful exit destroys the group the same way, with
  `DESTROY_S`, and a watchdog hard-exits the process if the interpreter's exit hangs (joining a
  DataLoader worker, a collective with a dead peer).
- Collectives wait `run.collective_timeout_s` for a peer, then fail (gloo raises; NCCL's
  watchdog aborts the communicator, `TORCH_NCCL_ASYNC_ERROR_HANDLING`): a rank whose peer died
  or hangs fails in its turn, with its own line.
- `run_cli(main)`: a script's `__main__`; its process ends with the command's exit code right
  after the atexit handlers, without the interpreter's C-level finalisation.
- `ProgressWatchdog`: gloo does not always apply its timeout (an all-reduce whose peer is alive
  but stuck waits for ever), so a rank that has not begun a forward for
  `run.collective_timeout_s` plus a margin says so in one line and ends.
- The deepspeed launcher ends the other ranks when one exits non-zero (SIGTERM to each rank's
  process tree, SIGKILL 30 s later), so a failure on any rank ends the job. With the above, every
  rank is gone well within a minute of the first failure (tests/train/test_exits.py measures it).
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta

GRACE_S = 15.0  # seconds the interpreter's exit may take before the watchdog ends the process
FAILED_GRACE_S = 2.0  # the same after a failure (its line is out; nothing is left to flush)
SAME_REQUEST_S = 1.0  # a second signal sooner than this after the first is the same request
DESTROY_S = 30.0  # a successful exit waits this long for destroy_process_group, then goes on
FAILED_DESTROY_S = 5.0  # the same after a failure (peers may never complete pending work)
FAILED_DEADLINE_S = 15.0  # a failed process is ended this long after its failure, whatever blocks
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # default of run.collective_timeout_s
# the deepspeed launcher SIGKILLs its ranks this long after forwarding them a SIGTERM
# (`terminate_process_tree` in deepspeed/launcher/launch.py): a stop must be saved within it
LAUNCHER_KILL_S = 30.0


def hard_exit(code: int, line: str | None = None) -> None:
    """Flush, say `line` on stderr, and end the process now (no atexit handlers, no joins)."""
    try:
        if line:
            sys.stderr.write(line + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _rank() -> str:
    return os.environ.get("RANK", "0")


class StopFlag:
    """Set by SIGTERM, SIGHUP or SIGINT, or by the loss of the launcher (train/launcher_watch.py); the
    loop saves a checkpoint at the next step boundary and exits. Repeated SIGTERMs and SIGHUPs
    are the same request (the deepspeed launcher forwards one to each rank after the job's
    group got its own, and again when a rank exits first); a second Ctrl-C (SIGINT, more than
    SAME_REQUEST_S after the first) exits at once, without a checkpoint. Each rank writes the
    cause to RUN/train.log (`log_to`), where a lost terminal cannot swallow it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.requested = False
        self.name: str | None = None
        self.exit_code = 143  # 128 + the signal: SIGTERM's, or SIGINT's (130) after a Ctrl-C
        self.requested_at = 0.0  # time.monotonic() of the request (a store failure sets none)
        self._notes: list[str] = []  # said before the run directory was known
        self.launcher: tuple[int, int | None] | None = None  # pids `watch_launcher` watches

    def install(self) -> StopFlag:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def log_to(self, path) -> None:
        """Every rank appends its stop and failure lines to `path` (RUN/train.log) from now on."""
        _RUN_LOG["path"] = str(path)
        try:
            _RUN_LOG["from"] = os.path.getsize(path)
        except OSError:
            _RUN_LOG["from"] = 0
        for line in self._notes:
            self.note(line)
        self._notes.clear()

    def note(self, line: str) -> None:
        """`line` in the run's log, by this rank."""
        if _RUN_LOG["path"] is None:
            self._notes.append(line)
            return
        note_in_run_log(line)

    def request(self, cause: str, code: int) -> None:
        """A stop for `cause`: a checkpoint at the next step boundary, then exit `code`."""
        if self.requested:
            return
        self.requested, self.name, self.exit_code = True, cause, code
        self.requested_at = time.monotonic()
        self.note(f"{cause}: a checkpoint is saved at the next step boundary, then the run exits")
        if _rank() == "0":
            _say(
                f"{cause}: a checkpoint is saved at the next step boundary, then the run exits "
                "(Ctrl-C again exits at once)"
            )

    def agreed(self) -> str:
        """The ranks agreed to stop (one rank's request suffices): this rank's own cause, the
        lost launcher when it sees that now (before its next poll), else a peer's request."""
        if not self.requested and self.launcher is not None:
            from shatter.train.launcher_watch import lost_launcher

            lost = lost_launcher(*self.launcher)
            if lost:
                self.request(lost, 143)
        if not self.requested:
            self.request("another rank's stop request", self.exit_code)
        return self.name

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if signum != signal.SIGINT or time.monotonic() - self.requested_at < SAME_REQUEST_S:
                return  # the same request, forwarded or repeated: the save goes on
            self.note(f"second {name}: exiting at once, no checkpoint")
            hard_exit(
                128 + signum, f"rank {_rank()}: second {name}: exiting at once, no checkpoint"
            )
        self.request(name, 128 + signum)


# RUN/train.log once the run directory is known (`StopFlag.log_to`), and its size then (where
# this session's lines begin)
_RUN_LOG: dict = {"path": None, "from": 0}


def first_failure() -> str | None:
    """What failed first, when it was not this rank: the earliest `Error` line of another rank in
    this session's part of RUN/train.log, else a rank of this node that ended without a line
    (SIGKILL, the OOM killer). A rank failing in a collective then names the cause, not only
    its own symptom, and the job's last line says which rank failed and why."""
    path = _RUN_LOG["path"]
    try:
        with open(path or os.devnull, "rb") as f:
            f.seek(_RUN_LOG["from"])
            text = f.read().decode(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        said = re.match(r"\S+ \S+ rank (\d+): Error on (\S+): (.*)", line)
        if said and said[1] != _rank():
            return f"rank {said[1]} on {said[2]}: {said[3]}"
    from shatter.train.launcher_watch import lost_peers

    gone = lost_peers()
    if gone:
        import socket

        return f"{', '.join(gone)} on {socket.gethostname()} ended without a line (SIGKILL: the OOM killer?)"
    return None


def failure_line(line: str) -> str:
    """A failing rank's `line`, with the first failure when another rank's came first."""
    first = first_failure()
    return f"{line}; the first failure: {first}" if first else line


def note_failure(line: str) -> None:
    """This rank's failure `line` (without its "rank N: ") in RUN/train.log, with its node."""
    import socket

    note_in_run_log(f"Error on {socket.gethostname()}: {line}")


def note_in_run_log(line: str) -> None:
    """`line` appended to RUN/train.log by this rank, in one write (ranks do not interleave):
    the cause of a stop or a failure stays where a lost terminal or a dead pipe cannot take it."""
    if _RUN_LOG["path"] is None:
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        fd = os.open(_RUN_LOG["path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{stamp} rank {_rank()}: {line}\n".encode())
        finally:
            os.close(fd)
    except OSError:  # the run directory is gone: stderr still says it
        pass


def _say(line: str) -> None:
    """A line on stderr, unless stderr is gone (a closed terminal after SIGHUP, a dead pipe)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: loader workers outlive SIGTERM/SIGINT (the launcher and the
    terminal signal every process) so that the main process can finish its step and save; they
    exit when the main process shuts the loader down, or within seconds of its death."""
    for sig in StopFlag.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def one_line(err: BaseException, known: bool = False) -> str:
    """The cause of `err` in one line: its message and where it was raised. A DataLoader
    worker's exception, re-raised in the main process, carries the worker's traceback: its last
    line is the message and its last frame the place. A `known` error's message already names
    the file and the fix: it is said alone."""
    text = str(err).strip()
    frames = traceback.extract_tb(err.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    if "Original Traceback" in text:
        places = re.findall(r'File "([^"]+)", line (\d+)', text)
        where = ":".join(places[-1]) if places else where
        text = re.sub(r"^[\w.]*" + type(err).__name__ + r": ", "", text.splitlines()[-1])
    text = " ".join(text.split()) or "(no message)"
    if known:
        return text
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        where = os.path.dirname(str(err.filename)) if err.filename else "its disk"
        return (
            f"disk full (ENOSPC) writing {err.filename or '?'}: free space in {where} and run "
            "the same command again"
        )
    return f"{type(err).__name__}: {text}" + (f" ({where})" if where else "")


def close_process_group(timeout_s: float = DESTROY_S) -> bool:
    """Destroy the default process group if there is one (every exit path calls this), in a
    daemon thread given `timeout_s`: False when it did not finish (the process is ending anyway,
    and a destroy that waits on a dead or failed peer must not keep it)."""

    def destroy():
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a broken group on a failure path: the process is ending anyway
            pass

    thread = threading.Thread(target=destroy, name="shatter-destroy-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def arm_deadline(code: int, after_s: float) -> threading.Thread:
    """A daemon thread that ends the process with `code` in `after_s` seconds, whatever the main
    thread is blocked in (armed first on a failure, before anything that can block)."""

    def fire():
        time.sleep(after_s)
        hard_exit(code, f"rank {_rank()}: still exiting {after_s:.0f} s after the failure: ended")

    thread = threading.Thread(target=fire, name="shatter-exit-deadline", daemon=True)
    thread.start()
    return thread


def fail_now(code: int, line: str) -> None:
    """End a failed process of its own (its deadline already armed): the line (click's `Error:`
    form, as a `ClickException` says it), the bounded destroy of the process group, `os._exit`.
    atexit handlers do not run: nothing left after a failure is worth a hang."""
    line = failure_line(line)
    try:
        sys.stderr.write(f"Error: {line}\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not keep the process
        pass
    note_failure(line.removeprefix(f"rank {_rank()}: "))
    close_process_group(FAILED_DESTROY_S)
    hard_exit(code)


_exiting = threading.Event()
_owner = {"cli": False, "code": None}  # set by run_cli and process_exit


def run_cli(command) -> None:
    """Run a click `command` as the process's program (a script's `__main__`). When the
    interpreter then begins to exit, the atexit handlers run at once under the exit watchdog and
    the process ends with the command's code, skipping the interpreter's own finalisation (where
    gloo's and NCCL's destructors, or a loader worker's join, can wait for ever)."""
    _owner["cli"] = True
    command()


def _interpreter_exits() -> None:
    _exiting.set()
    code = _owner["code"]
    if _owner["cli"] and code is not None:
        try:
            atexit._run_exitfuncs()
        finally:
            hard_exit(code)


# Runs when the interpreter starts to exit, before it joins threads and loader workers.
getattr(threading, "_register_atexit", atexit.register)(_interpreter_exits)


def arm_watchdog(code: int, after_s: float | None = None) -> threading.Thread:
    """A daemon thread that ends the process with `code` when the interpreter's exit has not
    finished `after_s` seconds after it began (in-process callers, e.g. tests, are unaffected).
    The exit of a failed process is cut short quietly; a successful one that hangs is said."""
    wait = after_s if after_s is not None else (GRACE_S if code == 0 else FAILED_GRACE_S)

    def fire():
        _exiting.wait()
        time.sleep(wait)
        line = f"rank {_rank()}: still exiting after {wait:.0f} s: ended (exit {code})"
        hard_exit(code, line if code == 0 or after_s is not None else None)

    thread = threading.Thread(target=fire, name="shatter-exit-watchdog", daemon=True)
    thread.start()
    return thread


class ProgressWatchdog:
    """Ends the process (exit 1, one line) when `pet()` has not been called for `limit_s`: the
    trainer pets it at every forward, so a rank blocked in a collective on a peer that hangs is
    ended even where the backend's own timeout does not fire. Starts with the first pet."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self._last: float | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def stop(self) -> None:
        """No more forwards are due (the run ends, or an in-process caller goes on)."""
        self._stopped.set()

    def pet(self, *_args) -> None:
        self._last = time.monotonic()
        if self._thread is None and not self._stopped.is_set():
            self._thread = threading.Thread(
                target=self._watch, name="shatter-progress-watchdog", daemon=True
            )
            self._thread.start()

    def _watch(self) -> None:
        while not (_exiting.is_set() or self._stopped.is_set()):
            idle = time.monotonic() - self._last
            if idle > self.limit_s:
                arm_deadline(1, FAILED_DEADLINE_S)
                line = failure_line(
                    f"no progress for {idle:.0f} s: a collective waits on a peer that failed "
                    "or hangs (see the other ranks' lines; the limit is "
                    "run.collective_timeout_s plus a margin)"
                )
                note_failure(line)
                hard_exit(1, f"Error: rank {_rank()}: {line}")
            self._stopped.wait(min(5.0, self.limit_s / 4))

    @staticmethod
    def limit_for(collective_timeout_s: float) -> float:
        """The backend's own timeout gets the first chance to fail, with its own message."""
        return collective_timeout_s + min(30.0, collective_timeout_s)


def _exit_code(err: BaseException) -> int:
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    return int(getattr(err, "exit_code", 1))


@contextmanager
def process_exit(known: tuple[type[BaseException], ...] = ()):
    """The body of a CLI. `known` errors (bad config, data) and any other exception become one
    line and exit 1 (a `click.ClickException`); every path arms the exit watchdog and, in a
    process of its own (`run_cli`), destroys the process group."""
    import click

    code = 0
    try:
        yield
    except (SystemExit, click.exceptions.Exit, click.ClickException, click.Abort) as err:
        code = _exit_code(err) if not isinstance(err, click.Abort) else 130
        raise
    except KeyboardInterrupt:
        code = 130
        raise SystemExit(130) from None
    except BaseException as err:  # the CLI's last word on any failure
        code = 1
        if _owner["cli"]:
            arm_deadline(code, FAILED_DEADLINE_S)  # before anything that can block
        if os.environ.get("SHATTER_TRACEBACK"):
            traceback.print_exc()
        line = one_line(err, known=isinstance(err, known))
        prefix = f"rank {_rank()}: " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
        if _owner["cli"]:
            fail_now(code, prefix + line)
        raise click.ClickException(prefix + line) from None
    finally:
        _owner["code"] = code
        arm_watchdog(code)
        if _owner["cli"]:  # in-process callers (tests, notebooks) keep DeepSpeed's cached group
            close_process_group(DESTROY_S if code == 0 else FAILED_DESTROY_S)


RUN_LOCK = "run.lock"  # RUN/run.lock: "host pid" of the process that holds the run directory
LOCK_REFRESH_S = 60.0  # the holder touches the lock this often (lock files without flock)
LOCK_STALE_S = 600.0  # such a lock of another host, untouched this long, is a dead run's


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """One run per run directory: rank 0 holds RUN/run.lock for the run's life.

    The lock is an exclusive POSIX lock (`lockf`) on the file: released by the kernel when its
    holder dies, on any node of a file system with working locks (local disks, NFS, Lustre
    mounted with `flock`), and not inherited by the loader's forked workers, which may outlive a
    killed holder by seconds. Its text names the holder's host and pid. Where the file system
    has no locks (ENOLCK, ENOTSUP: some FUSE mounts, Lustre without `flock`) the text decides: a holder on
    this host whose pid is gone, or on another host whose lock has not been touched for
    LOCK_STALE_S (the holder touches it every LOCK_REFRESH_S), is a dead run's and is taken
    over."""

    def __init__(self, run_dir):
        from pathlib import Path

        self.path = Path(run_dir) / RUN_LOCK
        self.fd: int | None = None
        self.took_over: str | None = None  # the stale holder's text, when one was replaced
        self._stop = threading.Event()

    def acquire(self) -> str | None:
        """None when this process now holds the lock, else the holder's text ("host pid")."""
        import fcntl
        import socket

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        before = os.pread(fd, 256, 0).decode(errors="replace").strip()
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EAGAIN):  # a live holder
                os.close(fd)
                return before or "another process"
            if before and not self._stale(before):  # no locks here: the text and its age decide
                os.close(fd)
                return before
        self.took_over = before or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self.fd = fd
        threading.Thread(target=self._refresh, name="shatter-run-lock", daemon=True).start()
        atexit.register(self.release)
        return None

    def _stale(self, text: str) -> bool:
        import socket

        host, _, pid = text.partition(" ")
        if host == socket.gethostname() and pid.strip().isdigit():
            return not _alive(int(pid))
        try:
            return time.time() - self.path.stat().st_mtime > LOCK_STALE_S
        except OSError:
            return True

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:  # the run directory went away: the run fails on its own
                return

    def release(self) -> None:
        self._stop.set()
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def hold_run_directory(run_dir, rank: int) -> RunLock | None:
    """Collective, at start-up: rank 0 takes RUN/run.lock (`RunLock`); when another live run
    holds it, every rank stops with one line naming that run. Returns rank 0's lock."""
    import torch.distributed as dist

    from shatter.train.config import ConfigError

    lock = RunLock(run_dir) if rank == 0 else None
    verdict = [None]
    if lock is not None:
        holder = lock.acquire()
        verdict = [(holder, lock.took_over)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    holder, took_over = verdict[0]
    if holder is not None:
        host, _, pid = holder.partition(" ")
        raise ConfigError(
            f"{run_dir} is in use by another run (pid {pid.strip() or '?'} on {host} holds "
            f"{run_dir}/{RUN_LOCK}): one run per --output; wait for it to end or stop it, or "
            "give this run another --output"
        )
    if rank == 0 and took_over:
        sys.stderr.write(
            f"{run_dir}/{RUN_LOCK}: the lock of a run that is gone ({took_over}) taken over\n"
        )
    return lock
