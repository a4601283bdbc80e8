"""Finetuning on real data (../shared/data/finetune): rotten-tomatoes snippets through `classify`.

A tiny Shatter, randomly initialised (no pretraining in a unit test), with a sentencepiece model
trained here on the snippets, must beat the majority-class rate of the held-out split: the cue
words of a review carry enough signal for a few hundred steps to find.
"""

import bz2
import collections
import csv
import io
import json

import pytest
from click.testing import CliRunner

import shatter
from shatter.pipeline.tokenizer import train
from shatter.train.finetune import main

RT = "finetune/rotten_tomatoes_corpus.csv.bz2"


@pytest.fixture(scope="module")
def rt_export(shared_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    with io.TextIOWrapper(bz2.open(shared_data / RT), encoding="utf-8") as f:
        texts = [row["text"].lower() for row in csv.DictReader(f)]
    lines = [" ".join(t.split()) for t in texts]
    (root / "tokenizer.model").write_bytes(train(lines, 2000))  # the pipeline's special ids
    model = shatter.build_model("shatter-tiny", vocab_size=2000, max_len=64)
    return shatter.save_pretrained(model, root / "export", tokenizer=root / "tokenizer.model")


@pytest.mark.slow
@pytest.mark.shared_data
def test_rotten_tomatoes_beats_the_majority_class(shared_data, rt_export, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main,
        [
            "--task",
            "classify",
            "--checkpoint",
            str(rt_export),
            "--train-file",
            str(shared_data / RT),
            "--text-columns",
            "text",
            "--label-column",
            "category",
            "--labels",
            "fresh,rotten",
            "--output",
            str(out),
            "--max-steps",
            "200",
            "--eval-every",
            "200",
            "--lr",
            "1e-3",
        ],
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped"]["train"] == {
        "label not in ['fresh', 'rotten']": 144
    }  # the 'plot' rows, counted
    predictions = json.loads((out / "predictions.json").read_text())
    with io.TextIOWrapper(bz2.open(shared_data / RT), encoding="utf-8") as f:
        gold = {str(i): row["category"] for i, row in enumerate(csv.DictReader(f))}
    held_out = [gold[i] for i in predictions]
    majority = collections.Counter(held_out).most_common(1)[0][1] / len(held_out)
    accuracy = sum(predictions[i] == gold[i] for i in predictions) / len(predictions)
    assert accuracy == pytest.approx(metrics["best"]["accuracy"])  # the metric is what it claims
    assert accuracy > majority + 0.05, (accuracy, majority)
