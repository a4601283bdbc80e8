"""End to end under the deepspeed launcher (two CPU ranks, gloo) on real text built by the real
`shatter-data build`: the loss falls; kill -9 at each point of a save then restart (between the
ranks' files: two ranks reading the data from object storage; before and after them: a world of
one) reproduces the uninterrupted losses exactly (fp32); SIGTERM saves before exit; the export
is the engine's model. (bf16 with ZeRO-2 runs in tests/train/test_ranks.py's launch.)"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from shatter import safe_load
from shatter.shards import read_index
from shatter.train.evaluate_cli import evaluate_export
from tests.jobs import child_env
from tests.s3server import count_requests
from tests.train.runs import (
    FP32_ARGS,
    REPO,
    SCRIPT,
    cheap_config,
    command,
    export_validation,
    in_process,
    metrics,
    run_to_end,
    shm_left,
)

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]
FAULTY = str(REPO / "tests" / "train" / "faulty_pretrain.py")
EVAL_ROWS = 128  # validation rows an evaluation (configs/cpu-tiny.yaml: 512)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The launched runs' config: configs/cpu-tiny.yaml with EVAL_ROWS validation rows."""
    return cheap_config(
        tmp_path_factory.mktemp("config") / "tiny.yaml", eval_rows=EVAL_ROWS, tensorboard=True
    )


@pytest.fixture(scope="module")
def few_rows(tmp_path_factory) -> Path:
    """The config of the runs whose validation and TensorBoard files no assert reads."""
    return cheap_config(tmp_path_factory.mktemp("config") / "few.yaml")


@pytest.fixture(scope="module")
def reference(books_data, config, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    done = run_to_end(command(books_data, run, *FP32_ARGS, config=config))
    return run, done


def test_fp32_zero1_two_ranks_loss_falls_and_exports_the_engines_model(books_data, reference):
    run, done = reference
    train, val = metrics(run)
    assert sorted(train) == list(range(1, 61))
    first, last = sum(train[s] for s in range(1, 6)) / 5, sum(train[s] for s in range(56, 61)) / 5
    assert last < first - 0.5, (first, last)
    assert val[60]["loss"] < val[30]["loss"]
    assert "pretrain 5/60 " in done.stderr and "tok/s=" in done.stderr  # rank 0's progress lines
    # the cost report: per-GPU rate of 2 ranks, no MFU without a known peak on a CPU, the hours
    # left reaching 0 at max_steps, GPU-hours growing and said at the end
    lines = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "split" not in r]
    for r in lines:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["mfu"] is None and r["hours_to_max_steps"] >= 0
    assert lines[-1]["hours_to_max_steps"] == 0 and lines[0]["hours_to_max_steps"] > 0
    hours = [r["gpu_hours"] for r in lines]
    assert hours == sorted(hours) and hours[-1] > 0
    assert "device-hours used to step 60 (world size 2)" in done.stderr  # a CPU run's words
    # a job's log, piped: plain lines (no bar's carriage returns or cursor escapes), no line
    # twice (one copy of each warning per job), and the same lines time-stamped in RUN/train.log
    assert "\x1b" not in done.stderr and "\r" not in done.stderr
    for stream in (done.stderr, done.stdout):
        repeated = [x for x, n in Counter(stream.splitlines()).items() if n > 1 and x.strip()]
        assert not repeated, repeated
    # and none of DeepSpeed's lines that ask nothing of the user (train/engine.py)
    for noise in ("built successfully", "before it has started", "all_gather_into_tensor"):
        assert noise not in done.stdout + done.stderr, noise
    assert "pretrain 60/60 loss=" in done.stderr and "left=0:00" in done.stderr
    logged = (run / "train.log").read_text()
    assert "pretrain 60/60 loss=" in logged and "checkpoint" in logged
    # the rates are over training time: the line after step 30's validation and checkpoint
    # reports their seconds apart, and its tokens/s is not diluted by them
    by_step = {r["step"]: r for r in lines}
    after = by_step[31]
    assert after["validation_s"] > 0 and after["checkpoint_s"] > 0, after
    assert by_step[29]["validation_s"] == by_step[29]["checkpoint_s"] == 0
    for r in lines[1:]:
        tokens = r["tokens"] - by_step[r["step"] - 1]["tokens"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["training_s"], rel=1e-9)
    before = sorted(by_step[s]["tokens_per_s"] for s in range(21, 30))[4]  # the median
    print(
        f"tokens/s: {before:,.0f} before the validation at step 30, {after['tokens_per_s']:,.0f}"
        f" after it ({after['validation_s']:.2f} s of validation, {after['checkpoint_s']:.2f} s"
        f" of checkpoint apart): ratio {after['tokens_per_s'] / before:.2f}"
    )
    assert after["tokens_per_s"] > before / 3  # 5x lower when they counted as training time
    assert lines[-1]["gpu_hours_lost"] == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["deepspeed"]["train_batch_size"] == 16
    assert (run / "export" / "STEP").read_text().strip() == "step00000060"
    assert {p.name for p in (run / "export").iterdir()} >= {
        "model.safetensors",
        "config.json",
        "tokenizer.model",
    }
    assert (run / "export" / "tokenizer.model").read_bytes() == (
        books_data / "tokenizer.model"
    ).read_bytes()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # the engine evaluated its model at step 60; the export, reloaded, must give the same numbers
    mine = export_validation(run / "export", books_data, eval_samples=EVAL_ROWS)
    assert mine["predictions"] == val[60]["predictions"]
    assert mine["loss"] == pytest.approx(val[60]["loss"], rel=1e-6)
    assert mine["accuracy"] == pytest.approx(val[60]["accuracy"], abs=1e-9)


