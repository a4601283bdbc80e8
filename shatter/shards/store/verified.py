"""Local shards whose sha256 was checked, marked once per node: every DataLoader worker of every
rank opens every shard, and a local or NFS dataset would otherwise be hashed by each of them.

A mark `verified/<sha256>-<device>-<inode>-<size>-<mtime>` in the node cache says that this file,
unchanged since, had that sha256; a rebuilt or replaced shard has another mark. One process hashes
while the others of the node wait on its lock, then trust its mark."""

from __future__ import annotations

import os

from shatter.shards.store.cache import NodeCache
from shatter.shards.store.errors import StoreError
from shatter.shards.store.locks import Locked
from shatter.shards.store.settings import current


def sha256_matches(path: str, sha256: str, digest) -> bool:
    """Whether the local file `path` has `sha256` (`digest(path)` computes it), hashed at most
    once per node while the file is unchanged."""
    st = os.stat(path)
    directory = os.path.join(current().directory, "verified")
    mark = os.path.join(
        directory, f"{sha256}-{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
    )
    if os.path.exists(mark):
        return True
    try:
        if not os.path.isdir(directory):
            NodeCache().prepare()  # this user's directory, 0700
            os.makedirs(directory, exist_ok=True)
        locked = Locked(mark + ".lock", directory).__enter__()
    except (OSError, StoreError):  # no usable node cache here: this process hashes on its own
        return digest(path) == sha256
    try:
        if os.path.exists(mark):
            return True
        ok = digest(path) == sha256
        if ok:
            with open(mark, "w"):
                pass
        return ok
    finally:
        locked.__exit__()
