"""Training data on object storage (a loopback S3 server, `tests.s3server`): a dataset three
times the node cache's bound trains two epochs on two ranks, with validation, to the losses of
the same data on local disk (both runs on one launch's ranks); the store stops answering during
a run, and the trainer checkpoints and exits with one line naming the object; an object replaced
by different bytes is refused by its sha256. (The 2-rank run from s3:// with an exact resume:
tests/train/test_pretrain.py, the kill -9 test.)"""

import os
import sys
import time
from pathlib import Path

import pytest

from shatter.shards import DatasetError, read_index
from shatter.shards.store import NodeCache, configure, current
from tests.jobs import Job
from tests.s3server import BUCKET
from tests.train.runs import cheap_config, command, metrics, one_launch, run_to_end
from tests.train.shardutil import write_dataset

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_a_dataset_three_times_the_cache_trains_two_epochs_as_from_local_disk(
    s3_server, tmp_path, monkeypatch
):
    """Shards are evicted and fetched again while both ranks' loader workers read, and a
    validation runs in each epoch: no reader loses a shard under it, and the losses, training
    and validation, are those of the same dataset on local disk, bit for bit (fp32). The S3 run's
    ranks cannot import Beam: a training node reads the store through fsspec alone. Both runs
    share one launch's ranks, the local one first."""
    from tests.s3server import count_requests

    # six train shards (a step of two ranks reads two of them), one validation shard
    local = write_dataset(tmp_path / "data", shards=(16,) * 6, seq_len=32, val_rows=(24,))
    index = read_index(local)
    train_bytes = sum(s.bytes for s in index.shards("train"))
    # the kept validation split, and room for a third of the train split
    limit = sum(s.bytes for s in index.shards("validation")) + train_bytes / 3
    remote = s3_server.upload(local, "three-times")
    gets = count_requests("GET /shards/three-times/train-")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the node cache: $TMPDIR/shatter-cache-<user>
    limit_line = {"data:\n": f"data:\n  cache_limit_gb: {limit / 2**30!r}\n"}
    config = cheap_config(tmp_path / "cache.yaml", limit_line, eval_rows=24)  # every row
    steps = -(-2 * index.rows("train") // 32) + 1  # two epochs and a step of the third
    args = ["--max-steps", str(steps), "--micro-batch", "16", "--eval-every", str(steps // 3)]
    args += ["--save-every", "0", "--log-every", "1", "--warmup-steps", "5", "--lr", "2e-3"]
    args += ["--seq-len", "32"]
    runs = {"local": tmp_path / "local", "s3": tmp_path / "s3"}
    # a training node without Beam: in the ranks, `import apache_beam` fails
    no_beam = tmp_path / "no-beam" / "apache_beam"
    no_beam.mkdir(parents=True)
    (no_beam / "__init__.py").write_text('raise ImportError("Beam is not installed here")\n')
    s3_env = {**os.environ, "PYTHONPATH": f"{no_beam.parent}:{REPO}"}
    both = [
        command(data, runs[name], *args, launcher=[], config=config)[1:]
        for name, data in (("local", local), ("s3", remote))
    ]
    run_to_end(one_launch(local, tmp_path, *both), env=s3_env)
    fetched = {name: gets.count(name) for name in set(gets)}
    assert len(fetched) == len(index.shards("train")) and max(fetched.values()) > 1, fetched
    cache = next(tmp_path.glob("shatter-cache-*"))
    assert not list(cache.rglob(".tmp-*"))
    kept = {p.name for p in (cache / "keep").glob("*.arrow")}
    assert kept == {f"{s.sha256}.arrow" for s in index.shards("validation")}
    (local_train, local_val), (s3_train, s3_val) = metrics(runs["local"]), metrics(runs["s3"])
    assert len(local_train) == steps and len(local_val) >= 3
    assert s3_train == local_train
    assert {k: v["loss"] for k, v in s3_val.items()} == {k: v["loss"] for k, v in local_val.items()}


def test_store_stopping_during_training_checkpoints_and_exits_naming_the_object(
    s3_server, tmp_path, monkeypatch
):
    # many small shards: the prefetcher needs the store mid-run
    small = write_dataset(tmp_path / "small", shards=(32,) * 24, seq_len=64, val_rows=(8,))
    remote = s3_server.upload(small, "small")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the cache: $TMPDIR/shatter-cache-<user>
    config = tmp_path / "retry.yaml"
    tiny = (REPO / "configs" / "cpu-tiny.yaml").read_text()
    config.write_text(tiny.replace("data:\n", "data:\n  store_retry_seconds: 1\n", 1))
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train" / "pretrain.py"), "--data", remote]
    cmd += ["--output", str(run), "--preset", "shatter-tiny"]
    cmd += ["--config", str(config), "--log-every", "1", "--eval-every", "1000"]
    cmd += ["--save-every", "1000", "--seq-len", "32", "--max-steps", "2000"]
    job = Job(cmd)
    try:
        deadline = time.time() + 120
        metrics = run / "metrics.jsonl"  # a training step logged: the run is under way
        while time.time() < deadline and '"loss"' not in (
            metrics.read_text() if metrics.exists() else ""
        ):
            time.sleep(0.1)
        s3_server.stop()  # the first shards are cached (or being fetched): the rest cannot be
        code, _ = job.finish(120)
    finally:
        s3_server.start()
    last = job.text.strip().splitlines()[-1]
    assert code == 1, job.text[-3000:]
    assert last.startswith("Error: the object store failed on s3://shards/small/train-"), last
    assert "Retry with exponential backoff" not in job.text  # Beam's retries: not on stderr
    # a look-ahead's failure stops the run with a checkpoint; a shard needed at once that cannot
    # be had ends it without one (the last periodic checkpoint stands): which comes first is a race
    if "checkpoint saved at step" in last:
        assert "run the same command again" in last, last
        assert (run / "checkpoints" / "latest").exists()

    # an object replaced by different bytes: refused by its sha256 in index.json, named
    index = read_index(remote)
    info = index.shards("train")[0]
    s3_server.client().put_object(Bucket=BUCKET, Key=f"small/{info.file}", Body=b"other bytes")
    configure(
        current().replace(
            cache_dir=str(tmp_path / "fresh-cache"), cache_limit_gb=1.0, retry_seconds=1.0
        )
    )
    with pytest.raises(DatasetError, match=f"{index.shard_path(info)} is not the file"):
        NodeCache().local_path(index.shard_path(info), info.sha256)


def test_a_failed_look_ahead_reaches_the_trainer_in_band(s3_server, tmp_path, monkeypatch):
    """A download that fails for good in a loader's look-ahead rides the next batch (STORE_ERROR),
    while the shard being read still serves its rows: no file, no signal."""
    from shatter.train.loader.stream import STORE_ERROR
    from tests.train.loaderutil import stream

    monkeypatch.setattr("shatter.shards.store.settings._current", None)
    configure(current().replace(cache_dir=str(tmp_path / "cache"), retry_seconds=1.0))
    local = write_dataset(tmp_path / "data", shards=(40, 40))
    remote = s3_server.upload(local, "look-ahead")
    s3_server.client().delete_object(Bucket=BUCKET, Key="look-ahead/train-00001-of-00002.arrow")
    batches = iter(stream(read_index(remote, verify_tokenizer=False), batch_size=2, shuffle=False))
    flagged = []
    for _ in range(20):  # the first shard's rows, read while the second one's download fails
        batch = next(batches)
        assert len(batch["sample_id"]) == 2
        if STORE_ERROR in batch:
            flagged.append(batch[STORE_ERROR])
        time.sleep(0.02)
    assert flagged, "no batch carried the look-ahead's failure"
    assert flagged[0].startswith(f"{remote}/train-00001-of-00002.arrow, listed in index.json"), (
        flagged
    )