def test_sigterm_abandons_a_step_too_long_to_save_and_resumes_exactly(
    books_data, few_rows, tmp_path
):
    """A plain single process (no launcher; the launcher passes SIGTERM on to its ranks) with 4
    micro-batches per step, each slowed down, and the launcher's SIGKILL taken to come 1 s
    after the signal (tests/train/faulty_pretrain.py): the step in progress is abandoned, the
    last completed one saved at its own stream position; the same command, resumed, gives the
    losses of a run that never stopped, bit for bit."""
    run = tmp_path / "run"
    args = ("--max-steps", "100000", "--save-every", "0", "--eval-every", "0", "--log-every", "1")
    args += ("--micro-batch", "4", "--grad-accum", "4", "--num-workers", "1")
    args += ("--decay", "constant")  # the lr of a step does not depend on --max-steps
    cmd = command(books_data, run, *args, launcher=[sys.executable], config=few_rows)
    cmd[cmd.index(SCRIPT)] = FAULTY
    slow = child_env(SHATTER_TEST_SLOW="0.3", SHATTER_TEST_GRACE="1")
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=slow,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count(
                "\n"
            ) >= 3:
                break
            time.sleep(0.05)
        if job.poll() is not None:
            pytest.fail("the run ended before SIGTERM: " + job.communicate()[1][-3000:])
        # one run per run directory: a second run on it (here in this process) stops in one
        # line, writing nothing
        written = (run / "config.json").read_text()
        second = in_process(books_data, run, *args, "--micro-batch", "2", config=few_rows)
        assert second.exit_code == 1, second.output[-3000:]
        said = [x for x in second.output.splitlines() if x.startswith("Error:")]
        assert len(said) == 1 and f"(pid {job.pid} on " in said[0], second.output[-3000:]
        assert "one run per --output" in said[0] and "Traceback" not in second.output
        assert (run / "config.json").read_text() == written
        os.killpg(job.pid, signal.SIGTERM)  # the process and its loader worker, as a scheduler does
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, err[-3000:]
    saved = (run / "checkpoints" / "latest").read_text().strip()
    step = int(saved[4:])
    assert f"SIGTERM: step {step + 1} abandoned after " in err, err[-3000:]
    assert f"SIGTERM: checkpoint saved at step {step}" in err
    assert "export in" not in err, "a stopped run writes no export and must not claim one"
    assert "run the same command again to resume" in err
    state = safe_load.load(run / "checkpoints" / saved / "mp_rank_00_model_states.pt")
    assert state["train_state"]["step"] == step >= 3
    assert state["data_position"]["samples"] == 16 * step  # the last whole step's position
    # the same command at full speed, and a run that never stopped: in this process
    args += ("--max-steps", str(step + 2))
    resumed = in_process(books_data, run, *args, config=few_rows)
    assert resumed.exit_code == 0 and "resuming from step" in resumed.output, resumed.output
    never = in_process(books_data, tmp_path / "reference", *args, config=few_rows)
    assert never.exit_code == 0, never.output[-3000:]
    assert metrics(run)[0] == metrics(tmp_path / "reference")[0]  # bit for bit, every step


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--data", "{tmp}/missing"], "data directory not found"),
        (["--data", "{tmp}"], "index.json not found"),
        (["--data", "{books}", "--seq-len", "128"], "longer than the data's seq_len 64"),
    ],
)
def test_clear_errors_for_bad_data(books_data, tmp_path, extra, message):
    from click.testing import CliRunner

    from shatter.train.pretrain import main

    args = ["--output", str(tmp_path / "run"), "--preset", "shatter-tiny"]
    args += [a.format(tmp=tmp_path, books=books_data) for a in extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and message in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


def test_nonfinite_losses_are_skipped_counted_and_a_diverged_run_stops_clearly(
    books_data, tmp_path
):
    """Weights initialised at 1e30 overflow fp32: every loss is NaN/inf."""
    config = tmp_path / "diverge.yaml"
    config.write_text(
        (REPO / "configs" / "cpu-tiny.yaml")
        .read_text()
        .replace(
            "  preset: shatter-tiny",
            "  preset: shatter-tiny\n  overrides: {initializer_range: 1.0e+30}",
        )
        .replace("run:\n", "run:\n  max_nonfinite: 4\n")
    )
    args = ("--max-steps", "10", "--micro-batch", "2", "--num-workers", "0")
    done = in_process(books_data, tmp_path / "run", *args, config=config)  # a world of one
    assert done.exit_code == 1, done.output[-3000:]
    assert "non-finite loss, micro-batch skipped (4 so far)" in done.output
    assert "NaN/inf for 4 micro-batches in a row" in done.output and "Traceback" not in done.output


def _killed_at(cmd: list[str], kill: str, log: Path) -> int:
    """Run `cmd` (train/pretrain.py under tests/train/faulty_pretrain.py) until its kill -9
    at `kill` (POINT:STEP); returns the launcher's exit status."""
    env = child_env(SHATTER_TEST_KILL_SAVE=kill)
    with open(log, "w") as err:
        job = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True
        )
        try:
            job.wait(240)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return job.returncode


