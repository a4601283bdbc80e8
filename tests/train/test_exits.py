"""Every exit path ends every rank: real failures under the real deepspeed launcher (two CPU
ranks, gloo, two loader workers each) end the job with a non-zero exit soon after the failure,
with one line naming the cause; a corrupted shard does so in one plain process (its loader
workers' failure is each rank's own); a second signal exits at once; two "nodes" of one rank
each through DeepSpeed's own multi-node path read disjoint data, checkpoint and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shatter.train.lifecycle import one_line
from tests.jobs import Job, Outcome, Runs, child_env, free_port
from tests.train.runs import RANKS_JOB, SCRIPT, cheap_config, command

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXIT_WITHIN_S = 60  # from the failure's line to the launcher's exit
# a small script's whole life, start-up included, on a loaded machine; what the tests below catch
# (a wait for ever, or the 30 s sleep after a signal) goes on to their 60 s timeout
EXIT_AT_ONCE_S = 40


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 2000):
        data[i] ^= 0x5A
    path.write_bytes(data)


def _copy(data: Path, tmp: Path) -> Path:
    out = tmp / "data"
    shutil.copytree(data, out)
    return out


def launch(
    data: Path,
    run: Path,
    *extra: str,
    launcher: list[str] | None = None,
    config: Path | None = None,
) -> list[str]:
    """The run's command (`config`: by default the tiny one with 16 validation rows and no
    TensorBoard, written beside `run`)."""
    flags = ("--micro-batch", "4", "--num-workers", "2", "--no-progress")
    config = config or cheap_config(run.parent / f"{run.name}.yaml")
    return command(data, run, *flags, *extra, launcher=launcher, config=config)


def _failure(job: Job, marker: str) -> tuple[Job, int, float]:
    """Wait for the job's failure line and its exit: (job, exit code, seconds between them)."""
    failed_at = job.wait_for(marker, timeout=300)
    code, ended = job.finish(timeout=300)
    return job, code, ended - failed_at


def _fails_soon(outcome: Outcome) -> Job:
    job, code, took = outcome.get()
    print(f"exit {code} {took:.1f} s after the failure line")  # the report's figures (-s)
    assert code != 0, job.text[-3000:]
    assert took < EXIT_WITHIN_S, f"{took:.0f} s from the failure to the exit\n" + job.text[-3000:]
    assert "Traceback" not in job.text, job.text[-4000:]
    return job


# ---- fast: the pieces --------------------------------------------------------------------------


def test_a_loader_worker_failure_is_said_in_one_line_with_the_worker_s_place():
    class DatasetError(Exception):
        pass

    text = (
        "Caught DatasetError in DataLoader worker process 1.\nOriginal Traceback (most recent "
        'call last):\n  File "/src/data.py", line 12, in batch\n    load()\n'
        "shatter.shards.schema.DatasetError: shard /d/train-0.arrow is corrupted: rebuild it"
    )
    try:
        raise DatasetError(text)
    except DatasetError as err:
        assert one_line(err) == (
            "DatasetError: shard /d/train-0.arrow is corrupted: rebuild it (/src/data.py:12)"
        )
        assert one_line(err, known=True) == "shard /d/train-0.arrow is corrupted: rebuild it"


def test_a_full_disk_is_said_as_such_naming_the_directory():
    import errno

    err = OSError(errno.ENOSPC, "No space left on device", "/runs/a/.shared-check-1f")
    assert one_line(err) == (
        "disk full (ENOSPC) writing /runs/a/.shared-check-1f: free space in /runs/a and run the "
        "same command again"
    )


SIGNALS_TWICE = """
import os, signal, sys, time
from shatter.train.lifecycle import StopFlag
flag = StopFlag().install()
os.kill(os.getpid(), signal.{sig})
os.kill(os.getpid(), signal.SIGTERM)  # at once: the same request (the launcher's echo)
time.sleep(0.2)
print("requested", flag.requested, flag.exit_code, flush=True)
time.sleep({gap})
os.kill(os.getpid(), signal.{sig})
time.sleep(3)
print("still alive", flush=True)
"""


@pytest.mark.parametrize(
    "sig,first_code,exits",
    [("SIGINT", 130, True), ("SIGTERM", 143, False), ("SIGHUP", 129, False)],
)
def test_a_second_ctrl_c_exits_at_once_and_a_repeated_sigterm_does_not(sig, first_code, exits):
    """A second Ctrl-C is a person's; repeated SIGTERMs and SIGHUPs are the launcher's and
    schedulers' (the save goes on, within the launcher's 30 s)."""
    code = SIGNALS_TWICE.format(sig=sig, gap=1.5)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert f"requested True {first_code}" in done.stdout, done.stdout + done.stderr
    assert ("still alive" not in done.stdout) == exits, done.stdout + done.stderr
    if exits:
        assert done.returncode == 130 and "second SIGINT: exiting at once" in done.stderr
    assert time.monotonic() - start < EXIT_AT_ONCE_S


