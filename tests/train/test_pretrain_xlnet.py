"""xlnet-tiny through `deepspeed --num_gpus 2 train/pretrain.py` on CPU ranks with its default
objective, the permutation LM: the PLM loss falls, validation is labelled plm, and the export
loads single-stream. In this process (a world of one, no launcher): a resume from a checkpoint
reproduces the uninterrupted losses exactly, and a checkpoint missing weights is refused in one
line. (A row's PLM targets and order depend on no rank, so a resume's exactness is the world of
one's; test_pretrain.py resumes 2-rank runs killed at each point of a save.)"""

import json
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
from tests.train.runs import (
    FP32_ARGS,
    at_step,
    command,
    fewer_eval_rows,
    in_process,
    metrics,
    run_to_end,
)

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

# test_pretrain's fp32 ZeRO-1 run, shortened to 30 steps (the last value of a flag wins)
ARGS = (*FP32_ARGS, "--preset", "xlnet-tiny", "--max-steps", "30", "--eval-every", "15")
EVAL_ROWS = 128  # an evaluation of xlnet-tiny's two streams: about 6 CPU-s per 128 rows
# the runs in this process: 4 steps, checkpoints at 2 and 4, validation (of 16 rows) at 4
SHORT = ("--preset", "xlnet-tiny", "--micro-batch", "4", "--max-steps", "4", "--save-every", "2")
SHORT += ("--eval-every", "0", "--log-every", "1", "--num-workers", "0", "--no-progress")


@pytest.fixture(scope="module")
def plm_run(books_data, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("xlnet")
    run = tmp / "run"
    config = fewer_eval_rows(tmp / "tiny.yaml", EVAL_ROWS)
    run_to_end(command(books_data, run, *ARGS, config=config))
    return run


@pytest.fixture(scope="module")
def short_run(books_data, tmp_path_factory) -> tuple[Path, Path]:
    """A 4-step run in this process, and the config it ran with."""
    tmp = tmp_path_factory.mktemp("short")
    run, config = tmp / "run", fewer_eval_rows(tmp / "tiny.yaml", 16)
    done = in_process(books_data, run, *SHORT, config=config)
    assert done.exit_code == 0, done.output[-3000:]
    return run, config


def test_plm_loss_falls_and_validation_is_labelled_plm(books_data, plm_run):
    train, val = metrics(plm_run)
    assert sorted(train) == list(range(1, 31))
    first, last = sum(train[s] for s in range(1, 6)) / 5, sum(train[s] for s in range(26, 31)) / 5
    assert last < first - 0.5, (first, last)
    assert val[30]["loss"] < val[15]["loss"]
    assert {v["objective"] for v in val.values()} == {"plm"}
    # the export is the engine's model: its query stream gives the run's own validation figures
    model = shatter.from_pretrained(plm_run / "export")
    assert model.config.arch == "xlnet"
    stream = validation_stream(
        read_index(books_data),
        DataArgs(eval_samples=EVAL_ROWS, objective="plm"),
        batch_size=16,
        seq_len=64,
        rank=0,
        world_size=1,
    )
    mine = evaluate(model, iter(stream), torch.device("cpu"), distributed=False)
    assert mine["predictions"] == val[30]["predictions"]
    assert mine["loss"] == pytest.approx(val[30]["loss"], rel=1e-5)


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
