"""train/finetuning/glue_suite.py on tiny GLUE-format files the test writes (synthetic reviews, in the Hub's
schema through train/finetuning/glue_hub.py): all eight tasks of Table 1 in one process, MNLI-m and -mm, the
row and its average, glue.json; the runs whose metrics.json is gone are the only ones run again,
spread over two device slots (two processes at once)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shatter.train.finetuning.glue_hub import FORMATS, write_split
from shatter.train.finetuning.glue_suite import (
    COLUMNS,
    NOTHING_MARK,
    TASKS,
    Job,
    output_to,
    row,
    table,
)
from tests.jobs import child_env

from .data import sentiment_rows

REPO = Path(__file__).resolve().parents[2]


def glue_dir(root: Path) -> Path:
    reviews = [r["review"] for r in sentiment_rows(80, seed=3)]
    for task, (_, columns, labels, splits) in FORMATS.items():
        for name in splits:
            n = 24 if name == "train" else 12
            rows = [
                {
                    **{c: reviews[(i + k) % len(reviews)] for k, c in enumerate(columns)},
                    "label": (i % 6) * 1.0 if labels is None else i % len(labels),
                }
                for i in range(n)
            ]
            write_split(task, root / TASKS[task][0] / f"{name}.tsv", rows)
    return root


# the export the suite finetunes: a tiny Shatter with the synthetic tokenizer (a subprocess:
# building a model here would draw from torch's RNG beside the tests')
EXPORT = """
import sys
import time
from pathlib import Path
import shatter
from tests.finetune.data import train_tokenizer
root = Path(sys.argv[1])
model = shatter.build_model("shatter-tiny", vocab_size=200, max_len=64, hidden=32, ffn=64)
shatter.save_pretrained(model, root / "export", tokenizer=train_tokenizer(root / "spm"))
"""


def run_suite(
    tmp_path_factory,
) -> tuple[subprocess.CompletedProcess, str, subprocess.CompletedProcess]:
    """The suite over the eight tasks, then again with two runs' metrics.json deleted, spread
    over two device slots: (the first run, its glue.json, the second run)."""
    root = tmp_path_factory.mktemp("glue-suite")
    made = subprocess.run([sys.executable, "-c", EXPORT, str(root)], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env=child_env())  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    out = root / "suite"
    cmd = [
        sys.executable,
        "-m",
        "shatter.train.finetuning.glue_suite",
        "--checkpoint",
        str(root / "export"),
    ]
    cmd += ["--data-dir", str(glue_dir(root / "glue")), "--output", str(out)]
    cmd += ["--seeds", "0", "--max-steps", "2", "--eval-every", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    first = (out / "glue.json").read_text()
    for task in ("rte", "mrpc"):  # two interrupted runs
        (out / task / "lr-default-seed0" / "metrics.json").unlink()
    # spread over two "GPUs": ids that name no GPU, so both processes run on this CPU at once
    again = subprocess.run(cmd + ["--gpus", "none0,none1"], capture_output=True, text=True,
                           cwd=REPO, timeout=900)  # fmt: skip
    return done, first, again


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_suite(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ten finetuning runs: about 2 min on an idle 2-core box
def test_the_suite_runs_the_eight_tasks_prints_the_row_and_resumes(suite):
    done, first, again = suite
    print(done.stdout)
    lines = done.stdout.strip().splitlines()
    at = next(i for i, x in enumerate(lines) if x.split("|")[0].strip() == COLUMNS[0])
    header, values = lines[at : at + 2]
    assert [h.strip() for h in header.split("|")] == COLUMNS + ["Avg"]
    result = json.loads(first)
    assert list(result["columns"]) == COLUMNS and set(result["tasks"]) == set(TASKS)
    numbers = [float(v.strip(" " + NOTHING_MARK)) for v in values.split(" | ")]
    # the row prints each mean and their average to 0.1 (the average of the unrounded means:
    # the printed ones may average up to 0.1 away from it)
    columns = [100 * result["columns"][c] for c in COLUMNS]
    assert result["average"] == pytest.approx(sum(result["columns"].values()) / 9)
    assert numbers == pytest.approx([*columns, 100 * result["average"]], abs=0.051)
    assert result["tasks"]["cola"]["runs"][0]["lr"] == 1e-3  # the default, scaled (and capped)
    assert done.stderr.count("start: ") == 8

    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("start: ") == 2
    assert "start: mrpc/lr-default-seed0 on GPU none0" in again.stderr
    assert "start: rte/lr-default-seed0 on GPU none1" in again.stderr
    assert values in again.stdout.strip().splitlines()


def test_missing_glue_files_are_one_line(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "shatter.train.finetuning.glue_suite",
        "--checkpoint",
        str(tmp_path),
    ]
    cmd += ["--data-dir", str(tmp_path / "none"), "--output", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert (
        done.stderr.strip().count("\n") == 0
        and "cola:" in done.stderr
        and "not found" in done.stderr
    )


def _fake_run(out: Path, accuracy: float, warnings: list[str]) -> None:
    out.mkdir(parents=True)
    evaluations = [{"step": 1, "accuracy": accuracy}]
    metrics = {"evaluations": evaluations, **({"warnings": warnings} if warnings else {})}
    (out / "metrics.json").write_text(json.dumps(metrics))
    (out / "config.json").write_text(json.dumps({"lr": 1e-5}))


def test_the_table_marks_a_column_with_a_run_that_learned_nothing_and_counts_them(tmp_path):
    """SST-2's seed 1 learned nothing (its metrics.json warns): the SST-2 column is marked and
    the summary line counts and names that run; RTE's runs are unmarked."""
    jobs = [Job(t, None, seed, tmp_path / t / f"lr-default-seed{seed}")
            for t in ("sst2", "rte") for seed in (0, 1)]  # fmt: skip
    for job in jobs:
        nothing = job.task == "sst2" and job.seed == 1
        warning = ["warning: the best accuracy ... : the model learned nothing; raise --lr"]
        _fake_run(job.out, 0.5 if nothing else 0.8, warning if nothing else [])
    result = table(jobs, {"checkpoint": "x", "tasks": ["sst2", "rte"]})
    assert result["learned_nothing"] == [str(jobs[1].out)] and result["runs"] == 4
    head, values, summary = row(result).splitlines()
    cells = dict(zip([h.strip() for h in head.split("|")], values.split("|"), strict=True))
    assert cells["SST-2"].strip() == "65.0" + NOTHING_MARK and NOTHING_MARK not in cells["RTE"]
    assert summary.startswith(f"{NOTHING_MARK} learned nothing in 1 of 4 runs")
    assert "sst2/lr-default-seed1" in summary