def test_kill_9_during_a_save_resumes_exactly_or_from_the_checkpoint_before(
    books_data, config, few_rows, reference, tmp_path, s3_server, monkeypatch
):
    """kill -9 of the whole job at each point of a save; each restart resumes from the newest
    complete checkpoint (the save's own after `latest`, the one before otherwise), and the
    final losses are those of a run that never stopped, bit for bit, the steps redone after each
    kill included. Between rank 0's files and rank 1's (ZeRO-1's partitions), two ranks under
    the launcher, their data on object storage (s3://, a loopback server): both ranks read it
    through one node-local cache, each shard fetched once for both jobs. Before any file of the
    save and after `latest` names it, points no rank's partition tells apart: a world of one (a
    plain process), killed at both in turn."""
    remote = s3_server.upload(books_data, "books-train")
    gets = count_requests("GET /shards/books-train/train-")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the cache: $TMPDIR/shatter-cache-<user>
    run = tmp_path / "run"
    cmd = command(remote, run, *FP32_ARGS, config=config)
    cmd[cmd.index(SCRIPT)] = FAULTY
    assert _killed_at(cmd, "between:30", tmp_path / "between.log") == -9
    assert not shm_left(cmd)  # 64 MiB of RAM per rank, unlinked while the job ran
    assert not (run / "checkpoints" / "step00000030" / "manifest.json").exists()
    assert (run / "checkpoints" / "latest").read_text() == "step00000020"
    done = run_to_end(command(remote, run, *FP32_ARGS, config=config))
    skipped = f"checkpoint {run / 'checkpoints' / 'step00000030'} is incomplete (no manifest"
    assert skipped in done.stderr and "resuming from step 20" in done.stderr, done.stderr[-3000:]
    assert "run.lock: the lock of a run that is gone" in done.stderr
    manifest = json.loads((run / "checkpoints" / "step00000060" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 1
    assert len([f for f in manifest["files"] if "optim_states" in f]) == 2
    node_cache = next(tmp_path.glob("shatter-cache-*"))
    cached = {p.name for p in node_cache.rglob("*.arrow")}
    index = read_index(books_data)
    shards = {f"{s.sha256}.arrow" for s in index.shards("train") + index.shards("validation")}
    assert cached and cached <= shards and not list(node_cache.rglob(".tmp-*"))
    assert gets and len(gets) == len(set(gets)), gets  # once per node, both jobs, both ranks
    # train/evaluate_cli.py on the remote dataset: the scores of the local one
    scores = [
        evaluate_export(run / "export", data, max_samples=64) for data in (remote, books_data)
    ]
    assert scores[0]["loss"] == scores[1]["loss"] and scores[0]["predictions"] > 0
    _same_losses(run, reference[0])  # the steps redone after the kill included
    # a world of one: killed before the save of step 4 (the one of step 2 stands), then, resumed
    # from it, once `latest` names step 6; the last run, and one that never stopped, in this
    # process
    one, args = tmp_path / "one", (*FP32_ARGS, "--max-steps", "8", "--save-every", "2")
    args += ("--eval-every", "4", "--num-workers", "0")
    cmd = command(books_data, one, *args, launcher=[sys.executable], config=few_rows)
    cmd[cmd.index(SCRIPT)] = FAULTY
    assert _killed_at(cmd, "before:4", tmp_path / "before.log") == -9
    assert (one / "checkpoints" / "latest").read_text() == "step00000002"
    assert not (one / "checkpoints" / "step00000004").exists()
    assert _killed_at(cmd, "after:6", tmp_path / "after.log") == -9
    after = (tmp_path / "after.log").read_text()
    assert "resuming from step 2" in after, after[-3000:]
    assert "run.lock: the lock of a run that is gone" in after
    assert (one / "checkpoints" / "latest").read_text() == "step00000006"
    last = in_process(books_data, one, *args, config=few_rows)
    assert last.exit_code == 0 and "resuming from step 6" in last.output, last.output[-3000:]
    never = in_process(books_data, tmp_path / "never", *args, config=few_rows)
    assert never.exit_code == 0, never.output[-3000:]
    _same_losses(one, tmp_path / "never")


def _same_losses(run: Path, unbroken: Path) -> None:
    """`run`'s training losses are `unbroken`'s, bit for bit, and so are its validation losses;
    its GPU-hours grow across its sessions (each resumed one adds to the killed one's)."""
    ref_train, ref_val = metrics(unbroken)
    train, val = metrics(run)
    assert train == ref_train
    assert val and {s: v["loss"] for s, v in val.items()} == {
        s: v["loss"] for s, v in ref_val.items()
    }
    lines = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "split" not in r]
    hours = [r["gpu_hours"] for r in lines]
    assert hours == sorted(hours), hours


def test_a_skipped_micro_batch_keeps_the_step_boundary(books_data, few_rows, tmp_path, monkeypatch):
    """--grad-accum 4 with a NaN loss in the 2nd micro-batch of step 2 (micro-batch 5, as
    tests/train/faulty_pretrain.py's SHATTER_TEST_NAN injects it, here in this process), then a
    resume: every checkpoint's position is a whole number of steps, and no row is trained
    twice."""
    import deepspeed

    forward = deepspeed.DeepSpeedEngine.forward

    def nan_forward(engine, *args, **kwargs):
        out = forward(engine, *args, **kwargs)
        if engine.training and engine.micro_steps == 5:
            out["loss"] = out["loss"] * float("nan")
        return out

    run, log = tmp_path / "run", tmp_path / "rows"
    args = ("--micro-batch", "2", "--grad-accum", "4", "--save-every", "2", "--eval-every", "0")
    args += ("--log-every", "1", "--num-workers", "0", "--no-progress", "--sample-log", str(log))
    with monkeypatch.context() as patch:
        patch.setattr(deepspeed.DeepSpeedEngine, "forward", nan_forward)
        done = in_process(books_data, run, *args, "--max-steps", "4", config=few_rows)
    assert done.exit_code == 0, done.output[-3000:]
    assert "step 2: non-finite loss, micro-batch skipped (1 so far)" in done.output, done.output
    resumed = in_process(books_data, run, *args, "--max-steps", "6", config=few_rows)
    assert resumed.exit_code == 0, resumed.output[-3000:]
    assert "resuming from step 4" in resumed.output, resumed.output[-3000:]
    assert "non-finite loss, micro-batch skipped" not in resumed.output
    for step in (4, 6):  # step 2 is pruned (keep_checkpoints: 2)
        state = safe_load.load(
            run / "checkpoints" / f"step{step:08d}" / "mp_rank_00_model_states.pt"
        )
        assert state["data_position"]["samples"] == 8 * step, state["data_position"]
    micro = [json.loads(x) for x in (tmp_path / "rows.rank0.jsonl").read_text().splitlines()]
    positions = [p for p, _ in micro]
    assert positions == list(range(0, 48, 2)), positions  # 24 micro-batches, none repeated
    rows = [r for _, ids in micro for r in ids]
    assert len(rows) == len(set(rows)) == 48
