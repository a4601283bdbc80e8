"""File locks for the node cache (`fcntl.flock`: per open file, shared or exclusive), failing in
one line on a file system without them (some Lustre and FUSE mounts). POSIX record locks are
no fallback: a process drops all of them when it closes any descriptor of the file."""

from __future__ import annotations

import errno
import fcntl

from shatter.shards.store.errors import StoreError

UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def lock(fd: int, directory: str, shared: bool = False, wait: bool = True) -> bool:
    """Lock the open file `fd` (in `directory`); False when `wait` is off and it is held."""
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in UNSUPPORTED:
            raise StoreError(
                f"{directory} does not support file locks (flock: {e.strerror}): set "
                "data.cache_dir (or TMPDIR) to a node-local disk such as /tmp"
            ) from None
        raise


class Locked:
    """`with Locked(path, directory):` an exclusive lock on the file `path` (created)."""

    def __init__(self, path: str, directory: str):
        self.path, self.directory = path, directory

    def __enter__(self):
        import os

        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            lock(self.fd, self.directory)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import os

        os.close(self.fd)
