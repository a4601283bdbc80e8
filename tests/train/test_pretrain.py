"""End to end under the deepspeed launcher (two CPU ranks, gloo) on real text built by the real
`shatter-data build`: the loss falls; kill -9 then restart reproduces the uninterrupted losses
exactly (fp32); bf16 with ZeRO-2; SIGTERM saves before exit; the export is the engine's model."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shatter
from pipeline.format import read_index
from tools.evaluate import evaluate_export
from train.config import DataArgs
from train.evaluate import evaluate
from train.loader import validation_stream

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "train" / "pretrain.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(
    data: Path, run: Path, *extra: str, ranks: int = 2, launcher: list[str] | None = None
) -> list[str]:
    """The pretraining command under `launcher` (default: the deepspeed launcher, `ranks` on
    this machine)."""
    if launcher is None:
        launcher = [str(BIN / "deepspeed"), "--num_gpus", str(ranks)]
        launcher += ["--master_port", str(free_port())]
    return launcher + [
        SCRIPT,
        "--data",
        str(data),
        "--output",
        str(run),
        "--preset",
        "shatter-tiny",
        "--config",
        str(REPO / "configs" / "cpu-tiny.yaml"),
        *extra,
    ]


def run_to_end(cmd: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert not shm_left(cmd)
    return done


def shm_left(cmd: list[str]) -> list[Path]:
    """The /dev/shm segments of DeepSpeed's CPU allreduce that the job of `cmd` left behind."""
    if "--master_port" not in cmd:
        return []
    port = cmd[cmd.index("--master_port") + 1]
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def metrics(run: Path) -> tuple[dict[int, float], dict[int, dict]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in lines if "split" not in r}
    val = {r["step"]: r for r in lines if r.get("split") == "validation"}
    return train, val


