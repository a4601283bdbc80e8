"""The store's one error type, and its one-line messages."""

from __future__ import annotations

from shatter.shards.schema import DatasetError


class StoreError(DatasetError):
    """An object store that failed after its retries, refused access, or holds other bytes than
    index.json lists; a node cache that cannot hold a file (disk full, no file locks, another
    user's directory). One line naming the object or the directory, and the fix."""


def store_failed(url: str, err: BaseException, retried: bool = True) -> StoreError:
    cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    after = " after retrying" if retried else ""
    return StoreError(f"the object store failed on {url}{after} ({cause})")


def disk_full(directory: str, detail: str) -> StoreError:
    return StoreError(
        f"disk full at {directory} ({detail}): free space there, lower data.cache_limit_gb, or "
        "set data.cache_dir to a larger node-local disk"
    )
