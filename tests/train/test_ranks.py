"""Two CPU ranks (gloo) under the deepspeed launcher, one job (tests/train/ranks_job.py) for
three things a multi-rank run must get right at every ZeRO stage: the export is the fp32 masters
(bf16 at ZeRO-0 crashed), a NaN step is skipped (fp32 at ZeRO-0 kept the NaN), and a validation
whose rows do not split evenly ends on every rank after the same forwards (ZeRO-3 forwards are
collectives) with the single-process metric. The job is bounded in time: a hang fails the test."""

import json
import math
import subprocess

import pytest

from tests.jobs import child_env, free_port, run_command
from tests.train.runs import BIN, REPO, check_exports, check_nan_skips

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

STAGES = [f"{p}-{z}" for p in ("bf16", "fp32") for z in range(4)]


def run_ranks_job(books_data, tmp_path_factory) -> dict:
    """tests/train/ranks_job.py under the launcher: its report."""
    tmp = tmp_path_factory.mktemp("ranks")
    out = tmp / "report.json"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port())]
    cmd += [str(REPO / "tests" / "train" / "ranks_job.py"), str(books_data), str(tmp), str(out)]
    try:
        done = run_command(cmd, timeout=240, env=child_env())
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or "")[-3000:]
        pytest.fail(f"the 2-rank job did not end in 240 s (a hang): {tail!r}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    return result


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
