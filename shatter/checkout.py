"""One checkout's code at a time: `pipeline/`, `train/` and `tools/` are `shatter.pipeline`,
`shatter.train` and `shatter.tools` (links under `shatter/`), never packages of their own, and a
script of one checkout never runs on another checkout's `shatter`.

Both checks end the process in one line: a second clone sharing the first one's venv would
otherwise run the first one's library under the second one's scripts without a word."""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) of `shatter`


def subpackage_only(name: str, expected: str) -> None:
    """Refuse `import train` (from a checkout's root): the folder is `shatter.train`."""
    if name != expected:
        raise ImportError(
            f"{name!r} is not a package of its own: import {expected} (this checkout's "
            f"{expected.split('.')[-1]}/ folder, installed by `make setup`)"
        )


def checkout_of(path: Path) -> Path | None:
    """The shatter checkout that holds `path` (a folder with shatter/__init__.py and setup.cfg)."""
    for parent in path.resolve().parents:
        if (parent / "shatter" / "__init__.py").is_file() and (parent / "setup.cfg").is_file():
            return parent
    return None


def same_checkout(script: str | None) -> None:
    """Stop when `script` (the `__main__` file) lies in a checkout other than this `shatter`'s."""
    if not script or Path(script).resolve().is_relative_to(Path(sys.prefix).resolve()):
        return  # no script, or the environment's own (pytest, a console script in .venv/bin)
    theirs = checkout_of(Path(script))
    if theirs is not None and theirs != PACKAGE_ROOT:
        sys.exit(
            f"error: {script} is from the checkout {theirs}, but `shatter` is imported from "
            f"{PACKAGE_ROOT}; fix: run `make setup` in {theirs} (its own venv), or run the "
            f"script from {PACKAGE_ROOT}"
        )
