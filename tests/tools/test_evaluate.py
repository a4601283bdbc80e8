"""train/evaluate_cli.py's command line: several --data in one call pair with their --output in order."""

import torch
from click.testing import CliRunner

from shatter.train.evaluate import default_device
from shatter.train.evaluate_cli import main


def test_outputs_must_pair_with_the_datasets(tmp_path):
    """One --output per --data (or none): a count that differs is a usage error, before any work."""
    args = ["--checkpoint", tmp_path / "export", "--data", tmp_path / "a", "--data", tmp_path / "b"]
    done = CliRunner().invoke(main, [str(a) for a in [*args, "--output", tmp_path / "r.json"]])
    assert done.exit_code == 2, done.output
    assert "1 --output for 2 --data: give one --output per --data" in done.output
    assert not any(tmp_path.iterdir())


def test_the_evaluation_runs_on_a_gpu_when_there_is_one(monkeypatch):
    """train/evaluate_cli.py moves the export to `default_device()` and evaluates where it lies (its
    JSON names the device; the GPU lane checks it is cuda there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == torch.device("cuda")
