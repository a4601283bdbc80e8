"""The data path trusts nothing it did not check: a node cache that is not this user's own with
mode 0700 is refused, and so is an index.json whose `file` leaves the dataset or whose `sha256`
is not a digest (it becomes a path in the node cache), at start-up, in one line, on both ranks
of a real launch."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shatter.shards import DatasetError, read_index
from shatter.shards.store.cache import NodeCache
from shatter.shards.store.errors import StoreError
from shatter.shards.store.settings import current
from tests.jobs import child_env
from tests.train.runs import command
from tests.train.shardutil import write_dataset

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path) -> Path:
    return write_dataset(tmp_path / "data", shards=(6, 6), seq_len=32, vocab=100)


def _edit_index(data: Path, edit) -> None:
    index = json.loads((data / "index.json").read_text())
    edit(index)
    (data / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("file", "/etc/passwd", "is not a plain file name inside the dataset"),
        ("file", "../other/train-00000-of-00002.arrow", "is not a plain file name"),
        ("sha256", "../../../../etc/cron.d/x", "is not 64 hex digits"),
        ("sha256", "A" * 64, "is not 64 hex digits"),
    ],
)
def test_an_index_field_that_is_not_a_name_or_a_digest_is_refused(data, field, value, says):
    _edit_index(data, lambda ix: ix["splits"]["train"]["shards"][1].__setitem__(field, value))
    with pytest.raises(DatasetError) as err:
        read_index(data)
    line = str(err.value)
    assert str(data / "index.json") in line and "train shard 1" in line and says in line
    assert "\n" not in line


def test_a_node_cache_not_owned_or_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("shatter.shards.store.settings._current", None)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    settings = current().replace(cache_dir=str(cache))
    assert NodeCache(settings).prepare()  # this user's, 0700: used
    os.chmod(cache, 0o755)
    with pytest.raises(StoreError, match="has mode 0755.*chmod 700"):
        NodeCache(settings).prepare()
    os.chmod(cache, 0o700)
    if os.getuid() != 0:
        pytest.skip("planting a directory of another user needs root")
    os.chown(cache, 65534, 65534)  # squatted: nobody's, as on a shared /tmp
    with pytest.raises(StoreError, match="belongs to .*: only a directory of this user's own"):
        NodeCache(settings).prepare()
    shutil.rmtree(cache)
    own = tmp_path / "scratch"
    own.mkdir(mode=0o700)
    cache.symlink_to(own)  # this user's link to this user's 0700 directory: used
    assert NodeCache(settings).prepare()
    os.lchown(cache, 65534, 65534)  # a link planted by another user
    with pytest.raises(StoreError, match="is a symbolic link of"):
        NodeCache(settings).prepare()


def test_a_crafted_index_stops_both_ranks_at_start_up_in_one_line(data, tmp_path):
    _edit_index(data, lambda ix: ix["splits"]["train"]["shards"][0].__setitem__("file", "/etc/x"))
    cmd = command(data, tmp_path / "run", "--max-steps", "2", "--num-workers", "0")
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=480, cwd=REPO, env=child_env()
    )
    assert done.returncode != 0
    errors = [x for x in (done.stdout + done.stderr).splitlines() if x.startswith("Error: ")]
    assert 1 <= len(errors) <= 2, done.stderr[-3000:]  # one line a rank (the launcher may end
    # the other before it says its own)
    assert all("'/etc/x' is not a plain file name" in x for x in errors), errors
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "checkpoints").exists()
