"""tools/evaluate.py's command line: several --data in one call pair with their --output in order."""

from click.testing import CliRunner

from tools.evaluate import main


def test_outputs_must_pair_with_the_datasets(tmp_path):
    """One --output per --data (or none): a count that differs is a usage error, before any work."""
    args = ["--checkpoint", tmp_path / "export", "--data", tmp_path / "a", "--data", tmp_path / "b"]
    done = CliRunner().invoke(main, [str(a) for a in [*args, "--output", tmp_path / "r.json"]])
    assert done.exit_code == 2, done.output
    assert "1 --output for 2 --data: give one --output per --data" in done.output
    assert not any(tmp_path.iterdir())
