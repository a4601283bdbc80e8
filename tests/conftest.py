"""Shared test fixtures: the location of ../shared/data and offline settings for `datasets`."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("SHATTER_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data`, or a skip that says why: a user's fresh checkout does not have it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real sample data not found at {SHARED_DATA} (set SHATTER_SHARED_DATA)")
    return SHARED_DATA
