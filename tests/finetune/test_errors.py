"""Every wrong input to `train/finetune.py` ends with exit 1 and one line naming the file and the
cause; nothing is written under --output."""

import json

import pytest
import torch

from .data import sentiment_rows, squad_json
from .test_finetune import run, write_csv


def one_line_error(result, *parts):
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()  # progress bars may come before it
    errors = [line for line in lines if "Error" in line or "Traceback" in line]
    assert errors == [lines[-1]] and lines[-1].startswith("Error: "), result.output
    for part in parts:
        assert str(part) in lines[-1], lines[-1]
    return lines[-1]


def classify(checkpoint, train, validation, out):
    return run(
        "--task", "classify", "--text-columns", "review", "--label-column", "sentiment",
        "--checkpoint", checkpoint, "--train-file", train, "--validation-file", validation,
        "--output", out, "--max-steps", 1,
    )  # fmt: skip


@pytest.fixture
def good_csv(tmp_path):
    return write_csv(tmp_path / "good.csv", sentiment_rows(8))


def test_each_wrong_checkpoint_directory_gets_its_own_message(tmp_path, export, good_csv):  # noqa: F811
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step00000002\n")
    torch.save(
        {"module": {}}, run_dir / "checkpoints" / "step00000002" / "mp_rank_00_model_states.pt"
    )
    (run_dir / "metrics.jsonl").write_text("")
    other = tmp_path / "other"
    other.mkdir()
    out = tmp_path / "ft"
    cases = {
        tmp_path / "missing": "no such directory",
        run_dir: "is a training run directory without an export yet",
        run_dir / "checkpoints": "is a DeepSpeed checkpoint, not an export",
        other: "is not a shatter export (it needs model.safetensors and config.json)",
    }
    messages = {
        one_line_error(classify(d, good_csv, good_csv, out), d, why) for d, why in cases.items()
    }
    assert len(messages) == 4 and not out.exists()
    # once the run has an export, both the run directory and its checkpoints point at it
    exported = export()
    exported.rename(run_dir / "export")
    one_line_error(classify(run_dir, good_csv, good_csv, out), f"--checkpoint {run_dir / 'export'}")
    one_line_error(classify(run_dir / "checkpoints", good_csv, good_csv, out), run_dir / "export")


def test_corrupted_weights_are_refused_naming_the_file(tmp_path, export, good_csv, flip_weights):  # noqa: F811
    path = export()
    weights = flip_weights(path)
    out = tmp_path / "ft"
    one_line_error(classify(path, good_csv, good_csv, out), weights, "corrupted", "checksums.json")
    assert not out.exists()


@pytest.mark.parametrize(
    "name, content, cause",
    [
        ("empty.csv", "", "the file is empty"),
        ("header.csv", "review,sentiment\n", "only a header line"),
    ],
)
def test_empty_and_header_only_csv_name_the_file_and_cause(
    tmp_path,
    export,  # noqa: F811
    good_csv,
    name,
    content,
    cause,
):
    bad = tmp_path / name
    bad.write_text(content)
    out = tmp_path / "ft"
    one_line_error(classify(export(), bad, good_csv, out), bad, cause)
    one_line_error(classify(export(), good_csv, bad, out), bad, cause)
    assert not out.exists()


def test_truncated_squad_json_names_the_parse_position(tmp_path, export):  # noqa: F811
    text = json.dumps(squad_json(4))
    bad = tmp_path / "train.json"
    bad.write_text(text[: len(text) // 2])
    out = tmp_path / "ft"
    result = run(
        "--task", "squad", "--checkpoint", export(), "--train-file", bad,
        "--validation-file", bad, "--output", out, "--max-steps", 1,
    )  # fmt: skip
    line = one_line_error(result, bad, "not valid JSON at line 1 column", "truncated")
    assert "(character " in line and not out.exists()


def test_an_output_under_a_regular_file_is_refused_before_any_work(tmp_path, export, good_csv):  # noqa: F811
    afile = tmp_path / "afile"
    afile.write_text("keep")
    one_line_error(
        classify(export(), good_csv, good_csv, afile / "run"), f"under {afile}, which is a file"
    )
    assert afile.read_text() == "keep"


def test_float_labels_without_regression_stop_with_a_hint_at_it(tmp_path, export, good_csv):  # noqa: F811
    """A score column (every label a distinct float) read as classes: one line naming the file
    and --regression, before any training; a few numeric classes (1-5 stars) stay classes."""
    rows = [{**r, "sentiment": f"{i * 0.37:.2f}"} for i, r in enumerate(sentiment_rows(30))]
    scores = write_csv(tmp_path / "scores.csv", rows)
    out = tmp_path / "ft"
    line = one_line_error(classify(export(), scores, good_csv, out), scores, "--regression")
    assert "30 labels all read as numbers" in line and len(line) < 400, line
    assert not out.exists()
    stars = [{**r, "sentiment": str(1 + i % 5)} for i, r in enumerate(sentiment_rows(30))]
    stars_csv = write_csv(tmp_path / "stars.csv", stars)
    done = classify(export(), stars_csv, stars_csv, out)
    assert done.exit_code == 0, done.output
