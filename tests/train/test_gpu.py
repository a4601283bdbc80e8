"""The GPU lane (`make test-gpu`): the real CLIs on one CUDA device; on CPU ranks in the lane's
rehearsal (tests/lane.py), else skipped without CUDA.

Pretraining tiny models in fp16 and bf16 under ZeRO 0-3 (a validation pass, checkpoints, the
export, the GPU memory figures), the export's fp32 masters and the NaN-step skip in fp16, bf16
and fp32 at ZeRO-0/1/3 (tests/train/ranks_job.py), an exact resume after SIGKILL in bf16,
shatter-extend to 1024 and train/evaluate_cli.py at 1024 (on the GPU). Each asserts the exit code,
finite losses, and an exit within 30 s of the job's last line. --sync-debug warn makes torch warn at every host sync of
the training steps: the lane prints what remains. The V100 path (fp16, DeepSpeed's dynamic loss
scaling, Shatter's chunked and rows attention an sm_70 GPU runs, BERT beside them) through
pretraining with an overflow skipped, the export and shatter-extend, on any GPU."""

import json
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tests.jobs import Job, finish_soon, free_port
from tests.lane import CUDA, DEVICE, lane, needs_gpu, precisions
from tests.train.runs import check_exports, check_nan_skips, command
from tests.train.shardutil import build_books

pytestmark = [*lane, pytest.mark.shared_data]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def pretrain(data: Path, run: Path, *extra: str) -> list[str]:
    return command(data, run, "--micro-batch", "16", "--no-progress", *extra, ranks=1)


def train_lines(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "split" not in x]


# what tells a non-finite forward (skipped_nonfinite), an fp16 overflow (skipped_steps,
# loss_scale) and a diverging update (grad_norm) apart
SHOWN = ("step", "loss", "lr", "skipped_nonfinite", "skipped_steps", "grad_norm", "loss_scale")


def shown(lines: list[dict], title: str = "") -> str:
    """Log lines as an assert's message, one a line (pytest cuts the repr of a list short; a
    string it shows whole)."""
    rows = [json.dumps({k: x[k] for k in SHOWN if k in x}) for x in lines]
    return "\n".join([title, *rows] if title else rows)


def losses_finite(lines: list[dict]) -> bool:
    """Every line's loss finite (a window of non-finite micro-batches only logs null)."""
    return all(x["loss"] is not None and math.isfinite(x["loss"]) for x in lines)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", precisions("fp16", "bf16"))
def test_pretrain_validates_checkpoints_exports_and_reports_memory(
    books_data, tmp_path, precision, zero
):
    run = tmp_path / "run"
    cmd = pretrain(
        books_data,
        run,
        "--precision",
        precision,
        "--zero-stage",
        str(zero),
        "--max-steps",
        "8",
        "--eval-every",
        "4",
        "--save-every",
        "4",
        "--log-every",
        "2",
    )
    text = finish_soon(Job([*cmd, "--sync-debug", "warn"]), timeout=300)
    lines = train_lines(run)
    assert [x["step"] for x in lines] == [2, 4, 6, 8]
    assert losses_finite(lines), shown(lines)
    assert all(("loss_scale" in x) == (precision == "fp16") for x in lines), shown(lines)
    assert (run / "export" / "STEP").is_file()
    if CUDA:
        assert all(x["gpu_mem_peak_gb"] > 0 and x["gpu_mem_reserved_gb"] > 0 for x in lines)
        assert "GPU memory peak" in text
    syncs = [line for line in text.splitlines() if "synchroniz" in line.lower()]
    print(f"{precision} ZeRO-{zero}: {len(syncs)} sync warnings", *syncs[:20], sep="\n")


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_export_and_nan_skip_in_16_bit_at_zero_0_1_3(books_data, tmp_path, stage):
    """tests/train/ranks_job.py on one GPU: the export is the fp32 masters (fp16 and bf16), a NaN
    activation's step is skipped (fp32 at ZeRO-0: by torch's fused AdamW on the device), and fp16
    logs its loss scale, at ZeRO-0, 1 and 3."""
    out = tmp_path / "report.json"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port())]
    cmd += [str(REPO / "tests" / "train" / "ranks_job.py"), str(books_data), str(tmp_path)]
    precisions = ("fp16", "bf16", "fp32") if CUDA else ("bf16", "fp32")
    cmd += [str(out), ",".join(precisions), str(stage)]
    finish_soon(Job(cmd), timeout=300)
    report = json.loads(out.read_text())
    keys = [f"{p}-{stage}" for p in precisions]
    check_exports(report, keys)
    check_nan_skips(report, keys)


RESUME_RTOL = 5e-3  # bf16 losses of two processes whose autotuning may pick other configs


