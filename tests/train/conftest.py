"""Fixtures of the trainer's tests; `books_data` (the real pipeline's shards) is in tests/conftest.py."""

from pathlib import Path

import pytest

from tests.train.shardutil import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """The loader tests' dataset: train shards of 7, 5, 9 and 3 rows (24), 3 stored maskings."""
    return write_dataset(
        tmp_path_factory.mktemp("shards") / "data", shards=(7, 5, 9, 3), seq_len=32, dupe_factor=3
    )
