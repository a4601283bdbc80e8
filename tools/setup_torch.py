"""`make setup`'s first step: torch, installed right for this machine before the rest of the project.

- A torch already installed in the project's range (setup.cfg's `train` extra) is kept, unless
  its build cannot run this machine's GPU: a `+cpu` build on a machine with an NVIDIA GPU, or, on
  a GPU below compute capability 8.0 (V100: sm_70), a build other than `+cu126` or older (PyPI's
  default CUDA builds of torch 2.11 on carry no sm_70 kernels; docs/training.md has the table).
- Otherwise `TORCH_INDEX` (an environment variable) says where pip gets it: a URL (e.g.
  https://download.pytorch.org/whl/cu126), or `default` for pip's own configured indexes and
  wheelhouses. Unset, it is PyTorch's CPU index on a machine without an NVIDIA GPU (no working
  `nvidia-smi`), so pip never pulls the multi-GB CUDA build there; PyTorch's `cu126` index where
  `nvidia-smi --query-gpu=compute_cap` reports a GPU below 8.0 (the last CUDA build with sm_70);
  and `default` (PyPI's CUDA build) on newer GPUs.
- `--dry-run` prints the pip command it would run and installs nothing.
- A CPU index chosen here that does not answer is left out (pip would retry it for minutes): torch
  then comes from pip's own indexes and find-links, and the log says so. An index the user named
  in `TORCH_INDEX` is always passed to pip.
- From the CPU index it installs `torch==CPU_VERSION` (the version the suite runs on), not the
  range: pip's configured find-links and extra indexes still apply, and a newer CUDA build on one
  of them would win the range. `==2.13.0` matches the CPU index's `2.13.0+cpu`, which pip prefers
  to a plain `2.13.0`; so a machine with a local CPU wheel and no route to the index installs
  that wheel (after pip's warnings about the index).

Standard library only (not pip's private vendored packages): it runs in the bare venv, before
anything else is installed. The torch line is a plain range (`torch>=A,<B`, clauses of >=, >, <=,
<, ==, !=), which `Range` reads; pip itself checks the full grammar when it installs.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_VERSION = "2.13.0"  # in the range of setup.cfg (tests/tools/test_setup_torch.py checks it)
SM70_INDEX = "https://download.pytorch.org/whl/cu126"  # the last CUDA build with sm_70 kernels
SM70_CUDA = 126  # +cuXYZ builds up to this one carry sm_70 (docs/training.md)
MODERN = (8, 0)  # GPUs from this compute capability on run PyPI's default CUDA build


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: "2.13.0+cpu" and "2.13.0rc1" give (2, 13, 0)."""
    head = re.match(r"\d+(\.\d+)*", version.strip())
    if head is None:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in head.group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()  # 2.13.0 == 2.13
    return tuple(parts)


_COMPARE = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


@dataclass(frozen=True)
class Range:
    """A requirement line such as `torch>=2.2,<2.15`: a name and version clauses."""

    name: str
    clauses: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, line: str) -> Range:
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*(.*?)\s*", line)
        clauses = []
        for part in filter(None, (c.strip() for c in m.group(2).split(","))):
            op = next((o for o in (">=", "<=", "==", "!=", ">", "<") if part.startswith(o)), None)
            if op is None:
                raise ValueError(f"unsupported requirement clause {part!r} in {line!r}")
            clauses.append((op, part[len(op) :].strip()))
        return cls(m.group(1).lower(), tuple(sorted(clauses, key=lambda c: c[0])))

    def contains(self, version: str) -> bool:
        return all(_COMPARE[op](release(version), release(v)) for op, v in self.clauses)

    def __str__(self) -> str:
        return self.name + ",".join(op + v for op, v in self.clauses)


