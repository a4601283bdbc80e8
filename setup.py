"""The package list (metadata in setup.cfg), and the shim for Beam's `--setup_file ./setup.py`:
remote workers install this package.

The checkout keeps the folders users know (`pipeline/`, `train/`, `tools/` beside `shatter/`);
`shatter/pipeline`, `shatter/train` and `shatter/tools` are symbolic links to them, so that the
one top-level name this distribution installs is `shatter` (PyPI has unrelated `pipeline`,
`train` and `tools` distributions), and every reader, static or not, finds `shatter.train.*` in
the same checkout as `shatter` itself.

`tools/` (set-up, reproduction and benchmark scripts) runs from a checkout only: the wheel leaves
it out, the editable install (`make setup`, setuptools' strict mode: a tree of links that static
readers follow) keeps it."""

import sys

from setuptools import find_packages, setup

# setuptools' PEP 660 hook runs this file with the `editable_wheel` command
EDITABLE = "editable_wheel" in sys.argv
CHECKOUT_ONLY = [] if EDITABLE else ["shatter.tools", "shatter.tools.*"]

setup(packages=find_packages(include=["shatter", "shatter.*"], exclude=CHECKOUT_ONLY))
