"""A node-local cache of remote shards (MosaicML streaming's `remote=` + `local=`): a remote shard
resolves to a local file (`local_path`), which the reader then opens as any local shard.

- One directory per node (`configure`: the trainer's `data.cache_dir`), shared by its ranks and
  their DataLoader workers. Files are named by their sha256 in index.json, so a cached file is the
  shard that index.json lists, whatever dataset or path it came from.
- One download per shard per node: a file lock per shard (`fcntl.flock`) around the download, which
  goes to a temporary name and is renamed into place once its sha256 matched: two processes never
  both fetch a shard, and a half-written file is never read. The sha256 is checked once, there;
  an object replaced by different bytes is refused, named.
- A size bound (`data.cache_limit_gb`): after a download, the least recently used shards go until
  the cache fits (a reader that still has one open keeps its data: POSIX unlink).
- The loader's look-ahead (`train.data`: the thread that opens the next shards) downloads the
  shards a stream will read next; a failure there stops the run at a step boundary
  (`stop_on_failure`).
- A store that stops answering: each read retries with backoff for `retry_seconds`
  (`pipeline.store`), then a DatasetError names the object.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import uuid
from dataclasses import dataclass

from pipeline.format import fs
from pipeline.format.schema import DatasetError

CHUNK = 1 << 22
is_remote = fs.is_remote


@dataclass(frozen=True)
class CacheConfig:
    directory: str
    limit_bytes: int
    retry_seconds: float = 120.0


_config: CacheConfig | None = None


def configure(directory: str, limit_gb: float, retry_seconds: float = 120.0) -> None:
    """Where and how much this process (and the DataLoader workers it forks) caches."""
    global _config
    os.makedirs(directory, exist_ok=True)
    _config = CacheConfig(str(directory), int(limit_gb * 2**30), retry_seconds)


def default_directory() -> str:
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "shatter-cache")


def settings() -> CacheConfig:
    """This process's cache (`configure`d, else the default directory and bound)."""
    if _config is None:
        configure(default_directory(), 50.0)
    return _config


def open_store(path: str, directory: str | None, limit_gb: float, retry_seconds: float) -> None:
    """A remote dataset `path`: checked (credentials, bucket, prefix: one line each), and this
    process's cache configured. A local path: nothing."""
    if not fs.is_remote(path):
        return
    from pipeline import store

    store.configure([f"--store_retry_seconds={retry_seconds}"])
    store.check(path)
    configure(directory or default_directory(), limit_gb, retry_seconds)


REPLACED_FIX = "rebuild the dataset or restore the object"


def _download(
    remote: str, sha256: str, final: str, listed_in: str = "index.json", fix: str = REPLACED_FIX
) -> None:
    temp = f"{final}.tmp-{uuid.uuid4().hex}"
    digest = hashlib.sha256()
    try:
        try:
            with fs.open_read(remote) as src, open(temp, "wb") as dst:
                while block := src.read(CHUNK):
                    digest.update(block)
                    dst.write(block)
        except Exception as e:
            from pipeline.store import failure

            message = failure(e) or f"the object store failed on {remote} ({type(e).__name__}: {e})"
            raise DatasetError(message) from None
        if digest.hexdigest() != sha256:
            raise DatasetError(
                f"{remote} is not the file that {listed_in} lists (its sha256 differs): the object "
                f"was replaced; {fix}"
            )
        os.replace(temp, final)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def _evict(config: CacheConfig, keep: str) -> None:
    """Remove the least recently used shards until the cache fits its bound (never `keep`)."""
    entries = []
    for name in os.listdir(config.directory):
        if name.endswith(".arrow"):
            path = os.path.join(config.directory, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= config.limit_bytes:
            break
        if path != keep:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            total -= size


def local_path(
    remote: str, sha256: str, listed_in: str = "index.json", fix: str = REPLACED_FIX
) -> str:
    """The local file of the object `remote` (a shard, the tokenizer; an export's weights) whose
    sha256 in `listed_in` is `sha256` (a local `remote` is itself), fetched once per node and
    checked there (a mismatch: one line naming it and `fix`)."""
    if not fs.is_remote(remote):
        return remote
    config = settings()
    final = os.path.join(config.directory, sha256 + os.path.splitext(remote)[1])
    if not os.path.exists(final):
        with open(f"{final}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it: wait for it
            if not os.path.exists(final):
                from pipeline import store

                store.bound_retries(config.retry_seconds)
                _download(remote, sha256, final, listed_in, fix)
                _evict(config, keep=final)
    try:
        os.utime(final)  # recently used
    except FileNotFoundError:  # evicted meanwhile by another process: fetch it again
        return local_path(remote, sha256, listed_in, fix)
    return final


def _failure_file(pid: int) -> str:
    return os.path.join(settings().directory, f".store-failure-{pid}")


def report_failure(message: str, trainer_pid: int) -> None:
    """A prefetch that failed after its retries: the trainer (`trainer_pid`) is asked to stop
    as on SIGTERM (a checkpoint at the next step boundary, agreed between ranks), and then
    finds why in `take_failure`. The shard being read meanwhile is still in memory. Only the
    first report of a trainer signals it: each DataLoader worker prefetches on its own, and a
    second SIGTERM would end the trainer at once, without its checkpoint."""
    try:
        fd = os.open(_failure_file(trainer_pid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(message)
    os.kill(trainer_pid, signal.SIGTERM)


def take_failure(pid: int) -> str | None:
    """The store failure that stopped the trainer `pid`, if one did."""
    if _config is None or not os.path.exists(_failure_file(pid)):
        return None
    with open(_failure_file(pid)) as f:
        message = f.read()
    os.remove(_failure_file(pid))
    return message


_reported = False


def stop_on_failure(future, trainer_pid: int) -> None:
    """A background open of a remote shard (the loader's look-ahead): if it fails for good (the
    store stopped answering, or the object was replaced), `report_failure` to the trainer, once."""
    if getattr(future, "_shatter_watched", False):
        return
    future._shatter_watched = True

    def done(f) -> None:
        global _reported
        error = f.exception()
        if isinstance(error, DatasetError) and not _reported:
            _reported = True
            report_failure(str(error), trainer_pid)

    future.add_done_callback(done)
