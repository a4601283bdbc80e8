"""The node cache of remote shards against a real S3 server on loopback (`tests.s3server`): a
shard that a reader holds is never evicted under it, the validation split never is, the bound
counts temporary files, a killed download's file is swept, a full disk and a second user each
get one line, and a local shard's sha256 is checked once per node, not once per process."""

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shatter.shards.store import NodeCache, StoreError, configure, current, fs, open_store
from tests.s3server import BUCKET

KIB = 1024


@pytest.fixture
def settings(tmp_path, s3_server, monkeypatch):
    """This test's store settings (restored after): the loopback server, a cache in tmp_path."""
    monkeypatch.setattr("shatter.shards.store.settings._current", None)
    return configure(current().replace(cache_dir=str(tmp_path / "cache"), retry_seconds=1.0))


def upload(s3_server, name: str, data: bytes) -> tuple[str, str]:
    import hashlib

    s3_server.client().put_object(Bucket=BUCKET, Key=f"cache-test/{name}", Body=data)
    return f"s3://{BUCKET}/cache-test/{name}", hashlib.sha256(data).hexdigest()


def test_eviction_skips_pinned_and_kept_shards_and_counts_temporary_files(s3_server, settings):
    objects = [upload(s3_server, f"s{i}.arrow", bytes([i]) * 100 * KIB) for i in range(5)]
    configure(settings.replace(cache_limit_gb=250 * KIB / 2**30))  # room for two and a half
    cache = NodeCache().prepare()
    kept = cache.local_path(*objects[4], keep=True)  # a validation shard: counted, never evicted
    path, fd = cache.open(*objects[0])  # a reader holds shard 0
    try:
        for remote, sha in objects[1:4]:
            cache.local_path(remote, sha)
        assert os.path.exists(path) and os.pread(fd, 4, 0) == bytes([0]) * 4  # pinned: kept
        assert os.path.exists(kept)
        cached = sorted(p.name for p in Path(cache.directory).glob("*.arrow"))
        assert cached == sorted([f"{objects[0][1]}.arrow", f"{objects[3][1]}.arrow"]), cached
    finally:
        os.close(fd)
    # a dead writer's temporary file (unlocked, older than a moment) is swept, and counted until
    stale = Path(cache.directory) / ".tmp-dead-x.arrow"
    stale.write_bytes(b"\0" * 300 * KIB)
    os.utime(stale, (0, 0))
    cache.local_path(*objects[1])
    assert not stale.exists()
    assert not os.path.exists(path)  # unpinned now: the oldest, evicted


def test_a_download_killed_by_sigkill_leaves_a_file_that_the_next_one_sweeps(settings):
    cache = NodeCache().prepare()
    child = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)  # as a download holds its temporary file
