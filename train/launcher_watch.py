"""A rank notices the death of the `deepspeed` runner or of its per-node launcher, and stops.

What Kubernetes, `docker stop` and systemd signal is the runner (the `deepspeed` command). On one
node it exits at once on a SIGTERM without passing it on, and DeepSpeed's per-node launcher
(`deepspeed.launcher.launch`), orphaned, keeps the ranks training: a parent-death signal in the
ranks would never fire. So each rank notes, at start, the pids of its launcher (its parent) and
of the runner (the launcher's parent), and a daemon thread looks every `LAUNCHER_POLL_S`: a dead
process's children are re-parented, so a changed parent says it (never a reused pid). On a loss
it asks the `StopFlag` (train/lifecycle.py) for a checkpoint at the next step boundary and an
exit, as a SIGTERM would. The same thread notes the launcher's other ranks (their pid and RANK),
so that a rank failing after a peer died without a line (SIGKILL, the OOM killer) names that
peer (`lost_peers`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an annotation only: lifecycle imports this module
    from shatter.train.lifecycle import StopFlag

LAUNCHER_POLL_S = 1.0  # how often a rank looks for its launcher and the deepspeed runner
_PEERS: dict[int, str] = {}  # pid -> RANK of the other ranks this node's launcher started


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (/proc), None when `pid` is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return (
            open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def launcher_pids() -> tuple[int, int | None] | None:
    """(the per-node deepspeed launcher, the `deepspeed` runner above it or None) of this rank,
    captured at start; None when this process was not started by the deepspeed launcher."""
    launcher = os.getppid()
    if "deepspeed.launcher.launch" not in _cmdline(launcher):
        return None
    runner = _parent_of(launcher)
    return launcher, runner if runner and "deepspeed" in _cmdline(runner) else None


def note_peers(launcher: int) -> None:
    """The launcher's other children (the ranks of this node) and their RANK, read from /proc
    while they live: a dead one's environment is gone."""
    try:
        children = open(f"/proc/{launcher}/task/{launcher}/children").read().split()
    except OSError:
        return
    for pid in map(int, children):
        if pid == os.getpid() or pid in _PEERS:
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        rank = next((v[5:].decode() for v in env if v.startswith(b"RANK=")), None)
        if rank is not None:
            _PEERS[pid] = rank


def lost_peers() -> list[str]:
    """The ranks of this node that are gone ("rank 1 (pid 4242)"): no process, a zombie, or
    another parent."""
    gone = []
    for pid, rank in sorted(_PEERS.items(), key=lambda item: int(item[1])):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            alive = stat[0] != "Z" and int(stat[1]) == os.getppid()
        except (OSError, IndexError, ValueError):
            alive = False
        if not alive:
            gone.append(f"rank {rank} (pid {pid})")
    return gone


def lost_launcher(launcher: int, runner: int | None) -> str | None:
    """Which of them is gone: a dead process's children are re-parented, so a changed parent
    (never a reused pid) says it."""
    if os.getppid() != launcher:
        return f"lost the deepspeed launcher (pid {launcher})"
    if runner is not None and _parent_of(launcher) != runner:
        return f"lost the deepspeed runner (pid {runner})"
    return None


def watch_launcher(stop: StopFlag) -> threading.Thread | None:
    """A daemon thread that asks `stop` for a checkpoint and an exit when the launcher or the
    `deepspeed` runner dies (what Kubernetes, `docker stop` and systemd signal: on one node the
    runner exits at once and its launcher, orphaned, keeps the ranks running)."""
    pids = launcher_pids()
    if pids is None:
        return None
    stop.launcher = pids

    def watch():
        while not stop.requested:
            note_peers(pids[0])
            cause = lost_launcher(*pids)
            if cause:
                stop.request(cause, 143)
                return
            time.sleep(LAUNCHER_POLL_S)

    thread = threading.Thread(target=watch, name="shatter-launcher-watch", daemon=True)
    thread.start()
    return thread
