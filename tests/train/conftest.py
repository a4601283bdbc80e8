"""Fixtures of the trainer's tests: shard datasets built by the real `shatter-data build`."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shardutil

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def books_data(shared_data, tmp_path_factory) -> Path:
    """Real text (Gutenberg books of ../shared/data) through the real pipeline: length 64, vocab 2000."""
    out = tmp_path_factory.mktemp("books") / "data"
    cmd = [
        str(BIN / "shatter-data"),
        "build",
        "--corpus",
        "books",
        "--input",
        str(shared_data / "books"),
        "--output",
        str(out),
        "--seq-len",
        "64",
        "--vocab-size",
        "2000",
        "--dupe-factor",
        "2",
        "--num-shards",
        "4",
        "--validation-fraction",
        "0.05",
        "--seed",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