os.write(fd, b"partial" * 1000)
os.utime(sys.argv[1], (0, 0))
print("writing", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""
    live_path = Path(cache.directory) / ".tmp-live-a.arrow"
    live = subprocess.Popen(
        [sys.executable, "-c", child, str(live_path), "live"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert live.stdout.readline().strip() == b"writing"
    dead_path = Path(cache.directory) / ".tmp-dead-b.arrow"
    dead = subprocess.run([sys.executable, "-c", child, str(dead_path), "die"], capture_output=True)
    assert dead.returncode == -signal.SIGKILL and dead_path.exists()
    try:
        assert cache.sweep() == 1
        assert not dead_path.exists() and live_path.exists()  # a live download is left alone
    finally:
        live.communicate(b"")


def test_a_full_disk_is_named_as_such(s3_server, settings, tmp_path):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("a 1 MiB tmpfs cannot be mounted here (needs root)")
    try:
        configure(settings.replace(cache_dir=str(disk / "cache")))
        remote, sha = upload(s3_server, "big.arrow", b"\1" * 2 * KIB * KIB)
        with pytest.raises(StoreError) as err:
            NodeCache().local_path(remote, sha)
        assert str(err.value).startswith(f"disk full at {disk / 'cache'} ("), err.value
        assert "object store" not in str(err.value)
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_second_user_gets_a_cache_of_their_own(tmp_path, monkeypatch):
    """The default directory is per user and 0700; another user's is refused in one line."""
    if os.getuid() != 0:
        pytest.skip("switching to a second user needs root")
    child = """
import os, pwd, sys
from shatter.shards.store import NodeCache, StoreError, configure, current
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root
os.environ["TMPDIR"] = sys.argv[1]
own = NodeCache().prepare().directory
configure(current().replace(cache_dir=sys.argv[2]))
try:
    NodeCache().prepare()
except StoreError as e:
    print(own, oct(os.stat(own).st_mode & 0o777), e, sep="\\n")
"""
    import shutil
    import tempfile

    monkeypatch.setattr("shatter.shards.store.settings._current", None)
    shared = Path(tempfile.mkdtemp(prefix="shatter-shared-tmp-"))  # like /tmp: 01777
    os.chmod(shared, 0o1777)
    try:
        monkeypatch.setenv("TMPDIR", str(shared))
        first = Path(NodeCache().prepare().directory)  # the first user's default
        assert first == shared / "shatter-cache-root" and first.stat().st_mode & 0o777 == 0o700
        done = subprocess.run(
            [sys.executable, "-c", child, str(shared), str(first)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        shutil.rmtree(shared)
    own, mode, message = done.stdout.strip().splitlines() or [done.stderr[-2000:]] * 3
    assert own == str(shared / "shatter-cache-nobody") and mode == "0o700", done.stdout
    assert message.startswith(f"the node cache {first} is not writable by this user"), message
    assert "set data.cache_dir" in message


def test_no_file_locks_is_one_line(settings, monkeypatch):
    import errno

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)  # a Lustre mount without -o flock
    with pytest.raises(StoreError, match=r"does not support file locks \(flock: No locks"):
        NodeCache().prepare().local_path(f"s3://{BUCKET}/x.arrow", "0" * 64)


@pytest.mark.slow
def test_a_local_shard_is_hashed_once_per_node(tmp_path, settings):
    """Every loader worker of every rank opens every shard: the first to check one marks it."""
    from tests.train.shardutil import write_dataset

    data = write_dataset(tmp_path / "data", vocab=100, seq_len=32)
    child = """
import sys
from shatter.shards import open_shard, read_index, reader
from shatter.shards.store import configure, current
configure(current().replace(cache_dir=sys.argv[2]))
hashed = []
real = reader._hash_blocks  # the one pass over a whole shard (its sha256, its batches')
reader._hash_blocks = lambda *a: hashed.append(a) or real(*a)
index = read_index(sys.argv[1], verify_tokenizer=False)
for info in index.shards("train"):
    open_shard(index.shard_path(info), info, verify=True)
print(len(hashed), len(index.shards("train")))
"""
    root = Path(__file__).resolve().parents[2]
    runs = [
        subprocess.run(
            [sys.executable, "-c", child, str(data), settings.directory],
            capture_output=True,
            text=True,
            cwd=root,
        ).stdout.split()
        for _ in range(2)
    ]
    shards = int(runs[0][1])
    assert shards > 0 and runs == [[str(shards), str(shards)], ["0", str(shards)]], runs
    # a rewritten shard (another mtime) is hashed again
    first = sorted(data.glob("train-*.arrow"))[0]
    os.utime(first, ns=(0, 0))
    again = subprocess.run(
        [sys.executable, "-c", child, str(data), settings.directory],
        capture_output=True,
        text=True,
        cwd=root,
    ).stdout.split()
    assert again == ["1", str(shards)], again


def test_fs_reads_remote_objects_without_beam(s3_server, settings):
    """The format's file access is fsspec's: `apache_beam` is never imported for it."""
    remote, _ = upload(s3_server, "plain.bin", b"0123456789")
    child = f"""
import sys
sys.modules["apache_beam"] = None  # any import of Beam fails
from shatter.shards.store import fs
with fs.open_read({remote!r}) as f:
    f.seek(3)
    print(f.read(4).decode(), fs.size({remote!r}), fs.exists({remote!r} + "x"))
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=root)
    assert done.stdout.split() == ["3456", "10", "False"], done.stderr[-2000:]
    assert fs.is_remote(remote) and open_store  # the trainer's entry point exists


def test_beam_s_s3_calls_without_a_retry_of_their_own_get_the_bounded_one():
    """Beam's S3 client, shared and one try a call (botocore's retries off): the calls Beam's
    s3io makes without its retry decorator (its downloads' ranges, its uploads' parts) are
    wrapped in Beam's backoff, which `--store_retry_seconds` bounds; the others keep Beam's."""
    from apache_beam.io.aws.clients.s3.boto3_client import Client
    from apache_beam.options.pipeline_options import PipelineOptions

    from shatter.pipeline.store import UNRETRIED, share_s3_clients

    share_s3_clients()
    opts = ["--s3_endpoint_url=http://127.0.0.1:9", "--s3_region_name=us-east-1"]
    client = Client(PipelineOptions([*opts, "--s3_access_key_id=a", "--s3_secret_access_key=b"]))
    for name in UNRETRIED:
        assert getattr(client, name).__wrapped__.__name__ == name, name
    assert not hasattr(client.list, "__wrapped__")  # s3io retries list itself
    assert client.client.meta.config.retries["total_max_attempts"] == 1
