"""Exports on object storage (`s3://`, `gs://`, `hf://`: any scheme fsspec knows), through the
store's credentials and endpoint (`shatter.shards.store`: the standard AWS environment of each
machine, `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...) and its bounded retries.

- `local_export`: a remote export resolved to a local copy in the node's cache
  (`shatter.shards.store`), which every reader of exports (shatter-extend, finetuning,
  train/evaluate_cli.py) then opens as a local one; `from_pretrained` checks its weights again.
- `check_output` and `upload_export`: shatter-extend's remote `--output`, checked before any
  work and written after the export is complete locally, its `checksums.json` last.

Every failure is one CheckpointError line naming the object.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from shatter.checkpoint import (
    CHECKSUMS,
    CONFIG,
    HEAD,
    TOKENIZER,
    TOKENIZER_JSON,
    WEIGHTS,
    CheckpointError,
)

EXPORT_FILES = (CONFIG, CHECKSUMS, HEAD, TOKENIZER, TOKENIZER_JSON, WEIGHTS)


def is_remote(path: str | Path) -> bool:
    return "://" in str(path)


def _store_failure(e: Exception, remote: str) -> CheckpointError:
    from shatter.shards import DatasetError
    from shatter.shards.store.errors import store_failed

    return CheckpointError(str(e if isinstance(e, DatasetError) else store_failed(remote, e)))


def _no_object(remote: str, export: str) -> CheckpointError:
    return CheckpointError(
        f"{remote}: no such object; {export} is not a shatter export (it needs {WEIGHTS}, "
        f"{CONFIG} and {CHECKSUMS}: upload RUN/export or shatter-extend's --output whole)"
    )


def _read_object(remote: str, required: bool, export: str) -> bytes | None:
    """The bytes of the object `remote` (None when absent and not `required`)."""
    from shatter.shards.store import fs

    try:
        if not fs.exists(remote):
            if not required:
                return None
            raise _no_object(remote, export)
        with fs.open_read(remote) as f:
            return f.read()
    except CheckpointError:
        raise
    except Exception as e:  # a store failure after its retries
        raise _store_failure(e, remote) from None


def local_export(path: str | Path) -> Path:
    """A local export directory for `path`: `path` itself, or for a remote export a copy in the
    node's cache (`shatter.shards.store`: `$TMPDIR/shatter-cache-<user>`), `exports/<digest of its small
    files>/`. Its weights are fetched once per node through the shard cache (a lock, a temporary
    name, their sha256 in `checksums.json` checked on download); `config.json`, `checksums.json`,
    `head.json` and the tokenizer (`tokenizer.model` or `.json`) are read on every call, so a
    changed export is a new copy. Credentials and the endpoint are the store's
    (`shatter.shards.store`: the AWS environment); a missing bucket, prefix or object, or a store
    that fails after its retries, is one CheckpointError line. The cached weights
    (`keep/<sha256>.safetensors`) are never evicted."""
    if not is_remote(path):
        return Path(path)
    from shatter.shards import DatasetError
    from shatter.shards.store import NodeCache, check, current, fs

    remote = str(path).rstrip("/")
    try:
        check(remote)  # credentials, bucket, prefix: one line each, before any download
        files = {}
        for name in (CONFIG, CHECKSUMS, HEAD, TOKENIZER, TOKENIZER_JSON):
            data = _read_object(fs.join(remote, name), name in (CONFIG, CHECKSUMS), remote)
            if data is not None:
                files[name] = data
        try:
            sha256 = json.loads(files[CHECKSUMS])[WEIGHTS]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(
                f"{fs.join(remote, CHECKSUMS)} has no sha256 for {WEIGHTS}; re-export the model"
            ) from None
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(f"{name}\0{len(files[name])}\0".encode() + files[name])
        exports = Path(current().directory) / "exports"
        final = exports / digest.hexdigest()[:32]
        if (final / WEIGHTS).is_file():
            return final
        weights = fs.join(remote, WEIGHTS)
        if not fs.exists(weights):
            raise _no_object(weights, remote)
        cached = NodeCache().local_path(
            weights,
            sha256,
            keep=True,
            listed_in=CHECKSUMS,
            fix=f"upload the export again whole (its {WEIGHTS} and {CHECKSUMS})",
        )
    except DatasetError as e:
        raise CheckpointError(str(e)) from None
    exports.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=exports))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            os.link(cached, tmp / WEIGHTS)  # the cached shard file's inode: no second copy
        except OSError:
            shutil.copyfile(cached, tmp / WEIGHTS)
        try:
            os.rename(tmp, final)
        except OSError:  # another rank of this node put it in place first
            if not (final / WEIGHTS).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def check_output(output: str, overwrite: bool) -> None:
    """A remote `--output`: its bucket reachable (one line each: credentials, bucket), and no
    export under it unless `overwrite`. Run before any work."""
    from shatter.shards import DatasetError
    from shatter.shards.store import check, fs

    try:
        check(output, must_exist=False)
        taken = fs.exists(fs.join(output, CONFIG)) or fs.exists(fs.join(output, WEIGHTS))
    except DatasetError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:
        raise _store_failure(e, output) from None
    if taken and not overwrite:
        raise CheckpointError(f"{output} already holds an export (pass --overwrite to replace it)")


def upload_export(local: Path, output: str) -> None:
    """Copy the export `local` to `output`, `checksums.json` last (until it lands, a reader
    refuses the copy: no checksums, or weights that do not match the old ones), and delete what
    an older export there had beyond it (a `head.json`)."""
    from shatter.shards.store import fs

    names = sorted((p.name for p in local.iterdir() if p.is_file()), key=lambda n: n == CHECKSUMS)
    remote = output.rstrip("/")
    for name in names:
        target = fs.join(remote, name)
        try:
            with open(local / name, "rb") as src, fs.create(target) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except Exception as e:
            raise _store_failure(e, target) from None
    for name in set(EXPORT_FILES) - set(names):
        target = fs.join(remote, name)
        try:
            if fs.exists(target):
                fs.delete(target)
        except Exception as e:
            raise _store_failure(e, target) from None
