"""A few-step finetune end to end, on task files the tests write, through the command line."""

import csv
import json

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.train.finetune import main

from .data import sentiment_rows, squad_json


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def multirc_rows(rows, passages: int, questions: int, answers: int) -> list[dict]:
    """MultiRC (SuperGLUE JSONL): answer a of passage p is right when p + a is odd."""
    return [
        {
            "idx": p,
            "passage": {
                "text": rows[p]["review"],
                "questions": [
                    {
                        "idx": q,
                        "question": "is it good?",
                        "answers": [
                            {"idx": a, "text": rows[p + q + a]["review"], "label": (p + a) % 2}
                            for a in range(answers)
                        ],
                    }
                    for q in range(questions)
                ],
            },
        }
        for p in range(passages)
    ]


def sts_tsv(path, rows):
    """An STS-B file (GLUE's columns) pairing each review with the one before it, scores 0..5."""
    path.write_text(
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
        + "".join(
            f"{i}\tg\tf\ty\to\ts\ts\t{r['review']}\t{rows[i - 1]['review']}\t{i % 6}.000\n"
            for i, r in enumerate(rows)
        )
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["modified", "cls"])
def test_classify_learns_the_synthetic_sentiment(tmp_path, export, strategy):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(320, seed=0))
    dev = write_csv(tmp_path / "dev.csv", sentiment_rows(80, seed=1))
    out = tmp_path / "run"
    result = run(
        "--task",
        "classify",
        "--checkpoint",
        export(),
        "--train-file",
        train,
        "--validation-file",
        dev,
        "--text-columns",
        "review",
        "--label-column",
        "sentiment",
        "--id-column",
        "id",
        "--output",
        out,
        "--max-steps",
        60,
        "--eval-every",
        30,
        "--lr",
        1e-3,
        "--cls-strategy",
        strategy,
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evaluations"]] == [30, 60]
    assert metrics["final"]["step"] == 60
    assert metrics["best"]["accuracy"] == max(e["accuracy"] for e in metrics["evaluations"])
    assert metrics["best"]["accuracy"] > 0.8  # the cue words decide the label
    predictions = json.loads((out / "predictions.json").read_text())
    assert set(predictions) == {f"r{i}" for i in range(80)} and set(predictions.values()) <= {
        "pos",
        "neg",
    }
    best = shatter.from_pretrained(out / "best")
    assert best.head_config()["strategy"] == strategy
    assert (out / "best" / "tokenizer.model").is_file() and list((out / "tensorboard").iterdir())


@pytest.mark.slow
def test_squad_runs_and_writes_official_predictions(tmp_path, export):
    train, dev = tmp_path / "train.json", tmp_path / "dev.json"
    train.write_text(json.dumps(squad_json(120, seed=0)))
    dev.write_text(json.dumps(squad_json(30, seed=1)))
    out = tmp_path / "run"
    result = run(
        "--task",
        "squad",
        "--checkpoint",
        export("bert", max_len=64),
        "--train-file",
        train,
        "--validation-file",
        dev,
        "--output",
        out,
        "--max-steps",
        20,
        "--eval-every",
        10,
        "--lr",
        1e-3,
        "--doc-stride",
        24,
    )
    assert result.exit_code == 0, result.output
    # progress named for the task (no stray "pretrain" one); piped, as here, plain lines: no bar
    # redrawn with carriage returns (the evaluation's, datasets' "Generating train split")
    assert "finetune squad" in result.output and "pretrain" not in result.output
    assert "\r" not in result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["validation_features"] > 30  # long contexts became several windows
    predictions = json.loads((out / "predictions.json").read_text())
    assert set(predictions) == {f"q{i}" for i in range(30)}
    contexts = {
        p["qas"][0]["id"]: p["context"] for p in squad_json(30, seed=1)["data"][0]["paragraphs"]
    }
    assert all(
        answer in contexts[qid] for qid, answer in predictions.items()
    )  # spans of the context
    assert 0 <= metrics["best"]["exact_match"] <= metrics["best"]["f1"] <= 100


def test_refuses_a_length_beyond_the_checkpoint(tmp_path, export):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(20))
    result = run(
        "--task",
        "classify",
        "--checkpoint",
        export(max_len=32),
        "--train-file",
        train,
        "--text-columns",
        "review",
        "--label-column",
        "sentiment",
        "--output",
        tmp_path / "run",
        "--max-len",
        128,
    )
    assert (
        result.exit_code != 0
        and "shatter-extend" in result.output
        and "Traceback" not in result.output
    )


