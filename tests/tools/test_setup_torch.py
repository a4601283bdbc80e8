"""`make setup`'s torch step: keep a torch in range that runs this machine's GPU, else the CPU
index without a GPU, the cu126 index below compute capability 8.0, the default index above, or
TORCH_INDEX; the range is setup.cfg's."""

import os
import subprocess
import sys
from pathlib import Path

from shatter.tools.setup_torch import (
    CPU_INDEX,
    CPU_VERSION,
    SM70_INDEX,
    plan,
    release,
    source,
    torch_requirement,
)

REPO = Path(__file__).resolve().parents[2]


def test_the_plan_per_machine():
    wanted = torch_requirement()
    assert str(wanted) == "torch<2.15,>=2.4"  # setup.cfg's train extra
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


def test_the_source_said_is_the_one_pip_is_given():
    """The CPU index named only where pip gets it: an unreachable one is left out of the
    arguments, and the line after the one saying so must not name it as the source. The index
    is asked after only where it would be chosen."""
    wanted = torch_requirement()
    cpu = plan(None, wanted, None, gpu=False)
    assert source(None, None, cpu).startswith(CPU_INDEX)
    asked = []
    down = lambda: asked.append(1) or False  # noqa: E731
    unreachable = plan(None, wanted, None, gpu=False, cpu_index_up=down)
    assert unreachable == ["install", f"torch=={CPU_VERSION}"] and asked == [1]
    assert CPU_INDEX not in source(None, None, unreachable)
    assert "pip's own indexes" in source(None, None, unreachable)
    for machine in [("2.12.0", None, False), (None, "default", False), (None, None, True)]:
        installed, index, gpu = machine
        plan(
            installed, wanted, index, gpu=gpu, capability=(9, 0) if gpu else None, cpu_index_up=down
        )
    assert asked == [1], "the CPU index asked after where it is not chosen"


def test_the_installed_torch_is_kept_and_said_so():
    result = subprocess.run(
        [sys.executable, "tools/setup_torch.py"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "is installed and in the project's range torch<2.15,>=2.4: kept" in result.stdout


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


def test_a_gpu_below_sm80_gets_the_cu126_build():
    wanted = torch_requirement()
    cu126 = ["install", "--index-url", SM70_INDEX, str(wanted)]
    assert plan(None, wanted, None, gpu=True, capability=(7, 0)) == cu126
    assert plan(None, wanted, None, gpu=True, capability=(7, 5)) == cu126
    assert plan(None, wanted, None, gpu=True, capability=(8, 0)) == ["install", str(wanted)]
    # an installed build in range is kept only where it runs the GPU: a CPU build runs none, a
    # plain PyPI build (its default CUDA) or cu128 has no sm_70; cu126 and older have
    for installed in ("2.13.0+cpu", "2.13.0", "2.13.0+cu128", "2.13.0+cu130"):
        assert plan(installed, wanted, None, gpu=True, capability=(7, 0)) == cu126, installed
    for installed in ("2.13.0+cu126", "2.6.0+cu124"):
        assert plan(installed, wanted, None, gpu=True, capability=(7, 0)) == [], installed
    assert plan("2.13.0+cpu", wanted, None, gpu=True, capability=(9, 0)) == ["install", str(wanted)]
    assert plan("2.13.0", wanted, None, gpu=True, capability=(9, 0)) == []
    # nvidia-smi too old to report the capability: as a recent GPU; TORCH_INDEX still decides
    assert plan(None, wanted, None, gpu=True, capability=(0, 0)) == ["install", str(wanted)]
    assert plan(None, wanted, "default", gpu=True, capability=(7, 0)) == ["install", str(wanted)]
    # the whole range lies in the releases that still ship cu126 with sm_70 (docs/training.md)
    assert all(op != "<" or release(v) <= (2, 15) for op, v in wanted.clauses)


SMI = """#!/bin/sh
# a stand-in for nvidia-smi on a machine with one GPU of compute capability {cap}
case "$*" in
  *compute_cap*) echo "{cap}" ;;
  *-L*) echo "GPU 0: Stand-in (UUID: GPU-0)" ;;
  *) exit 6 ;;
esac
"""


def _dry_run(tmp_path, cap: str | None, torch_index: str | None = None) -> tuple[str, str]:
    """tools/setup_torch.py --dry-run with a stand-in nvidia-smi reporting `cap` (None: no
    nvidia-smi on PATH), in an interpreter without site-packages (no torch installed), with
    TORCH_INDEX `torch_index`: (the pip command, what it printed)."""
    bin_dir = tmp_path / f"bin-{cap}-{torch_index is not None}"
    bin_dir.mkdir()
    if cap is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(SMI.format(cap=cap))
        smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    env["PATH"] = str(bin_dir)
    if torch_index is not None:
        env["TORCH_INDEX"] = torch_index
    cmd = [sys.executable, "-S", "tools/setup_torch.py", "--dry-run"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("dry run, nothing installed: ") == 1, result.stdout
    return result.stdout.split("dry run, nothing installed: ")[1].strip(), result.stdout


def test_dry_run_names_the_index_for_the_machine(tmp_path):
    """The command a real run would run (a CPU index chosen here that does not answer left
    out, as then), and the source said is the one pip is given: a CPU index named in
    TORCH_INDEX goes to pip, never said to be unreachable on the line before."""
    wanted = str(torch_requirement())
    pip = f"{sys.executable} -m pip install"
    assert _dry_run(tmp_path, "7.0")[0] == f"{pip} --index-url {SM70_INDEX} '{wanted}'"
    assert _dry_run(tmp_path, "9.0")[0] == f"{pip} '{wanted}'"
    command, said = _dry_run(tmp_path, None)  # the CPU index, or pip's own where it is down
    if "is unreachable: left out" in said:
        assert command == f"{pip} torch=={CPU_VERSION}", said
        assert "pip's own indexes" in said and f"from {CPU_INDEX}" not in said, said
    else:
        assert command == f"{pip} --index-url {CPU_INDEX} torch=={CPU_VERSION}", said
    command, said = _dry_run(tmp_path, None, torch_index=CPU_INDEX)
    assert command == f"{pip} --index-url {CPU_INDEX} '{wanted}'", said
    assert f"installing it from {CPU_INDEX};" in said and "unreachable" not in said, said


def test_unknown_arguments_are_refused():
    cmd = [sys.executable, "tools/setup_torch.py", "--dryrun"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "unrecognized arguments: --dryrun" in result.stderr
