"""A node-local cache of remote objects (MosaicML streaming's `remote=` + `local=`): a remote
shard, tokenizer or export's weights resolves to a local file, fetched once per node, checked
against its sha256 there, and never deleted while a reader uses it.

The directory (`StoreSettings.directory`: `$TMPDIR/shatter-cache-<user>`, made 0700, so a second
user of the node gets their own) holds:

    <sha256>.arrow         a training shard: evicted least recently used first
    keep/<sha256>.<ext>    never evicted: the validation split, tokenizers, an export's weights
    <sha256>.lock          one download per object per node (`flock`)
    .tmp-<uuid>-<name>     a download under way, locked by its writer for its life: one whose
                           writer died (a SIGKILL) is swept before the next eviction
    verified/              per-node marks of local shards whose sha256 was checked (`verified`)

- A reader pins what it reads: it holds the file open, reads it by `pread`, and holds a shared
  lock on it (`NodeCache.open`); eviction removes only what it can lock exclusively.
- The bound (`data.cache_limit_gb`) counts every file here, temporary ones included, and the
  disk keeps a floor of free space (`free_floor`): a download that cannot fit once everything
  unpinned is gone is "disk full at DIR", as is a write that meets ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
import uuid

from shatter.shards.store import fs
from shatter.shards.store.errors import StoreError, disk_full
from shatter.shards.store.locks import Locked, lock
from shatter.shards.store.settings import StoreSettings, current

CHUNK = 1 << 22
KEEP = "keep"
TEMP = ".tmp-"
STALE_S = 2.0  # a temporary file unlocked for this long has no writer
REPLACED_FIX = "rebuild the dataset or restore the object"


def free_floor(directory: str) -> int:
    """Bytes of the disk that the cache leaves free: 5% of it, at most 1 GiB."""
    st = os.statvfs(directory)
    return min(1 << 30, st.f_blocks * st.f_frsize // 20)


def _free(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class NodeCache:
    def __init__(self, settings: StoreSettings | None = None):
        settings = settings or current()
        self.directory = settings.directory
        self.limit = int(settings.cache_limit_gb * 2**30)

    def prepare(self) -> NodeCache:
        """The directory made (0700) or checked as this user's, and stale temporary files swept."""
        try:
            if not os.path.isdir(self.directory):
                os.makedirs(self.directory, exist_ok=True)
                os.chmod(self.directory, 0o700)  # this user's alone (makedirs' mode obeys umask)
            os.makedirs(os.path.join(self.directory, KEEP), exist_ok=True)
        except PermissionError:
            pass  # reported below, with its owner
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise StoreError(
                f"the node cache {self.directory} is not writable by this user (it belongs to "
                f"{_owner(self.directory)}): set data.cache_dir (or TMPDIR) to a directory of your own"
            )
        self.sweep()
        return self

    def _paths(self, remote: str, sha256: str) -> tuple[str, str]:
        ext = os.path.splitext(remote)[1]
        return os.path.join(self.directory, KEEP, sha256 + ext), os.path.join(
            self.directory, sha256 + ext
        )

    def local_path(
        self,
        remote: str,
        sha256: str,
        keep: bool = False,
        listed_in: str = "index.json",
        fix: str = REPLACED_FIX,
    ) -> str:
        """The local file of the object `remote` whose sha256 in `listed_in` is `sha256`, fetched
        once per node (a mismatch: one line naming it and `fix`); with `keep`, never evicted."""
        kept, evictable = self._paths(remote, sha256)
        for path in (kept, evictable):
            try:
                os.utime(path)  # recently used
                return path
            except FileNotFoundError:
                pass
        final = kept if keep else evictable
        if not os.path.isdir(os.path.join(self.directory, KEEP)):
            self.prepare()
        with Locked(os.path.join(self.directory, sha256 + ".lock"), self.directory):
            if not os.path.exists(final):  # another process may have fetched it meanwhile
                self._fetch(remote, sha256, final, listed_in, fix)
        return final

    def open(self, remote: str, sha256: str, keep: bool = False) -> tuple[str, int]:
        """(local path, descriptor) of `remote`, pinned: the descriptor holds a shared lock,
        which eviction respects, until it is closed."""
        for _ in range(3):
            path = self.local_path(remote, sha256, keep)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # evicted between the two calls: fetched again
            lock(fd, self.directory, shared=True)
            if os.fstat(fd).st_nlink:
                return path, fd
            os.close(fd)  # evicted while we locked it
        raise StoreError(f"{remote}: evicted from {self.directory} as soon as it was fetched")

    def _fetch(self, remote: str, sha256: str, final: str, listed_in: str, fix: str) -> None:
        try:
            need = fs.size(remote)
        except FileNotFoundError:
            raise StoreError(
                f"{remote}, listed in {listed_in}, is not in the store; {fix}"
            ) from None
        self.make_room(need, keep=final)
        temp = os.path.join(
            os.path.dirname(final), f"{TEMP}{uuid.uuid4().hex}-{os.path.basename(final)}"
        )
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            lock(fd, self.directory)  # held while written: a sweep leaves it alone
            digest = hashlib.sha256()
            with fs.open_read(remote) as src:
                while block := src.read(CHUNK):
                    digest.update(block)
                    self._write(fd, block, temp)
            if digest.hexdigest() != sha256:
                raise StoreError(
                    f"{remote} is not the file that {listed_in} lists (its sha256 differs): the "
                    f"object was replaced; {fix}"
                )
            os.replace(temp, final)
        finally:
            os.close(fd)
            if os.path.exists(temp):
                os.remove(temp)

    def _write(self, fd: int, block: bytes, temp: str) -> None:
        try:
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(
                    self.directory, f"writing {os.path.basename(temp)}: {e.strerror}"
                ) from None
            raise

    def _usage(self) -> tuple[list[tuple[float, int, str]], int]:
        """(evictable shards as (last use, size, path), bytes of every file here)."""
        evictable, total = [], 0
        for folder in (self.directory, os.path.join(self.directory, KEEP)):
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    if not entry.is_file():
                        continue
                    total += st.st_size
                    if (
                        folder == self.directory
                        and entry.name.endswith(".arrow")
                        and not entry.name.startswith(TEMP)
                    ):
                        evictable.append((st.st_mtime, st.st_size, entry.path))
        return evictable, total

    def make_room(self, need: int, keep: str = "") -> None:
        """Evict unpinned shards, least recently used first, until `need` more bytes fit the
        bound and the disk's floor; past the bound when every shard left is pinned (readers
        use them), but never past the floor."""
        with Locked(os.path.join(self.directory, ".evict.lock"), self.directory):
            self.sweep()
            evictable, total = self._usage()
            free, floor = _free(self.directory), free_floor(self.directory)
            for _, size, path in sorted(evictable):
                if total + need <= self.limit and free - need >= floor:
                    break
                if path != keep and _evict(path, self.directory):
                    total, free = total - size, free + size
            if free - need < floor:
                raise disk_full(
                    self.directory,
                    f"{need / 2**20:.1f} MiB to fetch, {free / 2**20:.1f} MiB free once every "
                    f"shard not being read is evicted, {floor / 2**20:.1f} MiB kept free",
                )

    def sweep(self) -> int:
        """Delete the temporary files that no live writer holds; returns how many."""
        swept = 0
        for folder in (self.directory, os.path.join(self.directory, KEEP)):
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                if name.startswith(TEMP) and _stale(os.path.join(folder, name), self.directory):
                    swept += 1
        return swept


def _stale(path: str, directory: str) -> bool:
    """Remove `path` if no writer holds it and it has not changed for STALE_S."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < STALE_S or not lock(fd, directory, wait=False):
            return False
        os.remove(path)
        return True
    finally:
        os.close(fd)


def _evict(path: str, directory: str) -> bool:
    """Remove the shard `path` unless a reader pins it (a shared lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        if not lock(fd, directory, wait=False):
            return False
        os.remove(path)
        return True
    finally:
        os.close(fd)


def _owner(path: str) -> str:
    try:
        import pwd

        return pwd.getpwuid(os.stat(path).st_uid).pw_name
    except (ImportError, KeyError, OSError):
        return "another user"


def local_path(
    remote: str,
    sha256: str,
    listed_in: str = "index.json",
    fix: str = REPLACED_FIX,
    keep: bool = False,
) -> str:
    """The local file of `remote` (itself when local) in this process's node cache."""
    if not fs.is_remote(remote):
        return remote
    return NodeCache().local_path(remote, sha256, keep, listed_in, fix)
