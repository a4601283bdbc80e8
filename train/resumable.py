"""Which checkpoint a run resumes from: each verified against its manifest, none ever deleted.

Saves are sequential (train/checkpoint.py), so of a run's checkpoints only the newest can be
legitimately incomplete: a kill during its save leaves it without a manifest. The resume takes
the newest checkpoint whose files match their manifest (each file's size and sha256):

- the newest without a manifest (an interrupted save) is said and skipped; the next save of its
  step replaces it;
- the newest with files that disagree with its manifest (a bit flip, a short copy) is said,
  moved aside as RUN/checkpoints/damaged-stepN (kept for a look, never loaded) and the run
  falls back to the one before, which is then protected from pruning;
- an older checkpoint that does not match its manifest is damage, not a kill (a run directory
  copied while `aws s3 sync` still ran, a bad disk): the run refuses in one line naming the
  file, and touches nothing;
- no usable checkpoint in a run directory that holds some: the run refuses to start from
  scratch, unless `--restart`, which first moves the old run's checkpoints, metrics and
  TensorBoard events aside (`set_aside`), so nothing of it is lost either.

Manifests written before checksums (sizes only) are checked for their sizes; checkpoints
written before manifests are resumed as they are (`_legacy_world`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shatter.train.checkpoint import (
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    latest_tag,
    protect,
    step_dirs,
    write_atomic,
)

DAMAGED = "damaged-"  # RUN/checkpoints/damaged-stepN: a newest checkpoint that failed its manifest
HISTORY = ("checkpoints", "metrics.jsonl", "tensorboard", "export", "config.json")  # not train.log:
# it is open, and says the restart


def manifest_problem(step_dir: Path, checksums: bool = True) -> str | None:
    """Why `step_dir` is not a complete, intact checkpoint (None when it is): a file missing,
    of another size, or (`checksums`) with another sha256 than its manifest says."""
    from shatter.shards.reader import sha256_file

    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest: its save was interrupted"
    except (OSError, ValueError):
        return f"{step_dir / MANIFEST} is not readable"
    for name, want in manifest["files"].items():
        want = want if isinstance(want, dict) else {"bytes": want}  # a manifest of sizes only
        path = step_dir / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes, its manifest says {want['bytes']}"
        if checksums and "sha256" in want and sha256_file(str(path)) != want["sha256"]:
            return f"{path} does not match its sha256 in {MANIFEST} (same size: changed on disk)"
    return None


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run resumes from (`tag` None: none, a fresh start)."""

    tag: str | None = None
    world_size: int | None = None  # of its ZeRO partitions; None: ZeRO-0, or unknown


def _legacy_world(step_dir: Path) -> int | None:
    """The world size of a checkpoint written before manifests: its optimizer files."""
    return len(list(step_dir.glob("*zero_pp_rank_*_optim_states.pt"))) or None


def _refusal(message: str):
    from shatter.train.config import ConfigError

    return ConfigError(message)


def _skip_newest(step_dir: Path, problem: str, say) -> bool:
    """The newest checkpoint is unusable and an older one is intact: an interrupted save stays
    (its step's next save replaces it); one that contradicts its own manifest is moved aside,
    never loaded. True for the latter (damage: the one resumed from is then protected)."""
    if not (step_dir / MANIFEST).exists():
        say(f"checkpoint {step_dir} is incomplete ({problem}): skipped")
        return False
    aside = step_dir.with_name(DAMAGED + step_dir.name)
    os.replace(step_dir, aside)
    say(f"checkpoint {step_dir} is damaged ({problem}): moved aside to {aside}, never loaded")
    return True


def _chosen(step_dir: Path, after_damage: bool, say) -> Resumable:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    if after_damage:
        protect(step_dir, "the newest intact checkpoint when a newer one was found damaged")
        say(f"falling back to the newest intact checkpoint {step_dir.name} (kept from pruning)")
    zero = manifest["zero_stage"] > 0
    return Resumable(step_dir.name, manifest["world_size"] if zero else None)


