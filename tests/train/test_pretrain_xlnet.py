"""xlnet-tiny through `deepspeed --num_gpus 2 train/pretrain.py` on CPU ranks with its default
objective, the permutation LM: the PLM loss falls, validation is labelled plm, kill -9 then
restart reproduces the uninterrupted losses exactly, and the export
loads single-stream; a checkpoint missing weights is refused in one line."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import shatter
from shatter import safe_load
from shatter.shards import read_index
from shatter.shards.reader import sha256_file
from shatter.train.config import DataArgs
from shatter.train.evaluate import evaluate
from shatter.train.loader import validation_stream
from tests.jobs import Outcome, Runs
from tests.train.runs import (
    FP32_ARGS,
    REPO,
    command,
    kill_9_after_a_checkpoint,
    metrics,
    run_to_end,
)

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

# test_pretrain's fp32 ZeRO-1 run, shortened to 40 steps (the last value of a flag wins)
ARGS = (*FP32_ARGS, "--preset", "xlnet-tiny", "--max-steps", "40", "--eval-every", "20")


def _killed_and_restarted(data, run) -> tuple[str, str]:
    """A run killed -9 after a checkpoint, then restarted: (the checkpoint, the restart's stderr)."""
    cmd = command(data, run, *ARGS)
    killed_at = kill_9_after_a_checkpoint(cmd, run)
    return killed_at, run_to_end(cmd).stderr


def run_plm(books_data, tmp_path_factory) -> tuple[Path, Path, Outcome]:
    """The uninterrupted run and the killed one (tests/jobs.py Runs): the reference's path, the
    killed run's, and the killed run's outcome."""
    tmp = tmp_path_factory.mktemp("xlnet")
    reference, killed = tmp / "run", tmp / "killed"
    both = Runs(
        {
            "reference": lambda: run_to_end(command(books_data, reference, *ARGS)),
            "killed": lambda: _killed_and_restarted(books_data, killed),
        }
    )
    both["reference"].get()
    return reference, killed, both["killed"]


@pytest.fixture(scope="module")
def plm_runs(books_data, tmp_path_factory) -> tuple[Path, Path, Outcome]:
    return run_plm(books_data, tmp_path_factory)


@pytest.fixture(scope="module")
def plm_run(plm_runs) -> Path:
    return plm_runs[0]


def test_plm_loss_falls_and_validation_is_labelled_plm(books_data, plm_run):
    train, val = metrics(plm_run)
    assert sorted(train) == list(range(1, 41))
    first, last = sum(train[s] for s in range(1, 6)) / 5, sum(train[s] for s in range(36, 41)) / 5
    assert last < first - 0.5, (first, last)
    assert val[40]["loss"] < val[20]["loss"]
    assert {v["objective"] for v in val.values()} == {"plm"}
    # the export is the engine's model: its query stream gives the run's own validation figures
    model = shatter.from_pretrained(plm_run / "export")
    assert model.config.arch == "xlnet"
    stream = validation_stream(
        read_index(books_data),
        DataArgs(eval_samples=512, objective="plm"),
        batch_size=16,
        seq_len=64,
        rank=0,
        world_size=1,
    )
    mine = evaluate(model, iter(stream), torch.device("cpu"), distributed=False)
    assert mine["predictions"] == val[40]["predictions"]
    assert mine["loss"] == pytest.approx(val[40]["loss"], rel=1e-5)


def test_kill_9_then_restart_gives_the_same_plm_losses(plm_runs):
    plm_run, run, killed = plm_runs
    killed_at, stderr = killed.get()
    assert killed_at != "step00000040"
    assert f"resuming from step {int(killed_at[4:])}" in stderr
    ref_train, ref_val = metrics(plm_run)
    train, val = metrics(run)
    assert train == ref_train
    assert {s: v["loss"] for s, v in val.items()} == {s: v["loss"] for s, v in ref_val.items()}


def test_a_checkpoint_missing_weights_is_refused_in_one_line(books_data, plm_run, tmp_path):
    """A checkpoint without some of the model's weights (here xlnet's segment encoding) cannot
    resume: one line naming the checkpoint, the missing weights and the way out; nothing
    written."""
    run = tmp_path / "run"
    shutil.copytree(plm_run, run)
    tag = run / "checkpoints" / "step00000040"
    states = safe_load.load(tag / "mp_rank_00_model_states.pt")
    states["module"] = {k: v for k, v in states["module"].items() if "segment_" not in k}
    torch.save(states, tag / "mp_rank_00_model_states.pt")
    manifest = json.loads((tag / "manifest.json").read_text())  # a complete checkpoint, of
    states_file = tag / "mp_rank_00_model_states.pt"
    manifest["files"][states_file.name] = {
        "bytes": states_file.stat().st_size,
        "sha256": sha256_file(str(states_file)),
    }
    (tag / "manifest.json").write_text(json.dumps(manifest))  # another model's weights
    before = sorted(p.name for p in run.rglob("*"))
    # on the run's own 2 ranks (another world size would first convert the checkpoint)
    cmd = command(books_data, run, *ARGS, "--max-steps", "42")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode != 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    error = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert 1 <= len(error) <= 2, output[-3000:]  # one line a rank
    for line in error:
        assert f"{tag} cannot be resumed by this model" in line and "segment_" in line, line
        assert "another --output" in line
    assert sorted(p.name for p in run.rglob("*")) == before
