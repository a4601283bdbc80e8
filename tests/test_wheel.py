"""The wheel puts one top-level package in site-packages, `shatter`: the checkout's pipeline/ and
train/ install as shatter.pipeline and shatter.train (links under shatter/, setup.py), and tools/
(set-up, reproduction and benchmark scripts) stays out. So it installs beside PyPI's unrelated
`tools` (and `pipeline`, `train`) without shadowing them."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPI_TOOLS = "tools==1.0.38"  # PyPI's `tools` distribution, pure Python, stdlib only


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the committed tree plus the working changes, built in a copy: the build's
    `build/` and `*.egg-info` stay out of the checkout."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, files.stdout.decode().split("\0")):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_symlink():  # shatter/pipeline -> ../pipeline, ...
            os.symlink(os.readlink(REPO / name), tree / name)
        elif (REPO / name).is_file():
            shutil.copy2(REPO / name, tree / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(out), str(tree)], check=True, capture_output=True)
    (path,) = out.glob("shatter_toolkit-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_has_one_top_level_package_and_no_checkout_scripts(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"shatter", wheel.name.split("-py3")[0] + ".dist-info"}, top
    for module in ("pipeline/cli.py", "train/pretrain.py", "extend_cli.py", "shards/", "kernels"):
        assert any(n.startswith(f"shatter/{module}") for n in names), module
    assert not [n for n in names if n.startswith("shatter/tools/")]  # benchmarks, set-up
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if "entry_points" in n))
    for script in ("shatter-data = shatter.pipeline.cli:entry", "shatter-evaluate", "shatter-glue"):
        assert script.encode() in entry_points, script


@pytest.mark.slow
def test_installed_beside_pypi_s_tools_both_import(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
    proc = subprocess.run([*install, str(wheel), PYPI_TOOLS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import importlib.util as u, shatter, tools; "
        "print(tools.__version__, tools.__file__); "
        "print(*(u.find_spec(f'shatter.{s}').origin for s in ('pipeline', 'train', 'shards'))); "
        "print(u.find_spec('shatter.tools'))"
    )
    # run from an empty directory: the checkout's own folders are not on the path
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    pypi_line, ours_line, tools_line = proc.stdout.splitlines()
    assert tools_line == "None"
    site = str(venv / "lib")
    assert pypi_line.startswith("1.0.38 ") and site in pypi_line, pypi_line
    assert all(site in origin and "/shatter/" in origin for origin in ours_line.split())
