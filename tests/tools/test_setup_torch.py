"""`make setup`'s torch step: keep a torch in range, else the CPU index without a GPU, the
default index with one, or TORCH_INDEX; the range is setup.cfg's."""

import subprocess
import sys
from pathlib import Path

from shatter.tools.setup_torch import CPU_INDEX, CPU_VERSION, plan, torch_requirement

REPO = Path(__file__).resolve().parents[2]


def test_the_plan_per_machine():
    wanted = torch_requirement()
    assert str(wanted) == "torch<2.15,>=2.2"  # setup.cfg's train extra
    assert plan("2.12.0", wanted, None, gpu=False) == []  # in range: kept, never replaced
    assert plan("2.13.0+cpu", wanted, "https://example.org/cu126", gpu=True) == []
    assert wanted.contains(CPU_VERSION) and not wanted.contains("2.15.0")
    assert wanted.contains("2.13.0+cpu") and not wanted.contains("2.1.9")
    cpu = ["install", "--index-url", CPU_INDEX, f"torch=={CPU_VERSION}"]
    assert plan(None, wanted, None, gpu=False) == cpu
    assert plan("2.1.0", wanted, None, gpu=True) == ["install", str(wanted)]
    assert plan(None, wanted, "default", gpu=False) == ["install", str(wanted)]
    custom = plan("2.16.0", wanted, "https://example.org/cu126", gpu=False)
    assert custom == ["install", "--index-url", "https://example.org/cu126", str(wanted)]


def test_the_installed_torch_is_kept_and_said_so():
    result = subprocess.run(
        [sys.executable, "tools/setup_torch.py"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "is installed and in the project's range torch<2.15,>=2.2: kept" in result.stdout


def test_make_setup_runs_it_first_and_prints_its_steps():
    dry = subprocess.run(
        ["make", "-n", "-B", "setup", "VENV=/nonexistent-venv"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = dry.stdout.splitlines()
    torch_step = lines.index("/nonexistent-venv/bin/python tools/setup_torch.py")
    install = next(i for i, line in enumerate(lines) if "pip install" in line and " -e " in line)
    assert torch_step < install and " -q" not in dry.stdout
    assert "-c constraints.txt" in lines[install]  # the tested versions, no fresh resolve
