"""The GPU lane of finetuning (`make test-gpu`): the real CLI under the deepspeed launcher on one
CUDA device, classify and squad; exit 0 within 30 s of the last line, finite losses. On CPU
ranks in the lane's rehearsal (tests/lane.py), else skipped without CUDA."""

import json
import math
import sys
from pathlib import Path

import pytest

from tests.jobs import Job, finish_soon, free_port
from tests.lane import lane, precisions

from .data import sentiment_rows, squad_json
from .test_finetune import write_csv

pytestmark = lane

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def finetune(*args) -> list[str]:
    script = str(REPO / "train" / "finetune.py")
    launcher = [str(BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port())]
    return [*launcher, script, *map(str, args)]


def check(out: Path, text: str) -> dict:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "split" not in x]
    assert losses and all(x is not None and math.isfinite(x) for x in losses), text[-3000:]
    assert "results in" in text
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("precision", precisions("bf16", "fp16"))
def test_classify_on_a_gpu(tmp_path, export, precision):  # noqa: F811
    train = write_csv(tmp_path / "train.csv", sentiment_rows(320, seed=0))
    dev = write_csv(tmp_path / "dev.csv", sentiment_rows(80, seed=1))
    out = tmp_path / "run"
    cmd = finetune(
        "--task", "classify", "--checkpoint", export(), "--train-file", train,
        "--validation-file", dev, "--text-columns", "review", "--label-column", "sentiment",
        "--id-column", "id", "--output", out, "--max-steps", 60, "--eval-every", 30,
        "--lr", 1e-3, "--precision", precision,
    )  # fmt: skip
    metrics = check(out, finish_soon(Job(cmd), timeout=300))
    assert metrics["final"]["step"] == 60


def test_squad_on_a_gpu(tmp_path, export):  # noqa: F811
    train, dev = tmp_path / "train.json", tmp_path / "dev.json"
    train.write_text(json.dumps(squad_json(120, seed=0)))
    dev.write_text(json.dumps(squad_json(30, seed=1)))
    out = tmp_path / "run"
    cmd = finetune(
        "--task", "squad", "--checkpoint", export("bert", max_len=64), "--train-file", train,
        "--validation-file", dev, "--output", out, "--max-steps", 20, "--eval-every", 10,
        "--lr", 1e-3, "--doc-stride", 24, "--precision", "bf16",
    )  # fmt: skip
    metrics = check(out, finish_soon(Job(cmd), timeout=300))
    assert 0 <= metrics["best"]["exact_match"] <= metrics["best"]["f1"] <= 100
