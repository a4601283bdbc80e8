"""`shatter-evaluate --seq-len`: one build serves every length at evaluation as in training (the
rows cut as the trainer cuts them); a length the rows or the model cannot take is one line."""

import json

import pytest
from click.testing import CliRunner

import shatter
from shatter.pipeline.build import build
from shatter.pipeline.config import InputSpec
from shatter.train.evaluate_cli import main as evaluate
from tests.pipeline.conftest import generated_documents, quiet, small_config


@pytest.fixture(scope="module")
def data_and_export(tmp_path_factory):
    """Rows of 64 (a small generated corpus) and a model of max_len 32 with their tokenizer."""
    root = tmp_path_factory.mktemp("evaluate-seq-len")
    (root / "corpus.txt").write_text("\n\n".join(generated_documents(150, seed=2)) + "\n")
    data = root / "data"
    build(small_config([InputSpec("text", str(root / "corpus.txt"))], data), [], report=quiet)
    model = shatter.build_model("shatter-tiny", vocab_size=300, max_len=32)
    export = shatter.save_pretrained(model, root / "export", tokenizer=data / "tokenizer.model")
    return data, export


def run(*args):
    return CliRunner().invoke(evaluate, [str(a) for a in args])


def test_evaluate_cuts_rows_to_seq_len_and_refuses_what_does_not_fit(data_and_export, tmp_path):
    data, export = data_and_export
    too_long = run("--checkpoint", export, "--data", data)
    assert too_long.exit_code == 1 and "--seq-len 32" in too_long.output, too_long.output
    out = tmp_path / "r.json"
    done = run("--checkpoint", export, "--data", data, "--seq-len", 32, "--output", out)
    assert done.exit_code == 0, done.output
    result = json.loads(out.read_text())
    assert result["seq_len"] == 32 and result["predictions"] > 0 and "(l=32" in done.output
    longer = run("--checkpoint", export, "--data", data, "--seq-len", 128)
    assert longer.exit_code == 1 and "longer than the rows" in longer.output, longer.output
