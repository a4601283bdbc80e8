"""Fixtures of the trainer's tests; `books_data` (the real pipeline's shards) is in tests/conftest.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # shardutil
