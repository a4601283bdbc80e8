"""xlnet-tiny through `deepspeed --num_gpus 2 train/pretrain.py` on CPU ranks with its default
objective, the permutation LM: the PLM loss falls, validation is labelled plm, kill -9 then
restart reproduces the uninterrupted losses exactly, and the export loads single-stream."""

import os
import signal
import subprocess
import time

import pytest
import torch
from test_pretrain import REPO, command, metrics, run_to_end

import shatter
from pipeline.format import read_index
from train.config import DataArgs
from train.data import validation_stream
from train.evaluate import evaluate

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

ARGS = (
    "--preset",
    "xlnet-tiny",
    "--max-steps",
    "40",
    "--micro-batch",
    "8",
    "--save-every",
    "10",
    "--eval-every",
    "20",
    "--log-every",
    "1",
    "--warmup-steps",
    "5",
    "--lr",
    "2e-3",
)


@pytest.fixture(scope="module")
def plm_run(books_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("xlnet") / "run"
    run_to_end(command(books_data, run, *ARGS))
    return run


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


def test_kill_9_then_restart_gives_the_same_plm_losses(books_data, plm_run, tmp_path):
    run = tmp_path / "run"
    cmd = command(books_data, run, *ARGS)
    job = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            log = run / "metrics.jsonl"
            logged = log.read_text().count('"lr"') if log.exists() else 0
            if (run / "checkpoints" / "latest").exists() and logged >= 12:
                break
            time.sleep(0.05)
        assert job.poll() is None, "the run ended before it could be killed"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    killed_at = (run / "checkpoints" / "latest").read_text().strip()
    assert killed_at != "step00000040"
    done = run_to_end(cmd)
    assert f"resuming from step {int(killed_at[4:])}" in done.stderr
    ref_train, ref_val = metrics(plm_run)
    train, val = metrics(run)
    assert train == ref_train
    assert {s: v["loss"] for s, v in val.items()} == {s: v["loss"] for s, v in ref_val.items()}
