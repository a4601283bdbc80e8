"""A finetune that learned nothing says so: a 3-class CSV on a tiny model at the paper's
base-size lr (1e-5) stays at the majority class and warns, with per-class precision and recall
and a confusion matrix in metrics.json; with the defaults (an lr scaled to the model's width)
the same model learns the task."""

import json
import random

import pytest

from shatter.train.finetuning.config import scaled_lr

from .data import FILLER, NEGATIVE, POSITIVE
from .test_finetune import run, write_csv

NEUTRAL = "film movie plot story".split()  # the third class: no cue word at all


def three_class_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = (("neg",) * 5 + ("pos",) * 3 + ("neutral",) * 2)[i % 10]  # majority: half
        cue = {"neg": NEGATIVE, "pos": POSITIVE, "neutral": NEUTRAL}[label]
        words = [rng.choice(FILLER) for _ in range(6)] + [rng.choice(cue) for _ in range(3)]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def _finetune(tmp_path, export, *extra) -> tuple[dict, str]:
    train = write_csv(tmp_path / "train.csv", three_class_rows(240, seed=0))
    out = tmp_path / ("run" + "".join(str(x) for x in extra))
    result = run(
        "--task", "classify", "--checkpoint", export(), "--train-file", train,
        "--text-columns", "text", "--label-column", "label", "--output", out,
        *extra,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads((out / "metrics.json").read_text()), result.output


@pytest.mark.slow
def test_a_tiny_model_that_learns_nothing_warns_and_the_defaults_learn(tmp_path, export):
    # 1e-7, far below even the base size's 1e-5 (at which this tiny model sometimes moved a little,
    # by the RNG state a shared pytest-xdist worker leaves): nothing is learned in 41 steps
    metrics, output = _finetune(tmp_path, export, "--lr", "1e-7")
    best = metrics["best"]
    print(
        f"lr 1e-7: best accuracy {best['accuracy']:.3f}, majority {best['majority_accuracy']:.3f}"
    )
    assert "learned nothing" in output and metrics["warnings"][0] in output
    assert best["accuracy"] <= best["majority_accuracy"]
    assert set(best["per_class"]) == {"neg", "neutral", "pos"}
    assert sum(v["support"] for v in best["per_class"].values()) == 24  # 10% held out
    confusion = best["confusion"]
    assert len(confusion) == 3 and sum(map(sum, confusion)) == 24
    assert [v["predicted"] for v in best["per_class"].values()].count(0) >= 1

    metrics, output = _finetune(tmp_path, export)  # the defaults: 3 epochs, the scaled lr
    best = metrics["best"]
    print(f"defaults (lr {scaled_lr(1e-5, 32):g}): best accuracy {best['accuracy']:.3f}")
    assert "learned nothing" not in output and "warnings" not in metrics
    assert best["accuracy"] > best["majority_accuracy"] + 0.2


def test_the_default_lr_rule():
    assert scaled_lr(1e-5, 768) == 1e-5 and scaled_lr(5e-6, 1024) == 5e-6  # the paper's, §4.2
    assert scaled_lr(1e-5, 256) == pytest.approx(9e-5)
    assert scaled_lr(1e-5, 64) == 1e-3  # capped
