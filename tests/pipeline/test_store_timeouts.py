"""Bounded store calls: against a store that accepts connections and never answers, one call
ends within about `store_retry_seconds` (botocore's 60 s read timeout, tried twice, made it take
120 s whatever the bound), with one line naming the object."""

import socket
import threading
import time

import pytest

from shatter.shards.store import configure, current, fs
from shatter.shards.store.errors import StoreError
from shatter.shards.store.settings import call_timeouts


@pytest.fixture
def silent_store():
    """A loopback server that accepts every connection, reads, and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


def test_the_call_timeouts_follow_the_bound():
    assert call_timeouts(4.0) == (1.0, 2.0)
    assert call_timeouts(120.0) == (5.0, 60.0)  # the default bound: botocore's own read timeout


def test_a_silent_store_fails_within_its_bound_in_one_line(silent_store, monkeypatch):
    monkeypatch.setattr("shatter.shards.store.settings._current", None)
    before = current()
    configure(before.replace(endpoint_url=silent_store, key="k", secret="s", retry_seconds=4.0))
    try:
        started = time.monotonic()
        with pytest.raises(StoreError) as err:
            fs.size("s3://bucket/data/train-00000-of-00001.arrow")
        took = time.monotonic() - started
    finally:
        configure(before)
    assert took < 4.0 + 2 * 2.0 + 1.0, f"{took:.1f} s"  # the bound, and the call begun at its end
    assert "train-00000-of-00001.arrow" in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def build_side(silent_store, monkeypatch):
    """`_build_client`, with this process's store settings and Beam's options put back after."""
    pytest.importorskip("apache_beam")
    from apache_beam.io.filesystems import FileSystems

    from shatter.shards.store import settings

    monkeypatch.setattr(settings, "_current", settings._current)
    monkeypatch.setattr(FileSystems, "_pipeline_options", FileSystems._pipeline_options)
    return lambda retry_seconds: _build_client(silent_store, retry_seconds)


def _build_client(endpoint: str, retry_seconds: float):
    """Beam's S3 client of the build with `endpoint` and `--store_retry_seconds` (`configure`d:
    Beam's filesystems in this process use them too)."""
    pytest.importorskip("apache_beam")
    from apache_beam.io.aws.clients.s3 import boto3_client

    from shatter.pipeline import store

    args = [f"--s3_endpoint_url={endpoint}", "--s3_access_key_id=k", "--s3_secret_access_key=s"]
    options = store.configure([*args, f"--store_retry_seconds={retry_seconds}"])
    return boto3_client.Client(options), store


def test_one_build_call_against_a_silent_store_ends_within_its_bound(build_side):
    from apache_beam.io.aws.clients.s3 import messages

    client, store = build_side(4.0)
    started = time.monotonic()
    with pytest.raises(messages.S3ClientError) as err:
        client.get_object_metadata(messages.GetRequest("bucket", "train-00000-of-00001.arrow"))
    took = time.monotonic() - started
    assert took < 4.0, f"{took:.1f} s"  # one try: the read timeout of the bound (2 s), not 60 s
    assert err.value.code is None  # retried by Beam's backoff, as a server's failure
    assert store.failure(err.value).startswith(
        "the object store failed on s3://bucket/train-00000-of-00001.arrow after retrying (Read"
    )


def test_the_build_uploads_keep_a_read_timeout_of_their_own(build_side):
    _, store = build_side(4.0)
    (calls, uploads) = next(v for k, v in store._SHARED_CLIENTS.items() if k[1] == 4.0)
    assert (calls.meta.config.connect_timeout, calls.meta.config.read_timeout) == (1.0, 2.0)
    assert uploads.meta.config.read_timeout == store.UPLOAD_READ_SECONDS


def test_a_retried_build_call_against_a_silent_store_ends_within_its_bound(build_side):
    from apache_beam.io.filesystems import FileSystems

    _, store = build_side(4.0)  # Beam's filesystems use its options
    started = time.monotonic()
    with pytest.raises(Exception) as err:  # noqa: B017 (Beam wraps it in BeamIOError)
        FileSystems.exists("s3://bucket/train-00000-of-00001.arrow")
    took = time.monotonic() - started
    assert took < 4.0 + 2 * 2.0 + 1.0, f"{took:.1f} s"  # 8 tries of 2 s and 4 s of waits: 20 s
    assert "train-00000-of-00001.arrow" in store.failure(err.value)
