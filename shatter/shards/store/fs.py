"""File access for the format: local paths through the standard library, URLs (`s3://`, `gs://`,
`hf://`, any scheme fsspec knows) through fsspec (s3fs, gcsfs, huggingface_hub's HfFileSystem),
imported only then. No Apache Beam: a training node reads remote datasets without it.

Each remote call retries a store that does not answer, with exponential backoff, for at most
the settings' `retry_seconds` in all, then raises one StoreError line naming the object; a
missing object (FileNotFoundError) or a refusal (PermissionError) is not retried.
"""

from __future__ import annotations

import io
import os
import shutil
import time

from shatter.shards.store.errors import StoreError, store_failed
from shatter.shards.store.settings import current

NOT_RETRIED = (FileNotFoundError, PermissionError, IsADirectoryError, StoreError, ImportError)
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub"}


def is_remote(path: str) -> bool:
    return "://" in str(path)


def _filesystem(protocol: str):
    """The fsspec filesystem of `protocol` with this process's settings (fsspec keeps one
    instance per set of arguments, and makes new ones after a fork)."""
    import fsspec

    s = current()
    kwargs: dict = {}
    if protocol == "s3":
        kwargs = dict(
            endpoint_url=s.endpoint_url,
            key=s.key,
            secret=s.secret,
            token=s.token,
            use_listings_cache=False,
            client_kwargs={"region_name": s.region} if s.region else {},
            # one try per call, short timeouts: `_retrying` bounds the retries in time
            config_kwargs={
                "retries": {"max_attempts": 1},
                "connect_timeout": 5,
                "read_timeout": 60,
            },
        )
    try:
        fs = fsspec.filesystem(protocol, **kwargs)
    except ImportError as e:
        package = PACKAGES.get(protocol, e.name or protocol)
        raise StoreError(
            f"{protocol}:// paths need the {package} package: pip install {package}"
        ) from None
    if protocol == "s3":
        fs.retries = 1
    return fs


def _split(url: str):
    protocol = str(url).split("://", 1)[0]
    return _filesystem(protocol), str(url)


def _retrying(url: str, call, *args):
    """`call(*args)`, retried with backoff (0.2 s, doubling, at most 10 s a wait) while the
    store fails, for at most `retry_seconds`; then one StoreError line naming `url`."""
    deadline, wait = time.monotonic() + current().retry_seconds, 0.2
    while True:
        try:
            return call(*args)
        except NOT_RETRIED:
            raise
        except Exception as err:  # the store's own types: botocore's, aiohttp's, google's, ...
            if time.monotonic() + wait > deadline:
                raise store_failed(url, err) from None
            time.sleep(wait)
            wait = min(wait * 2, 10.0)


def join(root: str, name: str) -> str:
    if is_remote(root):
        return str(root).rstrip("/") + "/" + name
    return os.path.join(str(root), name)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, url = _split(path)
    return _retrying(url, fs.exists, url)


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    fs, url = _split(path)
    return int(_retrying(url, fs.size, url))


def listdir(path: str) -> list[str]:
    """The names directly under `path` (a directory or a prefix)."""
    if not is_remote(path):
        return sorted(os.listdir(path))
    fs, url = _split(path)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in _retrying(url, fs.ls, url, False))


class _RemoteReader(io.RawIOBase):
    """A binary reader of one object whose reads retry (`_retrying`), reopening where it was."""

    def __init__(self, url: str):
        super().__init__()
        self.url, self.pos, self._file = url, 0, None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def _open(self):
        if self._file is None:
            fs, url = _split(self.url)
            self._file = fs.open(url, "rb")
            self._file.seek(self.pos)
        return self._file

    def _read(self, n: int) -> bytes:
        try:
            return self._open().read(n)
        except Exception:
            self._drop()  # reopened at `pos` by the next try
            raise

    def read(self, n: int = -1) -> bytes:
        data = _retrying(self.url, self._read, n)
        self.pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 2:
            self.pos = size(self.url) + pos
        else:
            self.pos = pos if whence == 0 else self.pos + pos
        if self._file is not None:
            self._file.seek(self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def _drop(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # a connection already gone: nothing held
                pass
            self._file = None

    def close(self) -> None:
        self._drop()
        super().close()


def open_read(path: str):
    """A binary file object for reading (a remote one retries each read)."""
    if is_remote(path):
        reader = _RemoteReader(str(path))
        _retrying(reader.url, reader._open)  # a missing object: FileNotFoundError, here
        return reader
    return open(path, "rb")


class _RemoteWriter:
    """A binary writer of one object (uploaded as it fills and on close): a failure is one
    StoreError line naming the object."""

    def __init__(self, url: str):
        fs, self.url = _split(url)
        self._file = fs.open(self.url, "wb")

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except Exception as err:
            raise store_failed(self.url, err, retried=False) from None

    def close(self) -> None:
        try:
            self._file.close()
        except Exception as err:
            raise store_failed(self.url, err, retried=False) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create(path: str):
    """A binary file object for writing; the parent directory exists (local) or is implicit."""
    if is_remote(path):
        return _RemoteWriter(str(path))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return open(path, "wb")


def rename(src: str, dst: str) -> None:
    """Atomic on a local filesystem (os.replace); a copy and a delete on an object store."""
    if is_remote(src):
        fs, url = _split(src)
        _retrying(url, fs.mv, url, str(dst))
    else:
        os.replace(src, dst)


def delete(path: str) -> None:
    if is_remote(path):
        fs, url = _split(path)
        if _retrying(url, fs.exists, url):
            _retrying(url, fs.rm, url, True)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
