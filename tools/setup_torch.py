"""`make setup`'s first step: torch, installed right for this machine before the rest of the project.

- A torch already installed in the project's range (setup.cfg's `train` extra) is kept.
- Otherwise `TORCH_INDEX` (an environment variable) says where pip gets it: a URL (e.g.
  https://download.pytorch.org/whl/cu126), or `default` for pip's own configured indexes and
  wheelhouses. Unset, it is PyTorch's CPU index on a machine without an NVIDIA GPU (no working
  `nvidia-smi`), so pip never pulls the multi-GB CUDA build there, and `default` (PyPI's CUDA
  build) on one.
- From the CPU index it installs `torch==CPU_VERSION` (the version the suite runs on), not the
  range: pip's configured find-links and extra indexes still apply, and a newer CUDA build on one
  of them would win the range. `==2.13.0` matches the CPU index's `2.13.0+cpu`, which pip prefers
  to a plain `2.13.0`; so a machine with a local CPU wheel and no route to the index installs
  that wheel (after pip's warnings about the index).

Standard library and pip only: it runs in the bare venv, before anything else is installed.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_VERSION = "2.13.0"  # in the range of setup.cfg (tests/tools/test_setup_torch.py checks it)


def torch_requirement(setup_cfg: Path = REPO / "setup.cfg") -> Requirement:
    """The torch line of setup.cfg's `train` extra (its one source of truth)."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    for line in cfg["options.extras_require"]["train"].splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name == "torch":
            return Requirement(line)
    raise SystemExit(f"make setup: {setup_cfg} has no torch requirement in its train extra")


def has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    result = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return result.returncode == 0 and "GPU" in result.stdout


def plan(installed: str | None, wanted: Requirement, index: str | None, gpu: bool) -> list[str]:
    """The pip arguments that install torch, or [] to keep the installed one."""
    if installed is not None and wanted.specifier.contains(installed, prereleases=True):
        return []
    if index is None and not gpu:
        return ["install", "--index-url", CPU_INDEX, f"torch=={CPU_VERSION}"]
    where = [] if index in (None, "default") else ["--index-url", index]
    return ["install", *where, str(wanted)]


def main() -> int:
    wanted = torch_requirement()
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    index, gpu = os.environ.get("TORCH_INDEX") or None, has_nvidia_gpu()
    args = plan(installed, wanted, index, gpu)
    if not args:
        print(f"==> torch {installed} is installed and in the project's range {wanted}: kept")
        return 0
    why = f"torch {installed} is outside {wanted}" if installed else "no torch installed"
    source = index or (
        "pip's default index (an NVIDIA GPU is present: the CUDA build)"
        if gpu
        else f"{CPU_INDEX} (no NVIDIA GPU: the CPU build of {CPU_VERSION})"
    )
    print(f"==> {why}: installing it from {source}; TORCH_INDEX=URL picks another", flush=True)
    result = subprocess.run([sys.executable, "-m", "pip", *args])
    if result.returncode != 0:
        print(
            f"make setup: installing {wanted} failed (pip exit {result.returncode}, its output is "
            "above); set TORCH_INDEX=URL (or TORCH_INDEX=default) or install torch into the venv "
            "first",
            file=sys.stderr,
        )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
