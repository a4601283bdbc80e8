"""The build's side of object storage (`s3://`, `gs://`, any scheme that Beam's `FileSystems`
knows): the command line's options reach Beam's filesystems and the format's store
(`shatter.shards.store`, which the trainer uses without Beam), a check of each remote path before
any work starts, and a bound on how long a Beam call retries a store that is gone.

Credentials and the endpoint come from the command line's Beam options (`--s3_endpoint_url`,
`--s3_access_key_id`, `--s3_secret_access_key`, `--s3_region_name`, ... for S3; GCS's
application default credentials for `gs://`) and, where none are given, from the standard
environment of each machine (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_PROFILE`, `AWS_REGION`, `GOOGLE_APPLICATION_CREDENTIALS`). Imported only for remote paths.
"""

from __future__ import annotations

import logging
import os
import re
import time

from apache_beam.options.pipeline_options import PipelineOptions, S3Options
from apache_beam.utils import retry

# Beam retries a failing store call 7 times, waiting 5 s and doubling (with up to half of each
# wait taken off at random): at most 5 * (2**7 - 1) s in all (apache_beam.utils.retry)
BEAM_BACKOFF_SECONDS = 5.0 * (2**7 - 1)
DEFAULT_RETRY_SECONDS = 120.0


# S3 options that the standard AWS environment gives where the command line does not (boto3 reads
# the credentials, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, from
# the environment of each machine itself: they never travel in the pipeline's options)
S3_ENVIRONMENT = {
    "s3_endpoint_url": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "s3_region_name": ("AWS_REGION", "AWS_DEFAULT_REGION"),
}


def pipeline_options(args=()):
    """Beam `PipelineOptions` of `args` (the command line's options beyond ours: `--s3_*`, GCS's
    `--project`, ...), with the S3 endpoint and region of the AWS environment where not given."""
    options = PipelineOptions(list(args))
    s3 = options.view_as(S3Options)
    for name, variables in S3_ENVIRONMENT.items():
        if getattr(s3, name) is None:
            setattr(s3, name, next((os.environ[v] for v in variables if os.environ.get(v)), None))
    return options


class StoreOptions(PipelineOptions):
    """`--store_retry_seconds`: how long one call may wait on a store that does not answer."""

    @classmethod
    def _add_argparse_args(cls, parser):
        parser.add_argument(
            "--store_retry_seconds",
            type=float,
            default=DEFAULT_RETRY_SECONDS,
            help="the longest that one object-store call retries (with exponential backoff) "
            "before the build fails naming the object",
        )


def bound_retries(seconds: float) -> None:
    """Scale Beam's exponential backoff so that one store call waits at most `seconds` in all
    (its default would wait up to ten minutes per call, which reads as a hang). Beam's retrying
    calls share one default clock (`with_exponential_backoff`'s `clock` argument), whose sleep
    this replaces in this process. Upstream: no apache/beam issue for the filesystems' backoff as
    of 2026-11-27; closest, for BigQuery's: https://github.com/apache/beam/issues/19876."""
    clock = retry.with_exponential_backoff.__defaults__[4]
    scale = max(seconds, 0.0) / BEAM_BACKOFF_SECONDS
    clock.sleep = lambda value: time.sleep(value * scale)
    # its log line per retry (a traceback, and its unscaled wait) and its S3 reader's error on
    # the root logger: the failure is reported once, as one line, by whoever called
    logging.getLogger("apache_beam.utils.retry").setLevel(logging.ERROR)
    root = logging.getLogger()
    if not any(isinstance(f, _DropS3ReadErrors) for f in root.filters):
        root.addFilter(_DropS3ReadErrors())


class _DropS3ReadErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("HTTP error while requesting file")


_SHARED_CLIENTS: dict = {}
# the methods of Beam's S3 client (2.77) that its s3io calls without its retry decorator
UNRETRIED = ("get_range", "create_multipart_upload", "upload_part", "complete_multipart_upload")


