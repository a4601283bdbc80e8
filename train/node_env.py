"""The settings every node of a run needs, and the check that each one has them.

The deepspeed launcher starts the other nodes' ranks through pdsh (or ssh, mpirun, srun) and
passes on only the launching shell's PYTHON*, MLFLOW*, MV2*, UCX* and the accelerator's (NCCL*)
variables, plus what `.deepspeed_env` holds (in the launch directory or the home directory;
`DS_ENV_FILE` names another file). The object store's settings (AWS_*), TMPDIR (the node cache's
place) and HF_* reach rank 0's node only, unless the nodes' own shells set them.

`python -m shatter.train.node_env`, run in the launch directory before a launch, appends this shell's
settings to `.deepspeed_env` (secrets excepted). `check_nodes_env` (collective, at start-up)
compares them across ranks: where a rank lacks a setting another has (a node whose shell profile
sets it, another's not), rank 0 adds it to `.deepspeed_env` in the launch directory (secrets
excepted) and every rank stops in one line that says so: the next launch passes them on. A
setting that no rank has (exported only in the launching shell) is not seen here: the store's
own failure then names it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

PREFIXES = ("AWS_", "HF_")
NAMES = ("TMPDIR",)
SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")
# any name with one of these words is a credential too (AWS_SECURITY_TOKEN,
# AWS_CONTAINER_AUTHORIZATION_TOKEN, ...): never written to a file, which pdsh would put on the
# ssh command line of every node
SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "AUTHORIZATION", "PRIVATE")


def is_secret(name: str) -> bool:
    return name in SECRETS or any(word in name.upper() for word in SECRET_WORDS)


def node_settings(environ=None) -> dict[str, str]:
    """The settings of `environ` (this process's) that every node must share."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in NAMES or k.startswith(PREFIXES)}


def env_file() -> Path:
    """The launcher's `.deepspeed_env` of the launch directory (`DS_ENV_FILE` names another)."""
    return Path.cwd() / os.environ.get("DS_ENV_FILE", ".deepspeed_env")


def add_to_env_file(path: Path, settings: dict[str, str]) -> list[str]:
    """Append to `path` the settings (not secrets, not already there) as NAME=VALUE lines, the
    launcher's format; returns the names written. The file is private (it may name a store)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    present = {line.split("=", 1)[0] for line in lines if "=" in line}
    new = [
        k
        for k in sorted(settings)
        if k not in present and not is_secret(k) and "\n" not in settings[k]
    ]
    if new:
        lines += [f"{k}={settings[k]}" for k in new]  # the launcher quotes them itself
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
    return new


def _ranges(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def check_nodes_env() -> None:
    """Collective, at start-up: every rank has the AWS_*, HF_* and TMPDIR settings that any rank
    has, or every rank stops with one line (and rank 0 has written the missing ones to
    `.deepspeed_env`)."""
    import torch.distributed as dist

    from shatter.train.config import ConfigError

    if dist.get_world_size() == 1:
        return
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), node_settings()))
    known: dict[str, tuple[str, int]] = {}  # name -> (value, the first rank that has it)
    for rank, (_, env) in enumerate(views):
        for name, value in env.items():
            known.setdefault(name, (value, rank))
    missing = sorted(k for k in known if any(k not in env for _, env in views))
    if not missing:
        return
    short = [r for r, (_, env) in enumerate(views) if any(k not in env for k in missing)]
    have = sorted({known[k][1] for k in missing})
    path = env_file()
    if dist.get_rank() == 0:
        add_to_env_file(path, {k: known[k][0] for k in missing})
    secrets = [k for k in missing if is_secret(k)]
    written = [k for k in missing if not is_secret(k)]
    fix = f"{', '.join(written)} written to {path}, " if written else ""
    if secrets:
        fix += f"add {', '.join(secrets)} there (or use AWS_PROFILE or an instance role), "
    raise ConfigError(
        f"{', '.join(missing)} set for rank(s) {_ranges(have)} ({views[have[0]][0]}) but not "
        f"for rank(s) {_ranges(short)} ({', '.join(sorted({views[r][0] for r in short}))}): "
        "the deepspeed launcher passes to other nodes only what .deepspeed_env holds (and "
        f"PYTHON*, NCCL*); {fix}then launch again (docs/scale-out.md)"
    )


if __name__ == "__main__":  # before a multi-node launch: this shell's settings, for every node
    names = add_to_env_file(env_file(), node_settings())
    print(f"{env_file()}: {', '.join(names) or 'nothing'} added")
