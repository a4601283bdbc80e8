"""Local shards whose sha256 was checked, marked once per node: every DataLoader worker of every
rank opens every shard, and a local or NFS dataset would otherwise be hashed by each of them.

A mark `verified/<sha256>-<device>-<inode>-<size>-<mtime>` in the node cache says that this file,
unchanged since, had that sha256; a rebuilt or replaced shard has another mark. One process hashes
while the others of the node wait on its lock, then trust its mark. The mark holds the sha256 of
each record batch, taken in the same pass: a reader hashes each record batch it reads against it
(`reader.ShardFile.block`), so bits that rot after the pass (which leave the size and mtime as
they were) are still found, without reading the file a second time."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from shatter.shards.store.cache import NodeCache
from shatter.shards.store.errors import StoreError
from shatter.shards.store.locks import Locked
from shatter.shards.store.settings import current

# (the whole file's sha256, each record batch's) of an open file, in one pass
Digests = tuple[str, list[str]]


def block_digests(path: str, sha256: str, digest: Callable[[], Digests]) -> list[str] | None:
    """The sha256 of each record batch of the local file `path` (`digest()` computes them with
    the whole file's), taken when the whole file was found to have `sha256`, at most once per
    node while the file is unchanged; None if it does not have it."""
    st = os.stat(path)
    directory = os.path.join(current().directory, "verified")
    mark = os.path.join(
        directory, f"{sha256}-{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
    )
    if (known := _read_mark(mark)) is not None:
        return known
    try:
        if not os.path.isdir(directory):
            NodeCache().prepare()  # this user's directory, 0700
            os.makedirs(directory, exist_ok=True)
        locked = Locked(mark + ".lock", directory).__enter__()
    except (OSError, StoreError):  # no usable node cache here: this process hashes on its own
        whole, blocks = digest()
        return blocks if whole == sha256 else None
    try:
        if (known := _read_mark(mark)) is not None:
            return known
        whole, blocks = digest()
        if whole != sha256:
            return None
        temp = f"{mark}.tmp-{uuid.uuid4().hex}"  # a mark is whole or absent
        with open(temp, "w") as f:
            f.write("".join(f"{d}\n" for d in (whole, *blocks)))
        os.replace(temp, mark)
        return blocks
    finally:
        locked.__exit__()


def _read_mark(mark: str) -> list[str] | None:
    """The record batches' digests a mark holds (after the whole file's); None without one, or
    for an empty one, which an older version left: it marked the whole file only."""
    try:
        with open(mark) as f:
            digests = f.read().split()
    except FileNotFoundError:
        return None
    return digests[1:] if digests else None
