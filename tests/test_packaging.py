"""The packaging contract: torch range, no beam[dill], console scripts, CI command."""

import configparser
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def _cfg():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _requirements(section="options", key="install_requires"):
    lines = _cfg()[section][key].splitlines()
    return [
        Requirement(line)
        for line in (s.strip() for s in lines)
        if line and not line.startswith("#")
    ]


def _train_requirements():
    return _requirements("options.extras_require", "train")


def test_torch_range_admits_the_local_cpu_wheel():
    torch_req = next(r for r in _train_requirements() if r.name == "torch")
    assert torch_req.specifier, "a bare torch requirement can pull a multi-GB CUDA build"
    assert torch_req.specifier.contains("2.13.0")


def test_beam_without_dill_extra():
    beam = next(
        r for r in _requirements("options.extras_require", "pipeline") if r.name == "apache-beam"
    )
    assert "dill" not in beam.extras, "apache-beam[dill] conflicts with datasets"


def _console_scripts() -> dict[str, str]:
    lines = _cfg()["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(line.replace(" ", "").split("=") for line in lines)


def test_console_scripts_declared():
    scripts = _console_scripts()
    for name in ("data", "extend", "export", "evaluate", "glue", "plot-metrics", "config-cost"):
        assert f"shatter-{name}" in scripts


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_console_scripts()))
def test_every_command_answers_h_and_version(name):
    """`-h` beside `--help`, and `--version` naming the installed distribution's version (the
    installed script, in a process of its own: some commands end theirs with os._exit)."""
    script = Path(sys.executable).parent / name
    version = importlib.metadata.version("shatter-toolkit")
    for flag, expect in (("-h", "sage: "), ("--version", f"{name}, version {version}")):
        done = subprocess.run([script, flag], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and expect in done.stdout, (flag, done.stdout, done.stderr)


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO / ".ci" / "run").read_text()
    assert "make test" in (REPO / "README.md").read_text()


def test_pipeline_workers_install_no_training_stack():
    """Beam workers install the core (`--setup_file`) on their Beam (the `pipeline` extra): torch
    and deepspeed are the `train` extra, Beam is not in the core that training nodes install."""
    core = {r.name for r in _requirements()}
    assert {"sentencepiece", "pyarrow", "mwparserfromhell", "fsspec"} <= core
    assert not core & {"torch", "deepspeed", "datasets", "apache-beam"}
    assert "apache-beam" in {r.name for r in _requirements("options.extras_require", "pipeline")}
    assert {"torch", "deepspeed", "datasets"} <= {r.name for r in _train_requirements()}
    for path in (REPO / "pipeline").glob("*.py"):  # and the pipeline imports none of it
        text = path.read_text()
        assert "import torch" not in text and "import deepspeed" not in text, path