def choose(run_dir: Path, say) -> Resumable:
    """Rank 0: the newest intact checkpoint (module docstring); raises ConfigError to refuse.
    Nothing is moved unless the run then resumes."""
    directory = run_dir / CHECKPOINTS
    tags = step_dirs(directory)[::-1]
    latest = latest_tag(run_dir)
    newest_problem = None
    for i, step_dir in enumerate(tags):
        problem = manifest_problem(step_dir)
        if problem is None:
            damaged = newest_problem is not None and _skip_newest(tags[0], newest_problem, say)
            return _chosen(step_dir, damaged, say)
        if step_dir.name == latest and not (step_dir / MANIFEST).exists():
            if not any((p / MANIFEST).exists() for p in tags):  # written by an older trainer
                return Resumable(step_dir.name, _legacy_world(step_dir))
        if i == 0:
            newest_problem = problem
            continue
        say(f"checkpoint {tags[0]}, the newest, is unusable too ({newest_problem})")
        raise _refusal(
            f"checkpoint {step_dir} is damaged ({problem}); only the newest checkpoint can "
            "be incomplete, so this is not an interrupted save but a partial copy or a bad "
            f"disk: restore {directory} from a full copy, or run with --restart to start "
            "again from step 0 (the old files are moved aside)"
        )
    if tags:
        raise _refusal(
            f"{directory} has no usable checkpoint ({tags[0]}: {newest_problem}): not starting "
            f"{run_dir} again from step 0 without a word; restore the checkpoints, or run with "
            "--restart to start again from step 0 (the old files are moved aside)"
        )
    return Resumable()


def set_aside(run_dir: Path, say) -> Path | None:
    """Rank 0, for --restart: the old run's files (`HISTORY`) moved to RUN/before-restart-TIME/;
    returns that folder (None when there was nothing to move)."""
    present = [run_dir / name for name in HISTORY if (run_dir / name).exists()]
    if not present:
        return None
    aside = run_dir / time.strftime("before-restart-%Y%m%dT%H%M%SZ", time.gmtime())
    aside.mkdir()
    for path in present:
        os.replace(path, aside / path.name)
    say(f"--restart: the old run's files moved to {aside}; starting from step 0")
    return aside


def find_resumable(run_dir: Path, say=print, restart: bool = False) -> Resumable:
    """Collective: the checkpoint every rank resumes from, chosen by rank 0 (`say`s its lines);
    a refusal of rank 0's is every rank's."""
    dist = torch.distributed
    choice: list = [None]
    if dist.get_rank() == 0:
        try:
            if restart:
                set_aside(run_dir, say)
            choice = [choose(run_dir, say)]
        except Exception as err:  # said by every rank, not only the one that found it
            choice = [err]
    dist.broadcast_object_list(choice, src=0)
    found = choice[0]
    if isinstance(found, Exception):
        raise found
    if dist.get_rank() == 0 and found.tag is not None and latest_tag(run_dir) != found.tag:
        write_atomic(run_dir / CHECKPOINTS / LATEST, found.tag)  # DeepSpeed's tools read it
    return found


def _saved_setup(run_dir: Path, tag: str) -> dict:
    """The settings checkpoint `tag` was written under: its manifest's ZeRO stage, and the
    precision, length and seed of RUN/config.json (the session that wrote it)."""
    saved = {}
    try:
        saved["zero_stage"] = json.loads((run_dir / CHECKPOINTS / tag / MANIFEST).read_text())[
            "zero_stage"
        ]
    except (OSError, ValueError, KeyError):
        pass
    try:
        record = json.loads((run_dir / "config.json").read_text())
        saved["precision"] = record["config"]["run"]["precision"]
        saved["seq_len"] = record["seq_len"]
        saved["seed"] = record["config"]["run"]["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return saved


SETUP_FLAGS = {"zero_stage": "--zero-stage", "precision": "--precision", "seq_len": "--seq-len"}
SETUP_FLAGS["seed"] = "--seed"


def check_same_setup(run_dir: Path, found: Resumable, cfg, ds_config: dict, seq_len: int) -> None:
    """A resume keeps the settings its checkpoint's files and stream depend on: the ZeRO stage
    and the precision (the optimizer's files differ: DeepSpeed failed with an AttributeError or
    a bare AssertionError), the sequence length (the stream's rows and positions) and the seed
    (the stream's order and masks): one line naming each change."""
    if found.tag is None:
        return
    now = {
        "zero_stage": ds_config["zero_optimization"]["stage"],
        "precision": cfg.run.precision,
        "seq_len": seq_len,
        "seed": cfg.run.seed,
    }
    saved = _saved_setup(run_dir, found.tag)
    changed = [
        f"{SETUP_FLAGS[k]} {saved[k]} -> {now[k]}"
        for k in SETUP_FLAGS
        if k in saved and saved[k] != now[k]
    ]
    if changed:
        raise _refusal(
            f"{run_dir / CHECKPOINTS / found.tag} was written with other settings than this "
            f"resume's ({'; '.join(changed)}): its optimizer files and data stream depend on "
            "them; resume with the run's own settings, or start a new run with another --output"
        )