def torch_requirement(setup_cfg: Path = REPO / "setup.cfg") -> Range:
    """The torch line of setup.cfg's `train` extra (its one source of truth)."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    for line in cfg["options.extras_require"]["train"].splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if line and Range.parse(line).name == "torch":
            return Range.parse(line)
    raise SystemExit(f"make setup: {setup_cfg} has no torch requirement in its train extra")


def _smi(*args: str) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    result = subprocess.run([smi, *args], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None


def gpu_capability() -> tuple[int, int] | None:
    """The lowest compute capability of this machine's NVIDIA GPUs, (0, 0) for GPUs whose
    `nvidia-smi` cannot say (drivers before the `compute_cap` query: treated as recent), None
    without a working `nvidia-smi` or GPU."""
    caps = []
    for line in (_smi("--query-gpu=compute_cap", "--format=csv,noheader") or "").splitlines():
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", line)
        if m:
            caps.append((int(m.group(1)), int(m.group(2))))
    if caps:
        return min(caps)
    return (0, 0) if "GPU" in (_smi("-L") or "") else None


def old_gpu(capability: tuple[int, int] | None) -> bool:
    """A GPU below sm_80 whose capability is known: only `cu126` (and older) builds run it."""
    return capability is not None and capability != (0, 0) and capability < MODERN


def runs_here(installed: str, capability: tuple[int, int] | None) -> bool:
    """Whether the installed build can run this machine's GPU, by its local label: `+cpu` runs
    no GPU; below sm_80 only `+cuXYZ` up to `+cu126` carry sm_70 (a plain PyPI version is its
    default CUDA build, which from torch 2.11 on has none)."""
    label = installed.partition("+")[2].lower()
    if capability is None:
        return True
    if label == "cpu":
        return False
    if old_gpu(capability):
        cuda = re.fullmatch(r"cu(\d+)", label)
        return cuda is not None and int(cuda.group(1)) <= SM70_CUDA
    return True


def plan(
    installed: str | None,
    wanted: Range,
    index: str | None,
    gpu: bool,
    capability: tuple[int, int] | None = None,
    cpu_index_up: Callable[[], bool] = lambda: True,
) -> list[str]:
    """The pip arguments that install torch, or [] to keep the installed one. `capability`:
    the GPU's compute capability when `gpu` (gpu_capability); `cpu_index_up`: asked only where
    the CPU index would be chosen (no GPU, no TORCH_INDEX), whether it answers: pip retries an
    unreachable index for every package it resolves, so then torch comes from pip's own indexes
    and find-links (a local wheel of it, where one is there)."""
    fits = installed is not None and wanted.contains(installed)
    if fits and (index is not None or runs_here(installed, capability if gpu else None)):
        return []
    if index is None and not gpu:
        if not cpu_index_up():
            return ["install", f"torch=={CPU_VERSION}"]
        return ["install", "--index-url", CPU_INDEX, f"torch=={CPU_VERSION}"]
    if index is None and old_gpu(capability):
        index = SM70_INDEX
    where = [] if index in (None, "default") else ["--index-url", index]
    return ["install", *where, str(wanted)]


def reachable(url: str, timeout: float = 8.0) -> bool:
    """Whether an index answers at all: pip retries an unreachable one for every package it
    resolves (minutes of back-off on a machine with only a local wheelhouse)."""
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return True
    except OSError:
        return False


def cpu_index_up() -> bool:
    """Whether the CPU index answers, and a line saying it is left out where it does not (only
    the CPU index chosen here is: one the user named, TORCH_INDEX, goes to pip)."""
    up = reachable(CPU_INDEX + "/torch/")
    if not up:
        print(f"==> {CPU_INDEX} is unreachable: left out (pip would retry it for minutes)")
    return up


def source(index: str | None, capability: tuple[int, int] | None, args: list[str]) -> str:
    """Where `args` take torch from, in words (the pip arguments decide: an unreachable CPU index
    has been dropped from them)."""
    if index:
        return index
    if SM70_INDEX in args:
        return (
            f"{SM70_INDEX} (a GPU of compute capability {capability[0]}.{capability[1]}: only "
            "the cu126 builds carry its kernels)"
        )
    if CPU_INDEX in args:
        return f"{CPU_INDEX} (no NVIDIA GPU: the CPU build of {CPU_VERSION})"
    if capability is not None:
        return "pip's default index (an NVIDIA GPU is present: the CUDA build)"
    return "pip's own indexes and find-links (a local CPU wheel of it, where one is there)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install torch right for this machine.")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command only")
    dry = parser.parse_args(argv).dry_run
    wanted = torch_requirement()
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    index, capability = os.environ.get("TORCH_INDEX") or None, gpu_capability()
    args = plan(installed, wanted, index, capability is not None, capability, cpu_index_up)
    if not args:
        print(f"==> torch {installed} is installed and in the project's range {wanted}: kept")
        return 0
    if installed is None:
        why = "no torch installed"
    elif wanted.contains(installed):
        why = f"torch {installed} cannot run this machine's GPU"
    else:
        why = f"torch {installed} is outside {wanted}"
    where = source(index, capability, args)
    print(f"==> {why}: installing it from {where}; TORCH_INDEX=URL picks another", flush=True)
    command = [sys.executable, "-m", "pip", *args]
    if dry:
        print("==> dry run, nothing installed: " + " ".join(shlex.quote(a) for a in command))
        return 0
    result = subprocess.run(command)
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
