"""The package layout (metadata in setup.cfg), and the shim for Beam's `--setup_file ./setup.py`:
remote workers install this package.

The checkout keeps the folders users know (`pipeline/`, `train/`, `tools/` beside `shatter/`);
installed, they are `shatter.pipeline`, `shatter.train` and `shatter.tools`, so that the one
top-level name this distribution puts in site-packages is `shatter`: PyPI has unrelated
`pipeline`, `train` and `tools` distributions, which an install must not shadow."""

from setuptools import find_packages, setup

SUBPACKAGES = ("pipeline", "train", "tools")

setup(
    packages=find_packages(include=["shatter", "shatter.*"])
    + [f"shatter.{name}" for name in find_packages(include=[f"{s}*" for s in SUBPACKAGES])],
    package_dir={f"shatter.{name}": name for name in SUBPACKAGES},
)