def test_an_inline_run_prints_into_its_log_down_to_the_file_descriptors(tmp_path, capfd):
    """What a run in the suite's process writes, through Python or straight to fd 1 and 2 (a
    linker's error under DeepSpeed's op probe), goes to its log, not to the suite's console."""
    log = tmp_path / "finetune.log"
    with output_to(log):
        print("python's stdout")
        print("python's stderr", file=sys.stderr)
        os.write(1, b"fd 1\n")
        os.write(2, b"/usr/bin/ld: cannot find -laio\n")
    print("the suite again", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "" and err == "the suite again\n", (out, err)
    text = log.read_text()
    assert all(x in text for x in ("python's stdout", "python's stderr", "fd 1", "-laio")), text


@pytest.mark.parametrize(
    "env",
    [
        {"HF_DATASETS_OFFLINE": "1"},
        {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"},  # a dead proxy
    ],
    ids=["offline", "dead-proxy"],
)
def test_glue_without_data_dir_and_no_hub_is_one_line_naming_data_dir(tmp_path, env):
    """No --data-dir and no Hub (offline, or a proxy that answers nothing): one line naming
    --data-dir and the folders it must hold, in seconds, never a traceback."""
    cmd = [sys.executable, "-m", "shatter.train.finetuning.glue_suite", "--tasks", "rte"]
    cmd += ["--checkpoint", str(tmp_path), "--output", str(tmp_path / "out")]
    environment = child_env(None, HF_HOME=str(tmp_path / "hf"), **env)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=environment)  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0, done.stderr[-2000:]
    assert "--data-dir GLUE_DIR" in done.stderr and "MNLI/dev_matched.tsv" in done.stderr
    assert "Traceback" not in done.stderr and took < 30, took