def kill_9_after_a_checkpoint(cmd: list[str], run: Path) -> str:
    """Start `cmd`, kill -9 the launcher and both ranks once a checkpoint exists and 12 steps are
    logged; return the tag of the newest checkpoint."""
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
        os.killpg(job.pid, signal.SIGKILL)  # kill -9 of the launcher and both ranks
        job.wait(30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return (run / "checkpoints" / "latest").read_text().strip()


def export_validation(export: Path, data: Path, eval_samples: int) -> dict:
    model = shatter.from_pretrained(export)
    stream = validation_stream(
        read_index(data),
        DataArgs(eval_samples=eval_samples),
        batch_size=16,
        seq_len=64,
        rank=0,
        world_size=1,
    )
    batches = ({k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in stream)
    return evaluate(model, batches, torch.device("cpu"), distributed=False)


FP32_ARGS = (
    "--max-steps",
    "60",
    "--precision",
    "fp32",
    "--zero-stage",
    "1",
    "--micro-batch",
    "8",
    "--save-every",
    "10",
    "--eval-every",
    "30",
    "--log-every",
    "1",
    "--warmup-steps",
    "5",
    "--lr",
    "2e-3",
)


def count_requests(start: str) -> list[str]:
    """The requests to the loopback S3 server (its werkzeug log) that begin with `start`, from now."""
    import logging

    seen: list[str] = []

    class Count(logging.Handler):
        def emit(self, record):
            line = record.getMessage()
            if start in line:
                seen.append(line.split(start, 1)[1].split("?")[0].split(" ")[0])

    logger = logging.getLogger("werkzeug")
    logger.setLevel(logging.INFO)
    logger.addHandler(Count())
    return seen


@pytest.fixture(scope="module")
def reference(books_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    done = run_to_end(command(books_data, run, *FP32_ARGS))
    return run, done


def test_fp32_zero1_two_ranks_loss_falls_and_exports_the_engines_model(books_data, reference):
    run, done = reference
    train, val = metrics(run)
    assert sorted(train) == list(range(1, 61))
    first, last = sum(train[s] for s in range(1, 6)) / 5, sum(train[s] for s in range(56, 61)) / 5
    assert last < first - 0.5, (first, last)
    assert val[60]["loss"] < val[30]["loss"]
    assert "pretrain:" in done.stderr and "tok/s=" in done.stderr  # the rank-0 progress bar
    # the cost report: per-GPU rate of 2 ranks, no MFU without a known peak on a CPU, the hours
    # left reaching 0 at max_steps, GPU-hours growing and said at the end
    lines = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "split" not in r]
    for r in lines:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["mfu"] is None and r["hours_to_max_steps"] >= 0
    assert lines[-1]["hours_to_max_steps"] == 0 and lines[0]["hours_to_max_steps"] > 0
    hours = [r["gpu_hours"] for r in lines]
    assert hours == sorted(hours) and hours[-1] > 0
    assert "GPU-hours used to step 60 (world size 2)" in done.stderr
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
    mine = export_validation(run / "export", books_data, eval_samples=512)
    assert mine["predictions"] == val[60]["predictions"]
    assert mine["loss"] == pytest.approx(val[60]["loss"], rel=1e-6)
    assert mine["accuracy"] == pytest.approx(val[60]["accuracy"], abs=1e-9)


def test_kill_9_after_a_checkpoint_then_restart_gives_the_same_losses(
    books_data, reference, tmp_path, s3_server, monkeypatch
):
    """... with the data on object storage (s3://, a loopback server): both ranks read it through
    one node-local cache, each shard fetched once for both runs."""
    remote = s3_server.upload(books_data, "books-train")
    gets = count_requests("GET /shards/books-train/train-")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the cache: $TMPDIR/shatter-cache
    run = tmp_path / "run"
    cmd = command(remote, run, *FP32_ARGS)
    killed_at = kill_9_after_a_checkpoint(cmd, run)
    assert killed_at != "step00000060"
    assert not shm_left(cmd)  # 64 MiB of RAM per rank, unlinked while the job ran
    done = run_to_end(cmd)
    cached = {p.name for p in (tmp_path / "shatter-cache").glob("*.arrow")}
    index = read_index(books_data)
    shards = {f"{s.sha256}.arrow" for s in index.shards("train") + index.shards("validation")}
    assert cached and cached <= shards and not list((tmp_path / "shatter-cache").glob("*.tmp-*"))
    assert gets and len(gets) == len(set(gets)), gets  # once per node, both runs, both ranks
    # tools/evaluate.py on the remote dataset: the scores of the local one
    scores = [
        evaluate_export(run / "export", data, max_samples=64) for data in (remote, books_data)
    ]
    assert scores[0]["loss"] == scores[1]["loss"] and scores[0]["predictions"] > 0
    assert f"resuming from step {int(killed_at[4:])}" in done.stderr
    ref_train, ref_val = metrics(reference[0])
    train, val = metrics(run)
    assert (
        train == ref_train
    )  # bit for bit, every step, the steps redone after the checkpoint included
    assert {s: v["loss"] for s, v in val.items()} == {s: v["loss"] for s, v in ref_val.items()}
    lines = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "split" not in r]
    hours = [r["gpu_hours"] for r in lines]  # the resumed session adds to the killed one's
    assert hours == sorted(hours), hours


def test_bf16_zero2_dynamic_whole_word_masking(books_data, tmp_path):
    run = tmp_path / "run"
    run_to_end(
        command(
            books_data,
            run,
            "--max-steps",
            "6",
            "--precision",
            "bf16",
            "--zero-stage",
            "2",
            "--masking",
            "dynamic",
            "--whole-word",
            "--save-every",
            "3",
            "--eval-every",
            "6",
            "--export-every",
            "3",
            "--micro-batch",
            "4",
            "--log-every",
            "1",
        )
    )
    train, val = metrics(run)
    assert sorted(train) == list(range(1, 7)) and all(v == v for v in train.values())
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == [
        "step00000003",
        "step00000006",
    ]
    optim_files = list((run / "checkpoints" / "step00000006").glob("*optim_states.pt"))
    assert len(optim_files) == 2  # ZeRO-2: one optimizer partition per rank
    assert (run / "export" / "STEP").read_text().strip() == "step00000006"
    mine = export_validation(run / "export", books_data, eval_samples=512)
    # the engine ran bf16 weights; the export holds the fp32 masters consolidated from both partitions
    assert mine["loss"] == pytest.approx(val[6]["loss"], abs=0.05)


def test_sigterm_saves_a_checkpoint_before_exit(books_data, tmp_path):
    """A plain single process (no launcher; the launcher passes SIGTERM on to its ranks)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        SCRIPT,
        "--data",
        str(books_data),
        "--output",
        str(run),
        "--preset",
        "shatter-tiny",
        "--config",
        str(REPO / "configs" / "cpu-tiny.yaml"),
        "--max-steps",
        "100000",
        "--save-every",
        "0",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--micro-batch",
        "4",
        "--num-workers",
        "1",
    ]
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
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
        os.killpg(job.pid, signal.SIGTERM)  # the process and its loader worker, as a scheduler does
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143, err[-3000:]
    saved = (run / "checkpoints" / "latest").read_text().strip()
    assert f"SIGTERM: checkpoint saved at step {int(saved[4:])}" in err
    assert "export in" not in err, "a stopped run writes no export and must not claim one"
    assert "run the same command again to resume" in err
    state = torch.load(
        run / "checkpoints" / saved / "mp_rank_00_model_states.pt", weights_only=False
    )
    assert state["train_state"]["step"] == int(saved[4:]) >= 3
    assert state["data_position"]["samples"] == 4 * state["train_state"]["step"]


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

    from train.pretrain import main

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
    cmd = [
        sys.executable,
        SCRIPT,
        "--data",
        str(books_data),
        "--output",
        str(tmp_path / "run"),
        "--config",
        str(config),
        "--max-steps",
        "10",
        "--micro-batch",
        "2",
        "--num-workers",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "non-finite loss, micro-batch skipped (4 so far)" in done.stderr
    assert "NaN/inf for 4 micro-batches in a row" in done.stderr and "Traceback" not in done.stderr