def test_the_exit_watchdog_ends_a_process_whose_exit_hangs():
    """A non-daemon loader-like child that ignores SIGTERM would be joined for ever at exit."""
    code = """
import multiprocessing as mp, os, signal, sys, time
import shatter.train.lifecycle as lc
def child(parent, ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a loader worker: ends when its parent does
    ready.set()
    while os.getppid() == parent:
        time.sleep(0.2)
if __name__ == "__main__":
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=child, args=(os.getpid(), ready), daemon=True)
    p.start()
    assert ready.wait(30)  # SIGTERM ignored before the exit begins: no race with terminate()
    lc.arm_watchdog(3, after_s=2)
    sys.exit(3)
"""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert done.returncode == 3 and "still exiting after 2 s" in done.stderr, done.stderr
    assert time.monotonic() - start < EXIT_AT_ONCE_S


def test_the_progress_watchdog_ends_a_process_without_progress_and_spares_a_stopped_one():
    code = """
import sys, time
from shatter.train.lifecycle import ProgressWatchdog
done = ProgressWatchdog(1.0)
done.pet()
done.stop()  # the run ended: an in-process caller goes on
stuck = ProgressWatchdog(1.0)
for _ in range(3):  # progress: no exit
    stuck.pet()
    time.sleep(0.5)
print("progressing", flush=True)
time.sleep(30)  # blocked, as in a collective whose peer hangs
print("still alive", flush=True)
"""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert done.returncode == 1 and done.stdout == "progressing\n", done.stdout + done.stderr
    assert done.stderr.startswith("Error: rank 0: no progress for 1 s"), done.stderr
    assert time.monotonic() - start < EXIT_AT_ONCE_S


# ---- slow: real failures under the launcher ----------------------------------------------------


def _corrupted(books_data: Path, tmp: Path, split: str, *extra: str) -> Job:
    """One plain process (a world of one, no launcher) on a copy of the data whose `split`
    shards are all corrupted: each rank's loader workers fail on their own shards, so the
    failure and its exit are one rank's (the launcher's end of the others is the faults')."""
    data = _copy(books_data, tmp)
    for shard in data.glob(f"{split}-*.arrow"):
        _corrupt(shard)
    return Job(launch(data, tmp / "run", *extra, launcher=[sys.executable]))


def _unwritable_checkpoint(books_data: Path, tmp: Path) -> Job:
    """Root ignores permissions: a file where the first checkpoint's folder goes."""
    run = tmp / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step00000002").write_text("in the way\n")
    return Job(launch(books_data, run, "--max-steps", "6", "--save-every", "2"))


def _sigterm_during_checkpoints(books_data: Path, tmp: Path) -> tuple[Job, float, Path]:
    """A run saving every step, SIGTERMed (its whole process group) after its second
    checkpoint: (job, seconds from the signal to the end of its output, run directory)."""
    run = tmp / "run"
    extra = ("--max-steps", "400", "--save-every", "1", "--eval-every", "0")
    job = Job(launch(books_data, run, *extra))
    job.wait_for("checkpoint step00000002", timeout=300)
    sent = time.monotonic()
    # as a scheduler or a terminal does: the whole process group (the `deepspeed` runner does not
    # forward a SIGTERM to its launcher on one node; the launcher's own forward is an echo)
    os.killpg(job.proc.pid, signal.SIGTERM)
    job.reader.join(EXIT_WITHIN_S)  # end of output: every process of the job has exited
    return job, time.monotonic() - sent, run


def run_failures(books_data, tmp_path_factory) -> dict[str, Outcome]:
    """The four failing runs of the tests below (tests/jobs.py Runs)."""
    tmp = {k: tmp_path_factory.mktemp(k) for k in ("train", "validation", "save", "sigterm")}
    validation = ("--max-steps", "6", "--eval-every", "2")
    return Runs(
        {
            "train": lambda: _failure(
                _corrupted(books_data, tmp["train"], "train", "--max-steps", "5"), "is corrupted"
            ),
            "validation": lambda: _failure(
                _corrupted(books_data, tmp["validation"], "validation", *validation),
                "is corrupted",
            ),
            "save": lambda: _failure(
                _unwritable_checkpoint(books_data, tmp["save"]), "step00000002"
            ),
            "sigterm": lambda: _sigterm_during_checkpoints(books_data, tmp["sigterm"]),
        }
    )


