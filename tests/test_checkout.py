"""One checkout's code at a time (shatter/checkout.py): the checkout's folders are never packages
of their own, and a script of another checkout (a second clone sharing this venv) stops in one
line naming both checkouts instead of running this checkout's library under its own name."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["train", "pipeline", "tools"])
def test_the_checkout_s_folders_are_not_top_level_packages(name):
    done = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        f"ImportError: {name!r} is not a package of its own: import shatter.{name} (this "
        f"checkout's {name}/ folder, installed by `make setup`)"
    )


def test_the_installed_subpackages_are_this_checkout_s():
    probe = "import shatter.train, shatter.pipeline, shatter.shards as s; print(s.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == REPO / "shatter" / "shards" / "__init__.py"


def test_a_script_of_another_checkout_stops_in_one_line_naming_both(tmp_path):
    clone = tmp_path / "clone"
    for name in ("setup.cfg", "shatter/__init__.py", "train/pretrain.py"):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, clone / name)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH: the venv's shatter
    done = subprocess.run(
        [sys.executable, str(clone / "train" / "pretrain.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and not done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {clone / 'train' / 'pretrain.py'} is from the checkout {clone}")
    assert f"`shatter` is imported from {REPO};" in line
