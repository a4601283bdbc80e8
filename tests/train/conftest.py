"""Fixtures of the trainer's tests: shard datasets built by the real `shatter-data build`."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shardutil

from shardutil import build_books  # noqa: E402


@pytest.fixture(scope="session")
def books_data(shared_data, tmp_path_factory) -> Path:
    """Real text (Gutenberg books of ../shared/data) through the real pipeline: length 64, vocab 2000."""
    out = tmp_path_factory.mktemp("books") / "data"
    flags = ("--seq-len", "64", "--vocab-size", "2000", "--dupe-factor", "2", "--num-shards", "4")
    return build_books(shared_data, out, *flags)
