"""Builds to and from object storage, against a real S3 server on loopback (`tests.s3server`):
byte-identical to a local build, inspect and verify on s3://, --overwrite keeping the old dataset
readable, and each fault (wrong credentials, missing bucket or prefix, the server stopping during
a build) as one line before any work or naming the object."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from shatter.pipeline.build import build
from shatter.pipeline.cli import main
from shatter.pipeline.config import InputSpec
from shatter.shards import read_index
from tests.jobs import child_env
from tests.pipeline.corpus import quiet, small_config
from tests.s3server import BUCKET

RETRY = ["--store_retry_seconds=1"]
REPO = Path(__file__).resolve().parents[2]


def shard_hashes(index) -> dict:
    return {s["file"]: s["sha256"] for split in index["splits"].values() for s in split["shards"]}


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output.strip()


@pytest.mark.slow
def test_s3_build_inspect_verify_and_overwrite(built, corpus_dir, s3_server):
    out, local = built
    corpus = s3_server.upload(corpus_dir, "corpus")
    remote = f"s3://{BUCKET}/ds"
    config = small_config([InputSpec("text", corpus)], remote)
    index = build(config, s3_server.args() + RETRY, report=quiet)
    assert shard_hashes(index) == shard_hashes(local)  # the same bytes as the local build
    assert cli("verify", remote, *s3_server.args()) == (0, f"OK {remote}")
    code, text = cli("inspect", remote, "--rows", "1")  # the environment's endpoint and keys
    assert code == 0 and text.startswith(f"dataset {remote}: seq_len 64"), text

    # --overwrite: the old dataset stays readable until the new one is complete
    seen = []

    def report(message):
        if message.startswith("[build done"):
            seen.append(shard_hashes(read_index(remote).raw))

    new = build(small_config([InputSpec("text", corpus)], remote, seed=1), [], True, report)
    assert seen == [shard_hashes(local)]
    assert shard_hashes(new) != shard_hashes(local)
    assert shard_hashes(read_index(remote).raw) == shard_hashes(new)


def stop_when_stored(server, key: str) -> threading.Thread:
    """A thread that stops the server as soon as `key` is stored (i.e. mid-build)."""
    client = server.client()

    def watch():
        for _ in range(1200):
            if client.list_objects_v2(Bucket=BUCKET, Prefix=key).get("KeyCount"):
                server.stop()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_s3_faults_are_one_line(built, corpus_dir, s3_server):
    _, local = built
    corpus = s3_server.upload(corpus_dir, "corpus-faults")
    args = ("build", "--input", corpus, "--vocab-size", "300", "--seq-len", "64")
    # before any work: a missing bucket, a missing input prefix, wrong credentials
    code, text = cli(*args, "--output", "s3://no-bucket/ds")
    assert code == 1 and text == (
        f"shatter-data: error: s3://no-bucket/ds: bucket no-bucket does not exist at "
        f"{s3_server.endpoint}"
    )
    code, text = cli(*args[:2], f"s3://{BUCKET}/missing", *args[3:], "--output", "s3://shards/x")
    assert code == 1 and text == (
        f"shatter-data: error: s3://{BUCKET}/missing: no such object or prefix in bucket "
        f"{BUCKET} ({s3_server.endpoint})"
    )
    s3_server.require_auth(True)
    try:
        code, text = cli("verify", f"s3://{BUCKET}/ds")
    finally:
        s3_server.require_auth(False)
    assert code == 1 and text.startswith(
        f"shatter-data: error: s3://{BUCKET}/ds: access denied by {s3_server.endpoint} (403); "
        "check the credentials"
    ), text

    # the server stops during the build: one line naming the object, no index.json; then a re-run
    # with the server back completes, byte-identical to the local build
    out = f"s3://{BUCKET}/interrupted"
    config = small_config([InputSpec("text", corpus)], out)
    watcher = stop_when_stored(s3_server, "interrupted/tokenizer.model")
    code, text = cli(*args, "--output", out, "--store_retry_seconds", "1", "--num-shards", "3")
    watcher.join()
    s3_server.start()
    last = text.splitlines()[-1]
    assert code == 1 and last.startswith("shatter-data: error: the object store failed on s3:"), (
        text
    )
    assert "ERROR" not in text and f"{out}/" in last
    assert "KeyCount" in s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix="interrupted/")
    assert not s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix="interrupted/index.json")[
        "KeyCount"
    ]
    print(text)
    index = build(config, s3_server.args(), report=quiet)
    assert shard_hashes(index) == shard_hashes(local)


def dask_fleet(root: Path, env: dict):
    """`dask scheduler` and 2 `dask worker` processes, each worker in its own working directory
    with its own TMPDIR, and without the driver's AWS environment: they share no disk with the
    driver or each other, and know the store only from the pipeline's options."""
    root.mkdir(parents=True)
    scheduler_file = root / "scheduler.json"
    dask = str(Path(sys.executable).parent / "dask")
    procs = [
        subprocess.Popen(
            [
                dask,
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                str(scheduler_file),
            ],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    for w in range(2):
        home = root / f"worker{w}"
        (home / "tmp").mkdir(parents=True)
        procs.append(
            subprocess.Popen(
                [
                    dask,
                    "worker",
                    "--scheduler-file",
                    str(scheduler_file),
                    "--nthreads",
                    "1",
                    "--local-directory",
                    str(home),
                    "--no-dashboard",
                    "--host",
                    "127.0.0.1",
                ],
                cwd=home,
                env={**env, "TMPDIR": str(home / "tmp")},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return scheduler_file, procs


@pytest.mark.slow  # a scheduler and two workers start and import Beam
def test_dask_workers_sharing_no_disk_write_the_bytes_of_a_local_build(
    corpus_dir, s3_server, tmp_path
):
    corpus = s3_server.upload(corpus_dir, "corpus-dask")
    env = child_env({k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    scheduler_file, procs = dask_fleet(tmp_path / "fleet", env)
    args = ["build", "--input", corpus, "--vocab-size", "300", "--seq-len", "64"]
    args += ["--dupe-factor", "2", "--num-shards", "3", "--validation-fraction", "0.1"]
    try:
        from distributed import Client

        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            address = client.scheduler.address
        remote = f"s3://{BUCKET}/dask"
        program = subprocess.run(
            [
                sys.executable,
                "-m",
                "shatter.pipeline.cli",
                *args,
                "--output",
                remote,
                "--runner",
                "DaskRunner",
                "--dask_client_address",
                address,
                *s3_server.args(),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env=env,
        )
        assert program.returncode == 0, program.stderr[-3000:]
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    local = tmp_path / "local"  # the same command on the in-process FnApiRunner, to local disk
    code, text = cli(*args, "--output", str(local))
    assert code == 0, text
    assert shard_hashes(read_index(remote).raw) == shard_hashes(read_index(local).raw)
