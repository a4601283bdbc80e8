"""A remote path checked before any work: one line each for missing credentials, an unreachable
endpoint, a missing bucket or prefix, a refusal. One try, short timeouts."""

from __future__ import annotations

from shatter.shards.store import fs
from shatter.shards.store.errors import StoreError
from shatter.shards.store.settings import current

CREDENTIALS_HINT = (
    "check the credentials (--s3_access_key_id and --s3_secret_access_key, or AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY)"
)


def _s3_client():
    """A botocore client with the settings' endpoint and credentials that fails fast, for the
    precise errors (status codes) that a filesystem's wrapper would blur."""
    import botocore.session
    from botocore.config import Config

    s = current()
    return botocore.session.get_session().create_client(
        "s3",
        region_name=s.region or "us-east-1",
        endpoint_url=s.endpoint_url,
        aws_access_key_id=s.key,
        aws_secret_access_key=s.secret,
        aws_session_token=s.token,
        config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}),
    )


def _check_s3(path: str, must_exist: bool) -> None:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    bucket, _, key = path[len("s3://") :].partition("/")
    client = _s3_client()
    where = client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
        if must_exist:
            found = client.list_objects_v2(Bucket=bucket, Prefix=key.rstrip("/"), MaxKeys=1)
            if not found.get("KeyCount"):
                raise StoreError(f"{path}: no such object or prefix in bucket {bucket} ({where})")
    except NoCredentialsError:
        raise StoreError(f"{path}: no S3 credentials found; {CREDENTIALS_HINT}") from None
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code", status)
        if status == 404 or code == "NoSuchBucket":
            raise StoreError(f"{path}: bucket {bucket} does not exist at {where}") from None
        if status in (401, 403):
            raise StoreError(
                f"{path}: access denied by {where} ({code}); {CREDENTIALS_HINT}"
            ) from None
        raise StoreError(f"{path}: {where} answered {code}: {e}") from None
    except BotoCoreError as e:
        raise StoreError(
            f"{path}: cannot reach the S3 endpoint {where} ({e}); check --s3_endpoint_url or "
            "AWS_ENDPOINT_URL"
        ) from None


def check(path: str, must_exist: bool = True) -> None:
    """Raise StoreError (one line) unless `path` can be reached with this process's settings:
    its bucket exists and, with `must_exist`, something is stored under it. A local path passes."""
    path = str(path)
    if not fs.is_remote(path):
        return
    if path.startswith("s3://"):
        _check_s3(path, must_exist)
        return
    try:  # gs://, hf:// and other schemes: one listing
        found = fs.listdir(path) if fs.exists(path) else []
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(f"{path}: cannot list it ({type(e).__name__}: {e})") from None
    if must_exist and not found:
        raise StoreError(f"{path}: nothing is stored under it")
