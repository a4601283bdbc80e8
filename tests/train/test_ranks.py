"""Two CPU ranks (gloo) under the deepspeed launcher, one job (tests/train/ranks_job.py) for
three things a multi-rank run must get right at every ZeRO stage: the export is the fp32 masters
(bf16 at ZeRO-0 crashed), a NaN step is skipped (fp32 at ZeRO-0 kept the NaN), and a validation
whose rows do not split evenly ends on every rank after the same forwards (ZeRO-3 forwards are
collectives) with the single-process metric. The same launch then runs train/pretrain.py on its
ranks twice: in bf16 with ZeRO-2 and dynamic whole-word masking, and xlnet-tiny with its default
objective, the permutation LM (its loss falls, its validation is labelled plm, its export loads
single-stream). The job is bounded in time: a hang fails the test."""

import json
import math
import subprocess

import pytest
import torch

import shatter
from shatter.shards import read_index
from shatter.train.config import DataArgs
from shatter.train.evaluate import evaluate
from shatter.train.loader import validation_stream
from tests.jobs import child_env, free_port, run_command
from tests.train.runs import (
    BIN,
    FP32_ARGS,
    REPO,
    cheap_config,
    check_exports,
    check_nan_skips,
    command,
    export_validation,
    metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

STAGES = [f"{p}-{z}" for p in ("bf16", "fp32") for z in range(4)]
EVAL_ROWS = 32  # validation rows of both runs (configs/cpu-tiny.yaml: 512)
# the bf16 run: ZeRO-2, dynamic whole-word masks, checkpoints at 3 and 6, an export at each
BF16 = ("--max-steps", "6", "--precision", "bf16", "--zero-stage", "2", "--masking", "dynamic")
BF16 += ("--whole-word", "--save-every", "3", "--eval-every", "6", "--export-every", "3")
BF16 += ("--micro-batch", "4", "--log-every", "1")
# test_pretrain's fp32 ZeRO-1 run, xlnet-tiny's, shortened to 20 steps with one checkpoint, at
# the end (the last value of a flag wins): its loss falls by about 0.9 in them
XLNET_STEPS = 20
XLNET = (*FP32_ARGS, "--preset", "xlnet-tiny", "--max-steps", str(XLNET_STEPS))
XLNET += ("--eval-every", str(XLNET_STEPS // 2), "--save-every", "0")


def run_ranks_job(books_data, tmp_path_factory) -> dict:
    """tests/train/ranks_job.py under the launcher, then the bf16 and the xlnet runs on its ranks:
    its report, with the runs' directories at "bf16_run" and "xlnet_run"."""
    tmp = tmp_path_factory.mktemp("ranks")
    out, run, xlnet = tmp / "report.json", tmp / "bf16" / "run", tmp / "xlnet" / "run"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [str(REPO / "tests" / "train" / "ranks_job.py"), str(books_data), str(tmp), str(out)]
    config = cheap_config(tmp / "tiny.yaml", eval_rows=EVAL_ROWS)
    cmd += ["--pretrain", *command(books_data, run, *BF16, launcher=[], config=config)[1:]]
    cmd += ["--pretrain", *command(books_data, xlnet, *XLNET, launcher=[], config=config)[1:]]
    try:
        done = run_command(cmd, timeout=240, env=child_env())
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or "")[-3000:]
        pytest.fail(f"the 2-rank job did not end in 240 s (a hang): {tail!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    return {**result, "bf16_run": run, "xlnet_run": xlnet}


@pytest.fixture(scope="module")
def report(books_data, tmp_path_factory) -> dict:
    return run_ranks_job(books_data, tmp_path_factory)


def test_export_is_the_fp32_masters_at_every_stage(report):
    check_exports(report, STAGES)


def test_a_nan_activation_skips_the_step_at_every_stage(report):
    check_nan_skips(report, STAGES)
    assert all(report["nan"][key]["skipped_steps"] == 1 for key in STAGES)  # in metrics.jsonl


def test_uneven_validation_under_zero3_matches_one_process(report):
    remainders = []
    for case in report["validation"]:
        remainders.append(case["remainder"])
        forwards = case["forwards_per_rank"]
        assert len(set(forwards)) == 1, case  # the same collectives on every rank
        assert case["results_agree"], case
        ranks, one = case["ranks"], case["one"]
        assert ranks["predictions"] == one["predictions"], case
        assert ranks["accuracy"] == one["accuracy"], case
        assert math.isclose(ranks["loss"], one["loss"], rel_tol=1e-6), case
    assert remainders == [0, 1, 2, 3]


def test_bf16_zero2_dynamic_whole_word_masking(books_data, report):
    run = report["bf16_run"]
    train, val = metrics(run)
    assert sorted(train) == list(range(1, 7)) and all(v == v for v in train.values())
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == [
        "step00000003",
        "step00000006",
    ]
    optim_files = list((run / "checkpoints" / "step00000006").glob("*optim_states.pt"))
    assert len(optim_files) == 2  # ZeRO-2: one optimizer partition per rank
    assert (run / "export" / "STEP").read_text().strip() == "step00000006"
    mine = export_validation(run / "export", books_data, eval_samples=EVAL_ROWS)
    # the engine ran bf16 weights; the export holds the fp32 masters consolidated from both partitions
    assert mine["loss"] == pytest.approx(val[6]["loss"], abs=0.05)


def test_xlnet_plm_loss_falls_and_validation_is_labelled_plm(books_data, report):
    plm_run = report["xlnet_run"]
    train, val = metrics(plm_run)
    end, half = XLNET_STEPS, XLNET_STEPS // 2
    assert sorted(train) == list(range(1, end + 1))
    first = sum(train[s] for s in range(1, 6)) / 5
    last = sum(train[s] for s in range(end - 4, end + 1)) / 5
    assert last < first - 0.5, (first, last)
    assert val[end]["loss"] < val[half]["loss"]
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
    assert mine["predictions"] == val[end]["predictions"]
    assert mine["loss"] == pytest.approx(val[end]["loss"], rel=1e-5)
