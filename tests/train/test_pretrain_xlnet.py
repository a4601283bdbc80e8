"""xlnet-tiny's pretraining with its default objective, the permutation LM, in this process (a
world of one, no launcher): a resume from a checkpoint reproduces the uninterrupted losses
exactly, and a checkpoint missing weights is refused in one line. (A row's PLM targets and order
depend on no rank, so a resume's exactness is the world of one's; test_pretrain.py resumes 2-rank
runs killed at each point of a save. The 2-rank PLM run, whose loss falls and whose export is the
engine's model, shares tests/train/test_ranks.py's launch.)"""

import json
from pathlib import Path

import pytest
import torch

from shatter import safe_load
from shatter.shards.reader import sha256_file
from tests.train.runs import (
    at_step,
    cheap_config,
    in_process,
    metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

# the runs in this process: 4 steps, checkpoints at 2 and 4, validation (of 16 rows) at 4
SHORT = ("--preset", "xlnet-tiny", "--micro-batch", "4", "--max-steps", "4", "--save-every", "2")
SHORT += ("--eval-every", "0", "--log-every", "1", "--num-workers", "0", "--no-progress")


@pytest.fixture(scope="module")
def short_run(books_data, tmp_path_factory) -> tuple[Path, Path]:
    """A 4-step run in this process, and the config it ran with."""
    tmp = tmp_path_factory.mktemp("short")
    run, config = tmp / "run", cheap_config(tmp / "tiny.yaml")
    done = in_process(books_data, run, *SHORT, config=config)
    assert done.exit_code == 0, done.output[-3000:]
    return run, config


def test_a_resume_gives_the_same_plm_losses(books_data, short_run, tmp_path):
    """The short run's step-2 checkpoint, its metrics.jsonl still holding the steps after it
    (as a kill -9 leaves them), resumed: the permutations, targets and rows after it are the
    uninterrupted run's, so its losses and its validation are too, bit for bit."""
    reference, config = short_run
    run = at_step(reference, 2, tmp_path / "resumed")
    done = in_process(books_data, run, *SHORT, config=config)
    assert done.exit_code == 0 and "resuming from step 2" in done.output, done.output[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "split" not in r] == [1, 2, 3, 4]  # cut back at 2
    ref_train, ref_val = metrics(reference)
    train, val = metrics(run)
    assert train == ref_train
    assert {s: v["loss"] for s, v in val.items()} == {s: v["loss"] for s, v in ref_val.items()}
    assert {v["objective"] for v in val.values()} == {"plm"}


def test_a_checkpoint_missing_weights_is_refused_in_one_line(books_data, short_run, tmp_path):
    """A checkpoint without some of the model's weights (here xlnet's segment encoding) cannot
    resume: one line naming the checkpoint, the missing weights and the way out; nothing
    written. (On the world size that wrote it: another would first convert the checkpoint.)"""
    reference, config = short_run
    run = at_step(reference, 4, tmp_path / "run")
    tag = run / "checkpoints" / "step00000004"
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
    done = in_process(books_data, run, *SHORT, "--max-steps", "6", config=config)
    assert done.exit_code == 1, done.output[-3000:]
    error = [line for line in done.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1, done.output[-3000:]
    assert f"{tag} cannot be resumed by this model" in error[0] and "segment_" in error[0]
    assert "another --output" in error[0]
    assert sorted(p.name for p in run.rglob("*")) == before
