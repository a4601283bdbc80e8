"""Object storage, in one place: how the format, the trainer and exports reach `s3://`, `gs://`,
`hf://` and local paths, and the node-local cache of what they fetch. No Apache Beam: a training
node needs fsspec and the store's package only (s3fs, gcsfs, huggingface_hub). The build's Beam
side (`shatter.pipeline.store`) hands its options to `configure`.

    settings.py   `StoreSettings` (endpoint, credentials, retry bound, cache directory and bound),
                  `configure`, `current`: one per process, inherited by forked loader workers
    errors.py     `StoreError`, the one error type, one line each
    fs.py         file access (exists, size, open_read, create, rename, delete) with bounded retries
    check.py      `check`: credentials, bucket, prefix, before any work
    locks.py      `flock`, failing in one line where the file system has none
    cache.py      `NodeCache`: fetched once per node, pinned while read, bounded, swept
    verified.py   a local shard's sha256 checked once per node
"""

from __future__ import annotations

from shatter.shards.store.cache import REPLACED_FIX, NodeCache, local_path
from shatter.shards.store.check import check
from shatter.shards.store.errors import StoreError
from shatter.shards.store.fs import is_remote
from shatter.shards.store.settings import StoreSettings, configure, current


def open_store(
    path: str, cache_dir: str | None, limit_gb: float, retry_seconds: float
) -> NodeCache:
    """This process's store settings (the given cache and retry bound; the rest as they were,
    by default the AWS environment's endpoint and region), `path` checked when remote (credentials, bucket, prefix: one line
    each), and the node cache prepared (this user's directory, stale downloads swept)."""
    configure(
        current().replace(cache_dir=cache_dir, cache_limit_gb=limit_gb, retry_seconds=retry_seconds)
    )
    check(path)
    cache = NodeCache()
    return cache.prepare() if is_remote(path) else cache


__all__ = [
    "REPLACED_FIX",
    "NodeCache",
    "StoreError",
    "StoreSettings",
    "check",
    "configure",
    "current",
    "is_remote",
    "local_path",
    "open_store",
]