@pytest.fixture(scope="module")
def failures(books_data, tmp_path_factory) -> dict[str, Outcome]:
    return run_failures(books_data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.shared_data
def test_every_train_shard_corrupted(failures):
    job = _fails_soon(failures["train"])
    assert "train-0000" in job.text


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_corrupted_validation_shard(failures):
    job = _fails_soon(failures["validation"])
    assert "validation-0000" in job.text


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_checkpoint_that_cannot_be_written(failures):
    _fails_soon(failures["save"])


@pytest.mark.slow
@pytest.mark.shared_data
def test_sigterm_during_checkpoints_saves_and_exits(failures):
    job, gone, run = failures["sigterm"].get()
    print(f"all processes gone {gone:.1f} s after SIGTERM")
    assert not job.reader.is_alive(), "the ranks outlived the SIGTERM by a minute"
    code = job.proc.wait(timeout=5)
    assert code != 0, job.text[-3000:]
    assert "SIGTERM: checkpoint saved at step" in job.text, job.text[-3000:]
    assert "Traceback" not in job.text
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert int(latest.removeprefix("step")) >= 2


def two_nodes(data: Path, tmp: Path, runs) -> list[Job]:
    """One launcher per "node" of one rank (--no_ssh --node_rank), a shared hostfile, the master
    on 127.0.0.1; node n's rank runs tests/train/ranks_job.py's --pretrain runs `runs(n)` (its
    engine checks left out)."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port, jobs = free_port(), []
    for node in (0, 1):
        launcher = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh"]
        launcher += ["--node_rank", str(node), "--master_addr", "127.0.0.1"]
        launcher += ["--master_port", str(port), RANKS_JOB, str(data)]
        launcher += [str(tmp / f"job{node}"), str(tmp / f"job{node}.json"), "none"]
        jobs.append(Job(launcher + runs(node)))
    return jobs


@dataclass
class TwoNodes:
    jobs: list[Job]  # node 0's, node 1's
    run: Path  # the first two runs'
    samples: Path  # their --sample-log
    local: tuple[Path, Path]  # the third run's --output, one a node


@pytest.fixture(scope="module")
def two_node_job(books_data, tmp_path_factory) -> TwoNodes:
    """`two_nodes` running three pretraining runs on the same two ranks: 3 steps, the resume of
    their checkpoint to step 6, then a run whose --output is each node's own directory (as on
    two disks), which must stop at start-up. A run that fails or stops raises out of
    ranks_job.py before the next one starts: each rank's line about the third run says the
    first two ended with exit 0."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    run, log = tmp / "run", tmp / "samples"
    local = (tmp / "node0" / "run", tmp / "node1" / "run")
    for path in local:
        path.parent.mkdir()
    extra = ("--num-workers", "1", "--save-every", "3", "--eval-every", "0")
    extra += ("--sample-log", str(log))

    def runs(node: int) -> list[str]:
        args = []
        for max_steps in (3, 6):  # the second run resumes from the first's checkpoint
            cmd = launch(books_data, run, *extra, "--max-steps", str(max_steps), launcher=[])
            args += ["--pretrain", *cmd[1:]]
        cmd = launch(books_data, local[node], "--num-workers", "0", "--max-steps", "3", launcher=[])
        return [*args, "--pretrain", *cmd[1:]]

    jobs = two_nodes(books_data, tmp, runs)
    for job in jobs:
        job.finish(timeout=400)
    return TwoNodes(jobs, run, log, local)


@pytest.mark.slow
@pytest.mark.shared_data
def test_two_nodes_of_one_rank_read_disjoint_data_and_resume(two_node_job):
    """DeepSpeed's multi-node path without ssh: one launcher per "node" (--no_ssh --node_rank),
    a shared hostfile, the master on 127.0.0.1; a run of 3 steps, then its resume to step 6."""
    run, log = two_node_job.run, two_node_job.samples
    for rank, job in enumerate(two_node_job.jobs):  # the first two runs ended with exit 0
        assert f"Error: rank {rank}: " in job.text and "Traceback" not in job.text, job.text[-4000:]
    assert "resuming from step 3" in two_node_job.jobs[0].text, two_node_job.jobs[0].text[-4000:]
    config = json.loads((run / "config.json").read_text())
    assert config["world_size"] == 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step00000006"
    reads = {}
    for rank in (0, 1):
        lines = [json.loads(x) for x in Path(f"{log}.rank{rank}.jsonl").read_text().splitlines()]
        reads[rank] = [(pos, tuple(ids)) for pos, ids in lines]
    # 6 micro-batches per rank in all (3, then 3 after the resume): no batch read twice
    assert [len(reads[r]) for r in (0, 1)] == [6, 6]
    ids = {r: {i for _, batch in reads[r] for i in batch} for r in (0, 1)}
    assert not ids[0] & ids[1], "two ranks read the same rows"
    assert len(ids[0]) + len(ids[1]) == 6 * 2 * 4  # every global sample once


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_run_directory_local_to_each_node_stops_the_run_on_every_rank(two_node_job):
    """Two "nodes" whose --output is each one's own disk (two directories): both stop at start-up
    with one line saying the run directory must be shared, and nothing is trained. The check is
    the ranks' own collective (the third run of `two_node_job`)."""
    for rank, job in enumerate(two_node_job.jobs):
        assert job.proc.returncode != 0, job.text[-3000:]
        said = [line for _, line in job.lines if line.startswith(f"Error: rank {rank}:")]
        assert len(said) == 1 and "is not shared: rank(s) 1 (" in said[0], job.text[-3000:]
        assert "(NFS, Lustre, a FUSE mount)" in said[0] and "Traceback" not in job.text
        print(said[0])  # the report's message (-s)
    for run in two_node_job.local:
        assert not (run / "checkpoints").exists() and not list(run.glob(".shared-check-*"))