def test_exact_resume_after_sigkill_in_bf16(books_data, tmp_path):
    extra = ("--precision", "bf16", "--max-steps", "8", "--save-every", "4", "--log-every", "1")
    whole = tmp_path / "whole"
    finish_soon(Job(pretrain(books_data, whole, *extra, "--eval-every", "0")), timeout=300)
    cut = tmp_path / "cut"
    job = Job(pretrain(books_data, cut, *extra, "--eval-every", "0"))
    job.wait_for("checkpoint step00000004", timeout=300)
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.wait(30)
    finish_soon(Job(pretrain(books_data, cut, *extra, "--eval-every", "0")), timeout=300)
    whole_lines, cut_lines = train_lines(whole), train_lines(cut)
    a = {x["step"]: x["loss"] for x in whole_lines}
    b = {x["step"]: x["loss"] for x in cut_lines}
    both = shown(whole_lines, "uninterrupted:") + "\n" + shown(cut_lines, "killed and resumed:")
    # Triton autotunes the attention kernels in each process and may time another config the
    # best: a config's bf16 rounding differs in the last bits, so "exact" is to a tolerance
    # (a resume at the wrong sample or with a lost optimizer state differs by far more)
    assert sorted(a) == sorted(b) == list(range(1, 9)), both
    assert b == pytest.approx(a, rel=RESUME_RTOL), both


def test_extend_to_1024_and_evaluate_at_1024(shared_data, books_data, tmp_path):
    run = tmp_path / "run"
    finish_soon(Job(pretrain(books_data, run, "--precision", "bf16", "--max-steps", "4")), 300)
    result = extend_and_evaluate(shared_data, books_data, run / "export", 1024, tmp_path)
    assert result["seq_len"] == 1024 and math.isfinite(result["loss"])
    assert result["device"] == DEVICE  # a GPU node evaluates on its GPU


def extend_and_evaluate(shared_data, books_data, export, length: int, tmp_path) -> dict:
    """shatter-extend `export` to `length`, then train/evaluate_cli.py's figures on books rows of
    that length (the pretraining dataset's tokenizer)."""
    long_data = tmp_path / f"l{length}"
    build_books(shared_data, long_data, "--seq-len", str(length), "--num-shards", "1",
                "--tokenizer", str(books_data / "tokenizer.model"))  # fmt: skip
    extended = tmp_path / "extended"
    extend = [str(BIN / "shatter-extend"), str(export), "--max-len", str(length)]
    finish_soon(Job(extend + ["--output", str(extended)]), timeout=300)
    out = tmp_path / "eval.json"
    evaluate = [sys.executable, "-m", "shatter.train.evaluate_cli", "--checkpoint", str(extended)]
    evaluate += ["--data", str(long_data), "--max-samples", "64", "--output", str(out)]
    finish_soon(Job(evaluate), timeout=300)
    return json.loads(out.read_text())


V100_PATHS = {  # what an sm_70 GPU runs in fp16: Shatter's attention impls, and BERT beside them
    "shatter-chunked": ("shatter-tiny", "chunked"),
    "shatter-rows": ("shatter-tiny", "rows"),  # auto's choice on a V100 for long rows
    "shatter-rows-keep": ("shatter-tiny", "rows-keep"),  # a run's auto at 4 x 1024 (keeps_rows)
    "shatter-triton": ("shatter-tiny", "triton"),  # auto's at the paper's shapes: FMA dots
    "bert": ("bert-tiny", None),
}


@needs_gpu
@pytest.mark.parametrize("path", list(V100_PATHS))
def test_the_v100_path_fp16_loss_scaling_and_attention(shared_data, books_data, tmp_path, path):
    """What an sm_70 GPU runs, forced on this one: fp16 under DeepSpeed's dynamic loss scaling,
    the first steps overflowing (a loss scale of 2^32) and skipped, and Shatter's attention
    forced with `attention_impl` (chunked, the cuBLAS + Triton row kernels `rows` and `rows-keep`,
    or `triton` with its mixing dots on FMAs) or BERT;
    then the export and, for Shatter, shatter-extend to twice the length and an evaluation."""
    preset, impl = V100_PATHS[path]
    config = yaml.safe_load((REPO / "configs" / "cpu-tiny.yaml").read_text())
    config["model"]["preset"] = preset
    config["model"]["overrides"] = {"attention_impl": impl} if impl else {}
    config["optim"]["initial_scale_power"] = 32
    config_path = tmp_path / "v100.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    cmd = pretrain(books_data, run, "--precision", "fp16", "--max-steps", "40", "--log-every", "5")
    cmd += ["--config", str(config_path), "--eval-every", "0", "--preset", preset]
    finish_soon(Job(cmd), timeout=300)
    lines = train_lines(run)
    assert losses_finite(lines), shown(lines)
    assert lines[-1]["skipped_steps"] >= 1, shown(lines)  # the overflows were skipped
    assert lines[-1]["loss_scale"] < 2**32, shown(lines)  # and the scale lowered
    exported = json.loads((run / "export" / "config.json").read_text())
    if impl is None:
        return
    assert exported["attention_impl"] == impl, exported
    result = extend_and_evaluate(shared_data, books_data, run / "export", 128, tmp_path)
    assert result["seq_len"] == 128 and math.isfinite(result["loss"]), result
