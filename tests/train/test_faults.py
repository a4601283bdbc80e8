"""Faults of a run directory under the real deepspeed launcher (two CPU ranks, gloo): a bit flip in
the newest checkpoint is never loaded (the run falls back to the one before and keeps it), a
partially copied run directory is refused in one line and left as it was, and nothing is ever
deleted to make a resume work. What is decided by rank 0 alone before the engine is built (a
refusal, a restart), a full disk's line and a divergence's run in this process
(tests/train/runs.py `in_process`, a world of one)."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shatter import safe_load
from tests.jobs import Runs, child_env
from tests.train.runs import SCRIPT, command, in_process
from tests.train.shardutil import write_dataset

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FLAGS = ("--micro-batch", "2", "--num-workers", "0", "--no-progress", "--eval-every", "0")
FLAGS += ("--save-every", "2", "--log-every", "1")


def launch(data: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    """The run under the deepspeed launcher."""
    cmd = command(data, run, *FLAGS, *extra)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=480, cwd=REPO, env=child_env()
    )


def alone(data: Path, run: Path, *extra: str):
    """The run in this process, a world of one: click's result (`exit_code`, `output`)."""
    return in_process(data, run, *FLAGS, *extra)


def our_lines(output: str) -> list[str]:
    """The trainer's own lines (DeepSpeed's launcher and logger lines left out)."""
    return [
        line
        for line in output.splitlines()
        if line.strip() and not line.startswith("[") and "[launch.py" not in line
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "data"
    return write_dataset(root, shards=(40, 40), seq_len=32, vocab=100, val_rows=(8,))


def _flip(path: Path) -> None:
    """A bit flip inside the file: same size, another sha256."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _processes_of(run: Path) -> list[int]:
    """The pids whose command line names `run` (the ranks of its job, their loader workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run) in (proc / "cmdline").read_text():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _stopped(data: Path, run: Path, stop, slow: bool) -> tuple[str, float]:
    """Launch a long run in `run`, `stop(job)` it once 3 steps are logged; wait until none of its
    processes is left: (RUN/train.log, seconds from the stop to the last process's end). A
    `slow` run has 4 micro-batches a step, each slowed down, and the launcher's SIGKILL taken to
    come 1 s after a stop request (tests/train/faulty_pretrain.py)."""
    cmd = command(data, run, *FLAGS, "--max-steps", "400", "--num-workers", "1")
    env = child_env()
    if slow:
        cmd[cmd.index(SCRIPT)] = str(REPO / "tests" / "train" / "faulty_pretrain.py")
        cmd += ["--grad-accum", "4"]
        env = child_env(SHATTER_TEST_SLOW="0.3", SHATTER_TEST_GRACE="1")
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        log = run / "metrics.jsonl"
        while not (log.exists() and log.read_text().count('"lr"') >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "no 3 steps logged"
            time.sleep(0.2)
        stopped = time.monotonic()
        stop(job)
        while _processes_of(run) and time.monotonic() < stopped + 120:
            time.sleep(0.2)
        took = time.monotonic() - stopped
        assert not _processes_of(run), f"still running 120 s after the stop: {_processes_of(run)}"
    finally:
        os.killpg(job.pid, signal.SIGKILL) if job.poll() is None else None
        for pid in _processes_of(run):
            os.kill(pid, signal.SIGKILL)
    return (run / "train.log").read_text(), took


class Stops(Runs):
    """The two stopped launches of the tests below, each in `root`/its name."""

    def __init__(self, data: Path, root: Path):
        cases = {
            "runner": lambda job: os.kill(job.pid, signal.SIGTERM),
            "hangup": lambda job: os.killpg(job.pid, signal.SIGHUP),
        }
        self.root = root
        super().__init__(
            {
                name: lambda s=stop, n=name: _stopped(data, root / n, s, n == "hangup")
                for name, stop in cases.items()
            }
        )


@pytest.fixture(scope="module")
def stops(data, tmp_path_factory) -> Stops:
    """SIGTERM to the `deepspeed` runner only, and SIGHUP to a slow job's group: 2-rank runs
    stopped after 3 steps (the runner's is also the damaged-checkpoint test's first run)."""
    return Stops(data, tmp_path_factory.mktemp("stops"))


def test_a_lost_runner_and_a_hang_up_each_save_then_exit(stops):
    """SIGTERM to the `deepspeed` runner only (docker stop, Kubernetes, systemd: the runner
    exits at once, its orphaned launcher keeps the ranks) and SIGHUP to the job's group (an ssh
    drop): every rank writes the cause to train.log, saves at the next step boundary and exits;
    the run lock is released. The hung-up run's steps are too long to finish within the grace:
    both ranks abandon the same step and save the one before, at its stream position."""
    for name, cause in (("runner", "lost the deepspeed runner"), ("hangup", "SIGHUP")):
        log, took = stops[name].get()
        print(f"{name}: every process gone {took:.1f} s after the stop")
        run = stops.root / name
        for rank in (0, 1):
            assert f"rank {rank}: {cause}" in log, log[-3000:]
        assert f"{cause}" in log and "checkpoint saved at step" in log, log[-3000:]
        step = int((run / "checkpoints" / "latest").read_text().strip()[4:])
        assert step >= 3 and f"checkpoint saved at step {step}; exiting" in log
        assert (run / "run.lock").read_text() == ""  # released
        saved = run / "checkpoints" / f"step{step:08d}" / "mp_rank_00_model_states.pt"
        batch = 2 * 2 * (4 if name == "hangup" else 1)  # micro-batch, ranks, grad-accum
        assert safe_load.load(saved)["data_position"]["samples"] == batch * step
        if name == "hangup":
            for rank in (0, 1):
                assert f"rank {rank}: SIGHUP: step {step + 1} abandoned after" in log, log[-3000:]


def test_a_damaged_checkpoint_is_never_loaded_and_never_deleted(data, stops, tmp_path):
    """On a copy of the run the lost runner stopped (its two newest saves kept): a bit flip in
    the newest's rank-1 optimizer partition; the 2-rank resume falls back to the one before. Then,
    in this process, what rank 0 decides alone: a partial copy refused, --restart, a resume with
    other settings refused."""
    stops["runner"].get()
    run = tmp_path / "run"
    shutil.copytree(stops.root / "runner", run)
    checkpoints = run / "checkpoints"
    newest = (checkpoints / "latest").read_text().strip()
    before, last = sorted(p.name for p in checkpoints.glob("step*"))  # saves every 2, keeps 2
    assert last == newest, (before, last)
    manifest = json.loads((checkpoints / newest / "manifest.json").read_text())
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values()), manifest
    optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip(checkpoints / newest / optim)

    start = int(before[4:])  # even: a save of the every-2 schedule
    second = launch(data, run, "--max-steps", str(start + 4))
    text = second.stderr
    assert second.returncode == 0, text[-3000:]
    assert f"checkpoint {checkpoints / newest} is damaged" in text, text[-3000:]
    assert f"falling back to the newest intact checkpoint {before}" in text
    assert f"resuming from step {start}" in text
    assert (checkpoints / f"damaged-{newest}" / optim).is_file()  # kept for a look
    kept = sorted(p.name for p in checkpoints.glob("step*"))
    later = [f"step{start + 2:08d}", f"step{start + 4:08d}"]
    assert kept == [before, *later], kept  # `before`: protected

    # a copy of the run directory still in progress: one optimizer file of each short
    for name in later:
        path = checkpoints / name / optim
        path.write_bytes(path.read_bytes()[:1000])
    history = (run / "metrics.jsonl").read_text()
    third = alone(data, run, "--max-steps", str(start + 6))  # rank 0 refuses
    assert third.exit_code != 0
    assert "Traceback" not in third.output
    mine = [line for line in our_lines(third.output) if later[0] in line and "damaged" in line]
    assert mine and str(checkpoints / later[0] / optim) in mine[-1], third.output[-3000:]
    assert "--restart" in mine[-1]
    after = sorted(p.name for p in checkpoints.glob("step*"))
    assert after == kept and (run / "metrics.jsonl").read_text() == history  # nothing touched

    fourth = alone(data, run, "--max-steps", "2", "--restart")
    assert fourth.exit_code == 0, fourth.output[-3000:]
    aside = next(run.glob("before-restart-*"))
    assert sorted(p.name for p in (aside / "checkpoints").glob("step*")) == kept
    assert (aside / "metrics.jsonl").read_text() == history
    assert sorted(p.name for p in checkpoints.glob("step*")) == ["step00000002"]

    # a resume with the settings its files and stream depend on changed: one line (DeepSpeed's
    # own load failed with an AttributeError, and another seed silently broke the exact stream)
    fifth = alone(data, run, "--max-steps", "4", "--zero-stage", "0", "--seed", "7")
    assert fifth.exit_code != 0 and "Traceback" not in fifth.output
    errors = [x for x in our_lines(fifth.output) if x.startswith("Error: ")]
    assert errors and "was written with other settings" in errors[-1], fifth.output[-3000:]
    assert "--zero-stage 1 -> 0; --seed 0 -> 7" in errors[-1]


def test_a_finite_divergence_stops_in_one_line_keeping_the_checkpoint_before_it(
    data, tmp_path, monkeypatch
):
    """From step 13 on every loss is 100 times larger (as tests/train/faulty_pretrain.py's
    SHATTER_TEST_SPIKE injects it, here in this process): three log lines above 3 × the running
    median stop the run at step 15, in one line a rank; step 12's checkpoint, from before the
    spike, survived the pruning of saves 13 and 14 (keep 2), which are moved aside, so the same
    command resumes from it. A world of one: the verdict is on the logged loss, which every rank
    shares."""
    import deepspeed

    forward = deepspeed.DeepSpeedEngine.forward

    def spiking_forward(engine, *args, **kwargs):
        out = forward(engine, *args, **kwargs)
        if engine.training and engine.micro_steps >= 12:
            out["loss"] = out["loss"] * 100.0  # a finite divergence from there on
        return out

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(deepspeed.DeepSpeedEngine, "forward", spiking_forward)
        done = alone(data, run, "--max-steps", "40", "--save-every", "1")
    assert done.exit_code != 0, done.output[-3000:]
    errors = [x for x in done.output.splitlines() if x.startswith("Error: ")]
    assert 1 <= len(errors) <= 2 and "Traceback" not in done.output, done.output[-3000:]
    for line in errors:
        assert "at step 15 is above 3 × its running median" in line, line
        assert "healthy until step 12" in line and "step00000012, is the one a resume" in line
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step00000012"
    assert sorted(p.name for p in checkpoints.glob("step*")) == ["step00000012"]
    assert sorted(p.name for p in checkpoints.glob("diverged-*")) == [
        "diverged-step00000013",
        "diverged-step00000014",
    ]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (two checkpoints of the tiny model fit, a third does not), or a skip."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)])
    if done.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)])


def test_a_full_disk_during_a_save_stops_in_one_line_naming_it(data, small_disk):
    run = small_disk / "run"
    done = alone(data, run, "--max-steps", "20")
    assert done.exit_code != 0 and "Traceback" not in done.output
    errors = [x for x in our_lines(done.output) if x.startswith("Error: ")]
    full = [x for x in errors if "disk full (ENOSPC) while saving checkpoint" in x]
    assert full, errors or done.output[-3000:]
    assert str(run / "checkpoints") in full[0]
    newest = (run / "checkpoints" / "latest").read_text()
    assert f"the newest complete checkpoint is still {newest}" in full[0]
