"""File access for the format: local paths through the standard library, anything with a scheme
(`gs://`, `s3://`, ...) through Beam's `FileSystems`, imported only then, so that the trainer
reads local datasets without Beam installed or imported."""

from __future__ import annotations

import os
import shutil


def is_remote(path: str) -> bool:
    return "://" in str(path)


def _beam():
    from apache_beam.io.filesystems import FileSystems

    if FileSystems._pipeline_options is None:  # none set: the environment's (`pipeline.store`)
        from pipeline import store

        store.configure()
    return FileSystems


def join(root: str, name: str) -> str:
    return _beam().join(str(root), name) if is_remote(root) else os.path.join(str(root), name)


def exists(path: str) -> bool:
    return _beam().exists(path) if is_remote(path) else os.path.exists(path)


def size(path: str) -> int:
    if is_remote(path):
        return _beam().match([path])[0].metadata_list[0].size_in_bytes
    return os.path.getsize(path)


def open_read(path: str):
    """A binary file object (uncompressed: Beam would otherwise guess from the extension)."""
    if is_remote(path):
        return _beam().open(path, compression_type="uncompressed")
    return open(path, "rb")


def create(path: str):
    """A binary file object for writing; the parent directory exists (local) or is implicit."""
    if is_remote(path):
        return _beam().create(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    return open(path, "wb")


def rename(src: str, dst: str) -> None:
    """Atomic on a local filesystem (os.replace); Beam's copy-and-delete elsewhere."""
    if is_remote(src):
        _beam().rename([src], [dst])
    else:
        os.replace(src, dst)


def delete(path: str) -> None:
    if is_remote(path):
        _beam().delete([path])
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