@pytest.mark.slow
def test_a_diverged_finetuning_stops_with_one_line(tmp_path, export):
    """The pretraining loop's step guard: an lr that overflows the weights makes every loss
    NaN/inf; each step is skipped and counted, and `run.max_nonfinite` in a row end the run."""
    train = write_csv(tmp_path / "train.csv", sentiment_rows(20))
    config = tmp_path / "ft.yaml"
    config.write_text("run:\n  max_nonfinite: 2\n")
    result = run(
        "--task", "classify", "--checkpoint", export(), "--train-file", train,
        "--text-columns", "review", "--label-column", "sentiment", "--output", tmp_path / "run",
        "--max-steps", 8, "--eval-every", 8, "--lr", 1e38, "--batch-size", 4,
        "--config", config,
    )  # fmt: skip
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "has diverged; lower --lr" in result.output, result.output


def test_names_the_file_with_a_missing_column(tmp_path, export):
    train = write_csv(tmp_path / "train.csv", sentiment_rows(20))
    result = run(
        "--task",
        "classify",
        "--checkpoint",
        export(),
        "--train-file",
        train,
        "--text-columns",
        "body",
        "--label-column",
        "sentiment",
        "--output",
        tmp_path / "run",
    )
    assert (
        result.exit_code != 0 and "train.csv" in result.output and "missing column" in result.output
    )


@pytest.mark.slow
def test_regression_and_multirc_grouping(tmp_path, export, write_jsonl):
    rows = sentiment_rows(48)
    sts = sts_tsv(tmp_path / "sts.tsv", rows)
    result = run(
        "--task",
        "stsb",
        "--checkpoint",
        export(),
        "--train-file",
        sts,
        "--validation-file",
        sts,
        "--output",
        tmp_path / "sts",
        "--max-steps",
        4,
        "--lr",
        1e-3,
        "--precision",
        "bf16",
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "sts" / "metrics.json").read_text())
    assert metrics["main_metric"] == "spearman" and {"pearson", "spearman"} <= set(metrics["best"])
    best = metrics["best"]
    assert best["mean_spearman"] == 0.0  # always the training mean: a constant, no correlation
    assert ("warnings" in metrics) == (best["spearman"] <= 0.1), metrics.get("warnings")
    config = json.loads((tmp_path / "sts" / "config.json").read_text())
    assert config["deepspeed"]["zero_optimization"]["stage"] == 1  # bf16's default stage
    weights = shatter.from_pretrained(tmp_path / "sts" / "best").state_dict().values()
    # the best model holds the fp32 masters, not the bf16 module weights widened to fp32
    finer = [not torch.equal(w, w.bfloat16().float()) for w in weights if w.is_floating_point()]
    assert sum(finer) > len(finer) // 2, finer
    predictions = json.loads((tmp_path / "sts" / "predictions.json").read_text())
    assert len(predictions) == 48 and all(isinstance(v, float) for v in predictions.values())

    mrc = write_jsonl(
        tmp_path / "mrc.jsonl",
        multirc_rows(rows, passages=8, questions=2, answers=3),
    )
    result = run(
        "--task",
        "multirc",
        "--checkpoint",
        export(),
        "--train-file",
        mrc,
        "--validation-file",
        mrc,
        "--output",
        tmp_path / "mrc",
        "--max-steps",
        4,
        "--lr",
        1e-3,
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((tmp_path / "mrc" / "metrics.json").read_text())
    predictions = json.loads((tmp_path / "mrc" / "predictions.json").read_text())
    assert metrics["main_metric"] == "f1a" and len(predictions) == 48
    # EM recomputed from the predictions: a question counts only if all three options are right.
    gold = {f"{p}-{q}-{a}": str((p + a) % 2) for p in range(8) for q in range(2) for a in range(3)}
    em = (
        sum(
            all(predictions[f"{p}-{q}-{a}"] == gold[f"{p}-{q}-{a}"] for a in range(3))
            for p in range(8)
            for q in range(2)
        )
        / 16
    )
    assert metrics["best"]["em"] == pytest.approx(em)


@pytest.mark.parametrize("n,batch,world", [(10, 4, 2), (3, 8, 4), (7, 7, 1)])
def test_global_batches_cut_one_stream_of_epoch_permutations(n, batch, world):
    """Ranks split every global batch without overlap; the global batches, concatenated, are the
    permutations of (seed, epoch 0), (seed, epoch 1), ... back to back (batches straddle epochs)."""
    import itertools

    import numpy as np

    from shatter.train.finetuning.loop import global_batches

    steps = 3 * n // batch + 3
    per_rank = [
        list(itertools.islice(global_batches(n, batch, 5, r, world), steps)) for r in range(world)
    ]
    stream = []
    for step in range(steps):
        shares = [per_rank[r][step] for r in range(world)]
        assert all(len(s) == batch // world for s in shares)
        merged = [None] * batch
        for r, share in enumerate(shares):
            merged[r::world] = share
        stream += merged
    epochs = np.concatenate(
        [np.random.default_rng([5, e]).permutation(n) for e in range(len(stream) // n + 1)]
    )
    assert stream == epochs[: len(stream)].tolist()
    for e in range(len(stream) // n):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