def share_s3_clients() -> None:
    """Beam's S3 filesystem makes a new boto3 session and client for every call (exists, open,
    match, ...), each loading botocore's service models again: 0.4 s a call, most of a small
    build's time. Here its clients of the same options share one boto3 client (thread-safe); each
    keeps its own download state. That client tries each call once: Beam's backoff, bounded by
    `bound_retries`, is the one retry loop (botocore's own beneath it, 5 tries a call with waits
    of up to 8 s, made a build whose store had stopped report it after about a minute with
    `--store_retry_seconds 1`). The calls Beam does not retry itself (`UNRETRIED`: its
    downloads' ranges, its uploads' parts) get that same backoff here. Upstream: no apache/beam
    issue for either (a client per call, the unretried calls) as of 2026-11-27."""
    from apache_beam.io.aws.clients.s3 import boto3_client

    cls = boto3_client.Client
    if getattr(cls, "_shatter_shared", False):
        return
    original = cls.__init__

    def init(self, options):
        if not isinstance(options, PipelineOptions):
            original(self, options)
            return
        s3 = options.view_as(S3Options)
        key = tuple(sorted(vars(s3._visible_options).items()))
        if key not in _SHARED_CLIENTS:
            _SHARED_CLIENTS[key] = _one_try_client(s3)
        self.client = _SHARED_CLIENTS[key]
        self._download_request = self._download_stream = None
        self._download_pos = 0
        backoff = retry.with_exponential_backoff(
            retry_filter=retry.retry_on_server_errors_and_timeout_filter
        )
        for name in UNRETRIED:
            setattr(self, name, backoff(getattr(self, name)))

    cls.__init__ = init
    cls._shatter_shared = True


def _one_try_client(s3: S3Options):
    """The boto3 client that Beam's would make for `s3`
    (apache_beam.io.aws.clients.s3.boto3_client), trying each call once."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        service_name="s3",
        region_name=s3.s3_region_name,
        api_version=s3.s3_api_version,
        use_ssl=not s3.s3_disable_ssl,
        verify=s3.s3_verify,
        endpoint_url=s3.s3_endpoint_url,
        aws_access_key_id=s3.s3_access_key_id,
        aws_secret_access_key=s3.s3_secret_access_key,
        aws_session_token=s3.s3_session_token,
        config=Config(retries={"total_max_attempts": 1}),
    )


def use(options: PipelineOptions) -> None:
    """Beam's filesystems in this process get `options`, and their retries the bound of
    `--store_retry_seconds` (a worker process: the pipeline's options, which it is given)."""
    from apache_beam.io.filesystems import FileSystems

    if FileSystems._pipeline_options is not options:
        from shatter.shards import store as format_store

        FileSystems.set_options(options)
        format_store.configure(_settings(options))
        bound_retries(options.view_as(StoreOptions).store_retry_seconds)
        share_s3_clients()


def configure(args=()) -> PipelineOptions:
    """`use` the options of `args` (`pipeline_options`: the AWS environment's endpoint and
    region where not given). Returns the options."""
    options = pipeline_options(args)
    use(options)
    return options


def _settings(options: PipelineOptions):
    """The format's store settings of Beam's S3 options and `--store_retry_seconds`."""
    from shatter.shards.store import StoreSettings

    s3 = options.view_as(S3Options)
    return StoreSettings.from_env(
        endpoint_url=s3.s3_endpoint_url,
        key=s3.s3_access_key_id,
        secret=s3.s3_secret_access_key,
        token=s3.s3_session_token,
        region=s3.s3_region_name,
        retry_seconds=options.view_as(StoreOptions).store_retry_seconds,
    )


def check(path: str, options: PipelineOptions | None = None, must_exist: bool = True) -> None:
    """Raise StoreError (one line) unless `path` can be reached with `options`' credentials:
    its bucket exists and, with `must_exist`, something is stored under it. A local path passes."""
    from shatter.shards import store as format_store

    if "://" not in str(path):
        return
    use(options or pipeline_options())
    format_store.check(str(path), must_exist)


_URL = re.compile(r"""(?:s3|gs)://[^\s'"),]+|https?://[^\s'"),/]+/[^\s'"),]+""")
_STORE_ERRORS = ("S3ClientError", "BeamIOError", "EndpointConnectionError", "GoogleAPICallError")


def failure(e: BaseException) -> str | None:
    """One line for a store call that failed after its retries (the build's and the trainer's):
    the object and the cause, or None if `e` is not a store error."""
    text = str(e)
    ours = re.search(r"the object store failed on \S+ after retrying \(.*\)", text)
    if ours:  # the format's store (`StoreError`), raised in a worker and wrapped by the runner
        return ours.group(0)
    if not any(name in f"{type(e).__name__} {text}" for name in _STORE_ERRORS):
        return None
    found = _URL.search(text)
    if not found:
        return None
    name = found.group(0)
    if name.startswith("http"):  # the endpoint's URL of an object: http://host/bucket/key
        name = "s3://" + name.split("://", 1)[1].split("/", 1)[1]
    cause = text.strip().splitlines()[-1]
    inner = re.search(r"""\(['"](.+?)['"], (?:None|\d+)\)""", cause)  # S3ClientError(message, code)
    cause = re.sub(r"\s*\[while running [^\]]*\]", "", inner.group(1) if inner else cause)
    cause = re.sub(r"\s+", " ", cause).strip()[:300]
    return f"the object store failed on {name} after retrying ({cause})"
