"""A shim for Beam's `--setup_file ./setup.py`: remote workers install this package (metadata in setup.cfg)."""

from setuptools import setup

setup()
