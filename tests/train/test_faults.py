"""Faults of a run directory under the real deepspeed launcher (two CPU ranks, gloo): a bit flip in
the newest checkpoint is never loaded (the run falls back to the one before and keeps it), a
partially copied run directory is refused in one line and left as it was, and nothing is ever
deleted to make a resume work."""

import json
import subprocess
from pathlib import Path

import pytest
from shardutil import write_dataset
from test_pretrain import command

from tests.jobs import child_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FLAGS = ("--micro-batch", "2", "--num-workers", "0", "--no-progress", "--eval-every", "0")
FLAGS += ("--save-every", "2", "--log-every", "1")


def launch(data: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = command(data, run, *FLAGS, *extra)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=480, cwd=REPO, env=child_env()
    )


def our_lines(done: subprocess.CompletedProcess) -> list[str]:
    """The trainer's own lines (DeepSpeed's launcher and logger lines left out)."""
    return [
        line
        for line in (done.stdout + done.stderr).splitlines()
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


def test_a_damaged_checkpoint_is_never_loaded_and_never_deleted(data, tmp_path):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    first = launch(data, run, "--max-steps", "6")  # saves 2, 4, 6; keeps 4 and 6
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((checkpoints / "step00000006" / "manifest.json").read_text())
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values()), manifest
    optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip(checkpoints / "step00000006" / optim)

    second = launch(data, run, "--max-steps", "8")
    text = second.stderr
    assert second.returncode == 0, text[-3000:]
    assert f"checkpoint {checkpoints / 'step00000006'} is damaged" in text, text[-3000:]
    assert "falling back to the newest intact checkpoint step00000004" in text
    assert "resuming from step 4" in text
    assert (checkpoints / "damaged-step00000006" / optim).is_file()  # kept for a look
    kept = sorted(p.name for p in checkpoints.glob("step*"))
    assert kept == ["step00000004", "step00000006", "step00000008"], kept  # 4: protected

    # a copy of the run directory still in progress: one optimizer file of each short
    for step in (6, 8):
        path = checkpoints / f"step{step:08d}" / optim
        path.write_bytes(path.read_bytes()[:1000])
    history = (run / "metrics.jsonl").read_text()
    third = launch(data, run, "--max-steps", "10")
    assert third.returncode != 0
    assert "Traceback" not in third.stdout + third.stderr
    mine = [line for line in our_lines(third) if "step00000006" in line and "damaged" in line]
    assert mine and str(checkpoints / "step00000006" / optim) in mine[-1], third.stderr[-3000:]
    assert "--restart" in mine[-1]
    after = sorted(p.name for p in checkpoints.glob("step*"))
    assert after == kept and (run / "metrics.jsonl").read_text() == history  # nothing touched

    fourth = launch(data, run, "--max-steps", "2", "--restart")
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    aside = next(run.glob("before-restart-*"))
    assert sorted(p.name for p in (aside / "checkpoints").glob("step*")) == kept
    assert (aside / "metrics.jsonl").read_text() == history
    assert sorted(p.name for p in checkpoints.glob("step*")) == ["step00000002"]
