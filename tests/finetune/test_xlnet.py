"""xlnet through extension and finetuning: `shatter-extend` to 1024 adds no weights, then every
kind of task finetunes single-stream (classification with both --cls-strategy choices,
regression, MultiRC grouping, SQuAD spans)."""

import json

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.extend_cli import main as extend_main
from shatter.train.finetune import main as finetune_main

from .data import sentiment_rows, squad_json
from .test_finetune import multirc_rows, sts_tsv, write_csv


def run(main, *args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def extended(tmp_path_factory, tokenizer_model):
    root = tmp_path_factory.mktemp("xlnet")
    torch.manual_seed(0)
    model = shatter.build_model("xlnet-tiny", vocab_size=200, max_len=64, hidden=32, ffn=64)
    shatter.save_pretrained(model, root / "export", tokenizer=tokenizer_model)
    result = run(extend_main, root / "export", "--max-len", 1024, "--output", root / "ext")
    assert "total parameters added: 0" in result.output
    long = shatter.from_pretrained(root / "ext")
    assert long.config.max_len == 1024
    ids = torch.randint(5, 200, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(long.encoder(ids), model.eval().encoder(ids), rtol=0, atol=1e-5)
        assert long.encoder(torch.randint(5, 200, (1, 1024))).isfinite().all()
    return root / "ext"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["modified", "cls"])
def test_extended_xlnet_learns_the_synthetic_sentiment(tmp_path, extended, strategy):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(320, seed=0))
    dev = write_csv(tmp_path / "dev.csv", sentiment_rows(80, seed=1))
    out = tmp_path / "run"
    run(
        finetune_main,
        *("--task", "classify", "--checkpoint", extended, "--train-file", train),
        *("--validation-file", dev, "--text-columns", "review", "--label-column", "sentiment"),
        *("--id-column", "id", "--output", out, "--max-steps", 60, "--eval-every", 30),
        *("--lr", 1e-3, "--cls-strategy", strategy),
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["best"]["accuracy"] > 0.8
    best = shatter.from_pretrained(out / "best")
    assert best.config.arch == "xlnet" and best.head_config()["strategy"] == strategy


@pytest.mark.slow
def test_extended_xlnet_finetunes_regression_multirc_and_squad(tmp_path, extended, write_jsonl):
    rows = sentiment_rows(24)
    sts = sts_tsv(tmp_path / "sts.tsv", rows)
    common = ("--checkpoint", extended, "--max-steps", 4, "--lr", 1e-3)
    run(finetune_main, "--task", "stsb", *common, "--train-file", sts, "--validation-file", sts,
        "--output", tmp_path / "sts")  # fmt: skip
    assert json.loads((tmp_path / "sts" / "metrics.json").read_text())["main_metric"] == "spearman"
    mrc = write_jsonl(
        tmp_path / "mrc.jsonl", multirc_rows(rows, passages=6, questions=1, answers=2)
    )
    run(finetune_main, "--task", "multirc", *common, "--train-file", mrc, "--validation-file", mrc,
        "--output", tmp_path / "mrc")  # fmt: skip
    assert len(json.loads((tmp_path / "mrc" / "predictions.json").read_text())) == 12
    squad_train, squad_dev = tmp_path / "train.json", tmp_path / "dev.json"
    squad_train.write_text(json.dumps(squad_json(40, seed=0)))
    squad_dev.write_text(json.dumps(squad_json(10, seed=1)))
    run(finetune_main, "--task", "squad", *common, "--train-file", squad_train,
        "--validation-file", squad_dev, "--output", tmp_path / "squad")  # fmt: skip
    predictions = json.loads((tmp_path / "squad" / "predictions.json").read_text())
    assert set(predictions) == {f"q{i}" for i in range(10)}