FAULTY = str(REPO / "tests" / "train" / "faulty_pretrain.py")
TIMEOUT_S = 8  # run.collective_timeout_s of the fault runs: a blocked peer is noticed this soon


KINDS = ("raise", "block", "kill")


def _fault(books_data: Path, tmp: Path, kind: str) -> tuple[Job, int, float]:
    """A launch whose rank 1 fails with `kind` in step 3's backward: (job, exit code, seconds
    from the fault's line to the end of the job's output)."""
    timeout = {"run:\n": f"run:\n  collective_timeout_s: {TIMEOUT_S}\n"}
    config = cheap_config(tmp / "fault.yaml", timeout)
    cmd = launch(books_data, tmp / "run", "--max-steps", "20", config=config)
    cmd[cmd.index(SCRIPT)] = FAULTY
    job = Job(cmd, env={"SHATTER_TEST_FAULT": f"{kind}:1:3"})
    try:
        fault = job.wait_for(f"fault: {kind} on rank 1", timeout=300)
        job.reader.join(EXIT_WITHIN_S + 30)  # end of output: every process of the job has exited
        gone = time.monotonic() - fault
        code = job.proc.wait(timeout=30)
    finally:
        if job.proc.poll() is None or job.reader.is_alive():
            os.killpg(job.proc.pid, signal.SIGKILL)
    return job, code, gone


def run_faults(books_data, tmp_path_factory) -> dict[str, Outcome]:
    """The three fault launches (tests/jobs.py Runs), each run when a test first reads it."""
    tmp = {kind: tmp_path_factory.mktemp(f"fault-{kind}") for kind in KINDS}
    return Runs({kind: (lambda k=kind: _fault(books_data, tmp[k], k)) for kind in KINDS})


@pytest.fixture(scope="module")
def faults(books_data, tmp_path_factory) -> dict[str, Outcome]:
    return run_faults(books_data, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_on_one_rank_ends_every_rank_within_a_minute(faults, kind):
    """Rank 1 fails in step 3's backward: raises (its process-group destroy blocking for ever),
    blocks in a collective (rank 0's collective times out), or is SIGKILLed. Every process of the
    job (launcher, ranks, loader workers) is gone within EXIT_WITHIN_S of the fault, each failed
    rank says one line, and the exit is non-zero."""
    job, code, gone = faults[kind].get()
    print(f"{kind}: exit {code}, every process gone {gone:.1f} s after the fault")  # report (-s)
    assert not job.reader.is_alive() and gone < EXIT_WITHIN_S, job.text[-3000:]
    assert code != 0, job.text[-3000:]
    assert "Traceback" not in job.text, job.text[-4000:]
    errors = [line for _, line in job.lines if line.startswith("Error: rank")]
    for rank in (0, 1) if kind != "kill" else (0,):  # a SIGKILLed rank says nothing
        said = [line for line in errors if line.startswith(f"Error: rank {rank}:")]
        assert len(said) == 1, job.text[-3000:]
    if kind == "raise":
        assert "injected failure in the backward" in job.text
    if kind == "block":
        assert "Error: rank 0: no progress for" in job.text, job.text[-3000:]
    # our last line, on the job's output and in train.log, names the rank that failed first and
    # its cause (DeepSpeed's own last line shows the last rank's command whichever failed)
    args = job.proc.args
    log = (Path(args[args.index("--output") + 1]) / "train.log").read_text()
    said = [x.split(": ", 1)[1] for x in log.splitlines() if ": Error on " in x]
    cause = {
        "raise": "the first failure: rank 1 on ",
        "kill": "the first failure: rank 1 (pid ",
        "block": "the first failure: rank ",  # both watchdogs, whichever fired first
    }[kind]
    for last in (errors[-1], said[-1]):
        print(f"{kind}: last line: {last}")  # the report's lines (-s)
        assert cause in last, job.text[-3000:] + log[-3000:]
    if kind == "raise":
        assert "injected failure in the backward" in errors[-1].split(cause)[1]
    if kind == "kill":
        assert "ended without a line (SIGKILL" in errors[-1]
