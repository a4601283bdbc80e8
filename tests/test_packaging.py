"""The packaging contract: torch range, no beam[dill], console scripts, CI command."""

import configparser
from pathlib import Path

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


def test_console_scripts_declared():
    scripts = _cfg()["options.entry_points"]["console_scripts"]
    assert "shatter-data" in scripts and "shatter-extend" in scripts
    assert "shatter-export" in scripts


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
