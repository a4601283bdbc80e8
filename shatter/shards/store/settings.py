"""Where the object store is and how long a call may wait on it, and where this node caches what
it fetched: `StoreSettings`, one per process (`configure`, `current`), inherited by the DataLoader
workers it forks. The one piece of process state of the store: shards are opened deep inside the
loader, which cannot be handed a settings object through every layer.

The endpoint and region come from the standard AWS environment of each machine
(`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `AWS_REGION` or `AWS_DEFAULT_REGION`) unless given;
credentials not given here are found by botocore itself (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_PROFILE`); `gs://` uses Google's application
default credentials (`GOOGLE_APPLICATION_CREDENTIALS`), `hf://` the Hugging Face token (`HF_TOKEN`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

DEFAULT_RETRY_SECONDS = 120.0
DEFAULT_CACHE_GB = 50.0


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def default_cache_dir() -> str:
    """`$TMPDIR/shatter-cache-<user>`: one per user of the node (a second user gets their own)."""
    try:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        user = str(os.getuid())
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"shatter-cache-{user}")


@dataclass(frozen=True)
class StoreSettings:
    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    token: str | None = None
    region: str | None = None
    retry_seconds: float = DEFAULT_RETRY_SECONDS  # the longest one store call retries
    cache_dir: str | None = None  # None: `default_cache_dir()`
    cache_limit_gb: float = DEFAULT_CACHE_GB

    @classmethod
    def from_env(cls, **given) -> StoreSettings:
        """The settings `given`, the AWS environment's endpoint and region where not given."""
        given = {k: v for k, v in given.items() if v is not None}
        given.setdefault("endpoint_url", _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
        given.setdefault("region", _env("AWS_REGION", "AWS_DEFAULT_REGION"))
        return cls(**given)

    @property
    def directory(self) -> str:
        return self.cache_dir or default_cache_dir()

    def replace(self, **changes) -> StoreSettings:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


_current: StoreSettings | None = None


def configure(settings: StoreSettings) -> StoreSettings:
    """This process's store settings (and those of the DataLoader workers it forks)."""
    global _current
    _current = settings
    return settings


def current() -> StoreSettings:
    """This process's settings: `configure`d, else the environment's as it is now."""
    return _current if _current is not None else StoreSettings.from_env()
