"""A real S3 server on loopback for the object-store tests (moto's, which speaks the S3 HTTP API):
`s3_server` starts it on a free port of 127.0.0.1 with a bucket `shards`, sets the standard AWS
environment to it, and stops it at the end of the session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.jobs import free_port

BUCKET = "shards"


@dataclass
class S3Server:
    port: int
    server: object

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        """The build's Beam options for this server."""
        return [
            f"--s3_endpoint_url={self.endpoint}",
            "--s3_access_key_id=test",
            "--s3_secret_access_key=test",
            "--s3_region_name=us-east-1",
        ]

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )

    def upload(self, directory, prefix: str) -> str:
        """The files of a local `directory` (a dataset, an export, a corpus) under `prefix` of the
        bucket; returns its `s3://` URL."""
        client = self.client()
        for path in sorted(directory.iterdir()):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        return f"s3://{BUCKET}/{prefix}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        """(Re)start on the same port; the stored objects survive (moto keeps them in-process)."""
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def require_auth(self, on: bool) -> None:
        """With `on`, every request needs credentials that the server issued (none are): the
        wrong-credentials case."""
        import urllib.request

        body = b"0" if on else b"inf"
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth", body, {"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request).read()


@pytest.fixture(scope="session")
def s3_server():
    mp = pytest.MonkeyPatch()
    server = S3Server(free_port(), None)
    server.start()
    for name, value in {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }.items():
        mp.setenv(name, value)
    import logging

    # werkzeug prints a line per request to stderr, which the in-process CLI tests read: its
    # records stay on its own logger (a NullHandler, so it adds no stderr handler of its own),
    # where count_requests can still listen
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.WARNING)
    werkzeug.propagate = False
    if not any(isinstance(h, logging.NullHandler) for h in werkzeug.handlers):
        werkzeug.addHandler(logging.NullHandler())
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()
    mp.undo()


def count_requests(start: str) -> list[str]:
    """The requests to the loopback S3 server (its werkzeug log) that begin with `start`, from now."""
    import logging

    seen: list[str] = []

    class Count(logging.Handler):
        def emit(self, record):
            line = record.getMessage()
            if start in line:
                seen.append(line.split(start, 1)[1].split("?")[0].split(" ")[0])

    logger = logging.getLogger("werkzeug")
    logger.setLevel(logging.INFO)
    logger.addHandler(Count())
    return seen
