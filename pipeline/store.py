"""Object stores (`s3://`, `gs://`, any scheme that Beam's `FileSystems` knows) for the build,
`inspect`/`verify` and the trainer: the options that reach Beam's filesystems, a check of each
remote path before any work starts, and a bound on how long a call retries a store that is gone.

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

from pipeline.format.schema import DatasetError

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
    this replaces in this process."""
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


def share_s3_clients() -> None:
    """Beam's S3 filesystem makes a new boto3 session and client for every call (exists, open,
    match, ...), each loading botocore's service models again: 0.4 s a call, most of a small
    build's time. Here its clients of the same options share one boto3 client (thread-safe); each
    keeps its own download state."""
    from apache_beam.io.aws.clients.s3 import boto3_client

    cls = boto3_client.Client
    if getattr(cls, "_shatter_shared", False):
        return
    original = cls.__init__

    def init(self, options):
        s3 = options.view_as(S3Options) if isinstance(options, PipelineOptions) else None
        key = tuple(sorted(vars(s3._visible_options).items())) if s3 else None
        shared = _SHARED_CLIENTS.get(key) if key else None
        if shared is None:
            original(self, options)
            if key:
                _SHARED_CLIENTS[key] = self.client
            return
        self.client = shared
        self._download_request = self._download_stream = None
        self._download_pos = 0

    cls.__init__ = init
    cls._shatter_shared = True


def use(options: PipelineOptions) -> None:
    """Beam's filesystems in this process get `options`, and their retries the bound of
    `--store_retry_seconds` (a worker process: the pipeline's options, which it is given)."""
    from apache_beam.io.filesystems import FileSystems

    if FileSystems._pipeline_options is not options:
        FileSystems.set_options(options)
        bound_retries(options.view_as(StoreOptions).store_retry_seconds)
        share_s3_clients()


def configure(args=()) -> PipelineOptions:
    """`use` the options of `args` (`pipeline_options`: the AWS environment's endpoint and
    region where not given). Returns the options."""
    options = pipeline_options(args)
    use(options)
    return options


def _s3_client(options: PipelineOptions):
    """A boto3 client with the pipeline's S3 options that fails fast (the check runs before any
    work: one try, short timeouts), for the precise errors that Beam's wrapper would blur."""
    import boto3
    from botocore.config import Config

    s3 = options.view_as(S3Options)
    return boto3.session.Session().client(
        "s3",
        region_name=s3.s3_region_name,
        endpoint_url=s3.s3_endpoint_url,
        use_ssl=not s3.s3_disable_ssl,
        verify=s3.s3_verify,
        aws_access_key_id=s3.s3_access_key_id,
        aws_secret_access_key=s3.s3_secret_access_key,
        aws_session_token=s3.s3_session_token,
        config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}),
    )


CREDENTIALS_HINT = (
    "check the credentials (--s3_access_key_id and --s3_secret_access_key, or AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY)"
)


def _check_s3(path: str, options: PipelineOptions, must_exist: bool) -> None:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, key = path[len("s3://") :].partition("/")
    client = _s3_client(options)
    where = client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
        if must_exist:
            prefix = key.rstrip("/")
            found = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
            if not found.get("KeyCount"):
                raise DatasetError(f"{path}: no such object or prefix in bucket {bucket} ({where})")
    except NoCredentialsError:
        raise DatasetError(f"{path}: no S3 credentials found; {CREDENTIALS_HINT}") from None
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code", status)
        if status == 404 or code == "NoSuchBucket":
            raise DatasetError(f"{path}: bucket {bucket} does not exist at {where}") from None
        if status in (401, 403):
            raise DatasetError(
                f"{path}: access denied by {where} ({code}); {CREDENTIALS_HINT}"
            ) from None
        raise DatasetError(f"{path}: {where} answered {code}: {e}") from None
    except BotoCoreError as e:
        raise DatasetError(
            f"{path}: cannot reach the S3 endpoint {where} ({e}); check --s3_endpoint_url or "
            "AWS_ENDPOINT_URL"
        ) from None


def check(path: str, options: PipelineOptions | None = None, must_exist: bool = True) -> None:
    """Raise DatasetError (one line) unless `path` can be reached with `options`' credentials:
    its bucket exists and, with `must_exist`, something is stored under it. A local path passes."""
    path = str(path)
    if "://" not in path:  # a local path (`fs.is_remote`: fs imports this module)
        return
    options = options or pipeline_options()
    if path.startswith("s3://"):
        _check_s3(path, options, must_exist)
        return
    # gs:// and other schemes: one listing through Beam (its own errors, its own retries)
    from apache_beam.io.filesystems import FileSystems

    use(options)
    try:
        found = FileSystems.match([FileSystems.join(path, "*")], limits=[1])[0].metadata_list
    except Exception as e:
        raise DatasetError(f"{path}: cannot list it ({type(e).__name__}: {e})") from None
    if must_exist and not found:
        raise DatasetError(f"{path}: nothing is stored under it")


_URL = re.compile(r"""(?:s3|gs)://[^\s'"),]+|https?://[^\s'"),/]+/[^\s'"),]+""")
_STORE_ERRORS = ("S3ClientError", "BeamIOError", "EndpointConnectionError", "GoogleAPICallError")


def failure(e: BaseException) -> str | None:
    """One line for a store call that failed after its retries (the build's and the trainer's):
    the object and the cause, or None if `e` is not a store error."""
    text = str(e)
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
