"""DeepSpeed checkpoints with the data position inside, automatic resume, and the fp32 export.

RUN/checkpoints/step{N:08d}/ is a DeepSpeed checkpoint (engine.save_checkpoint, so model,
optimizer, scheduler, loss scaler and ZeRO partitions) whose client state carries the trainer
state (`TrainState`: step, stream position, counters) and the resolved config. DeepSpeed's
`latest` file names the newest; a run started again with the same --output loads it.

A run resumed on another world size (fewer nodes after a preemption, more later) cannot load
ZeRO's optimizer partitions as they are: rank 0 first converts the checkpoint to DeepSpeed's
universal format (`ds_to_universal`: one fp32 file per parameter and optimizer moment, into
RUN/checkpoints/stepN/universal/), and every rank loads that with `load_universal`, which
re-partitions for the new world. The trainer state and the stream position are global (samples
consumed by all ranks together), so the data continues at the next global sample.

A checkpoint is complete or skipped, never deleted to make a resume work: every rank writes its
files and their sha256 (`latest` is not written by DeepSpeed), then after a barrier rank 0 writes
stepN/manifest.json (world size, ZeRO stage, every file with its size and sha256) and only then
`latest`, both atomically (written beside, then renamed). A resume verifies the newest
checkpoint against its manifest, sizes and checksums. Saves are sequential, so only the newest
can be legitimately incomplete (a kill during its save): it is said in one line and skipped (a
checkpoint whose files disagree with its own manifest, e.g. a bit flip, is moved aside as
RUN/checkpoints/damaged-stepN), and the run resumes from the one before, which is then never
pruned (`PROTECTED`). An older checkpoint that does not match its manifest is damage, not a
kill (a partial copy of the run directory, a bad disk): the run refuses in one line naming the
file. With no usable checkpoint in a run directory that has some, the run refuses to start from
scratch unless `--restart` (which moves the old run's files aside, `set_aside`). The manifest,
not a count of files, gives the world size the partitions were written for.

The export (RUN/export/) is the format of docs/format.md, written by `shatter.save_pretrained`:
consolidated fp32 weights. Under ZeRO (and bf16/fp16) the fp32 master weights live in the
optimizer, so every rank gathers them from the live engine (`fp32_masters`: DeepSpeed's
ZeRO-1/2/3 and bf16 partitions, the fp32 copies of its fp16/bf16 ZeRO-0 wrappers); in plain fp32
without ZeRO the module's own weights are the masters. Nothing is read back from the checkpoint
files, so the export needs no other node's shards.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import shatter
from shatter import safe_load
from shatter.train.engine import skipped_steps

CHECKPOINTS = "checkpoints"
EXPORT = "export"
EXPORT_STEP = "STEP"  # RUN/export/STEP: the checkpoint (stepN) the export was made from


@dataclass
class TrainState:
    """All the trainer needs, besides the engine, to continue exactly."""

    step: int = 0  # optimizer steps done
    samples: int = 0  # global stream position: samples consumed by all ranks
    skipped_nonfinite: int = 0  # micro-batches whose loss was NaN/inf, skipped on every rank
    window_loss: float = 0.0  # sum of micro-batch losses since the last metrics line
    window_micro: int = 0  # micro-batches in that sum
    tokens: int = 0  # non-padding tokens consumed by all ranks

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_shared(run_dir: Path) -> None:
    """Collective, at start-up: every rank must see the run directory rank 0 writes in. Only rank
    0 writes `latest`, config.json and the export (reading every rank's ZeRO shards), so on
    node-local disks the other nodes would start afresh while node 0 resumes. Rank 0 writes a
    nonce there; after a broadcast (a barrier) every rank reads it back; all stop on any miss."""
    from shatter.train.config import ConfigError

    dist = torch.distributed
    if dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    nonce = [secrets.token_hex(8) if rank == 0 else None]
    if rank == 0:
        (run_dir / f".shared-check-{nonce[0]}").write_text(nonce[0])
    dist.broadcast_object_list(nonce, src=0)
    probe = run_dir / f".shared-check-{nonce[0]}"
    seen = False
    for _ in range(5):  # a network file system may show a new file a moment late
        try:
            seen = probe.read_text() == nonce[0]
        except OSError:
            seen = False
        if seen:
            break
        time.sleep(0.5)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rank, socket.gethostname(), seen))
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [f"{r} ({host})" for r, host, ok in views if not ok]
    if blind:
        raise ConfigError(
            f"the run directory {run_dir} is not shared: rank(s) {', '.join(blind)} cannot "
            f"read what rank 0 ({views[0][1]}) wrote there; --output must be one directory "
            "shared by every node at the same path (NFS, Lustre, a FUSE mount), not a "
            "node-local disk"
        )


def tag(step: int) -> str:
    return f"step{step:08d}"


MANIFEST = "manifest.json"  # RUN/checkpoints/stepN/manifest.json: written last, the save's proof
LATEST = "latest"


def latest_tag(run_dir: Path) -> str | None:
    latest = run_dir / CHECKPOINTS / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` or what it held before, whatever kills the process: written beside,
    flushed to the disk, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _own_files(step_dir: Path, rank: int) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of the files of `step_dir` that `rank` wrote: its ZeRO
    partitions (`*zero_pp_rank_R_*`); rank 0 also the rest (model states). Each rank hashes its
    own files, side by side with the others."""
    from shatter.shards.reader import sha256_file

    files = {}
    for path in step_dir.iterdir():
        if not path.is_file() or path.name.startswith("."):
            continue
        owner = re.search(r"zero_pp_rank_(\d+)_", path.name)
        if (int(owner.group(1)) if owner else 0) == rank:
            files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(str(path))}
    return files


def save(
    engine, run_dir: Path, state: TrainState, config: dict, data_position: dict, keep: int
) -> str:
    """Collective: every rank calls it. Returns the tag written. Every rank's files, a barrier,
    then rank 0's manifest and `latest`: a kill at any point leaves the previous checkpoint the
    newest complete one."""
    name = tag(state.step)
    step_dir = run_dir / CHECKPOINTS / name
    dist = torch.distributed
    if dist.get_rank() == 0 and step_dir.exists():  # an interrupted save of this step: its files
        shutil.rmtree(step_dir)  # might be another world size's
    dist.barrier()
    client = {
        "train_state": state.to_dict(),
        "data_position": data_position,
        "config": config,
        "model_config": engine.module.config.to_dict(),  # shatter-extend reads the length here
    }
    skipped_steps(engine)  # its device-side count into engine.skipped_steps, which is saved
    try:
        engine.save_checkpoint(
            str(run_dir / CHECKPOINTS), tag=name, client_state=client, save_latest=False
        )
    except (OSError, RuntimeError) as err:
        full = disk_full(err, step_dir, latest_tag(run_dir))
        if full is None:
            raise
        raise full from None
    owned = [None] * dist.get_world_size()
    dist.all_gather_object(owned, _own_files(step_dir, dist.get_rank()))  # also the barrier
    if dist.get_rank() == 0:
        manifest = {
            "tag": name,
            "step": state.step,
            "world_size": dist.get_world_size(),
            "zero_stage": engine.zero_optimization_stage(),
            "files": {k: v for files in owned for k, v in sorted(files.items())},
        }
        write_atomic(step_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        write_atomic(run_dir / CHECKPOINTS / LATEST, name)
        if keep > 0:
            prune(run_dir / CHECKPOINTS, keep)
    dist.barrier()
    return name


def disk_full(err: BaseException, step_dir: Path, newest: str | None) -> Exception | None:
    """`err`, raised while writing `step_dir`, as one line when the disk is full (an ENOSPC, or
    torch's `unexpected pos` from a zip writer that met one); None when it is something else."""
    from shatter.train.config import ConfigError

    usage = shutil.disk_usage(step_dir.parent)
    nospace = getattr(err, "errno", None) == errno.ENOSPC
    if not nospace and usage.free > max(1 << 20, usage.total // 200):
        return None
    return ConfigError(
        f"disk full (ENOSPC) while saving checkpoint {step_dir.name} in {step_dir.parent} "
        f"({usage.free / 2**20:.0f} MiB free of {usage.total / 2**30:.1f} GiB); the newest "
        f"complete checkpoint is still {newest or 'none'}: free space there (or lower "
        "run.keep_checkpoints) and run the same command again to resume"
    )


PROTECTED = ".protected"  # RUN/checkpoints/stepN/.protected: never pruned; the file says why


def step_dirs(directory: Path) -> list[Path]:
    """The checkpoint folders (stepNNNNNNNN) of RUN/checkpoints, oldest first."""
    return sorted(
        p for p in directory.glob("step*") if p.is_dir() and re.fullmatch(r"step\d+", p.name)
    )


def protect(step_dir: Path, why: str) -> None:
    """`step_dir` outlives `keep_checkpoints`: the newest intact checkpoint from before a fault."""
    write_atomic(step_dir / PROTECTED, why + "\n")


def newest_complete(directory: Path, at_most: int) -> Path | None:
    """The newest checkpoint with a manifest whose step is at most `at_most`."""
    done = [p for p in step_dirs(directory) if (p / MANIFEST).is_file()]
    return next((p for p in reversed(done) if int(p.name[4:]) <= at_most), None)


def set_aside_after(directory: Path, step: int, prefix: str) -> None:
    """Checkpoints after `step` renamed `prefix`stepN (kept for a look, never resumed from)."""
    for newer in step_dirs(directory):
        if int(newer.name[4:]) > step:
            os.replace(newer, newer.with_name(prefix + newer.name))


def prune(directory: Path, keep: int) -> None:
    """Remove complete checkpoints older than the newest `keep` complete ones; protected ones
    and any without a manifest (an interrupted save, or one to be looked at) stay."""
    complete = [p for p in step_dirs(directory) if (p / MANIFEST).is_file()]
    for old in complete[:-keep]:
        if not (old / PROTECTED).exists():
            shutil.rmtree(old, ignore_errors=True)


UNIVERSAL = "universal"  # RUN/checkpoints/stepN/universal: stepN re-partitionable


def to_universal(run_dir: Path, name: str) -> Path:
    """Collective: rank 0 converts checkpoint `name` to DeepSpeed's universal format (once: an
    earlier attempt's complete conversion is reused); returns its folder."""
    step_dir = run_dir / CHECKPOINTS / name
    out = step_dir / UNIVERSAL
    if torch.distributed.get_rank() == 0 and not (out / "DONE").is_file():
        import argparse
        import contextlib
        import io

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        shutil.rmtree(out, ignore_errors=True)
        args = argparse.Namespace(
            input_folder=str(step_dir),
            output_folder=str(out),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # the engine's checkpoints carry no universal metadata
        )
        quiet = io.StringIO()  # its progress prints and bars
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            with safe_load.only_weights():
                ds_to_universal(args)
        for extra in (step_dir / "latest_universal",):  # written beside `out`, unused here
            extra.unlink(missing_ok=True)
        (out / "DONE").write_text("")
    torch.distributed.barrier()
    return out


def resume(
    engine, run_dir: Path, name: str | None, universal: bool = False
) -> tuple[TrainState, dict | None, dict | None]:
    """(state, data position, saved config) from checkpoint `name` (`find_resumable`), or a fresh
    state; from its universal conversion (`to_universal`) when `universal` (an engine built with
    `checkpoint.load_universal`)."""
    if name is None:
        return TrainState(), None, None
    load_dir, load_tag = run_dir / CHECKPOINTS, name
    if universal:
        load_dir, load_tag = run_dir / CHECKPOINTS / name, UNIVERSAL
    try:
        with safe_load.only_weights():  # DeepSpeed's loads: weights only, its classes allowed
            path, client = engine.load_checkpoint(str(load_dir), tag=load_tag)
    except safe_load.UnsafeCheckpointError as err:
        from shatter.train.config import ConfigError

        raise ConfigError(str(err)) from None
    except (RuntimeError, KeyError, ValueError) as err:  # e.g. weights of another shape
        from shatter.train.config import ConfigError

        where = run_dir / CHECKPOINTS / name
        lines = [line.strip() for line in str(err).strip().splitlines()] or [type(err).__name__]
        first = next((line for line in lines if "key(s)" in line or "size mismatch" in line), None)
        raise ConfigError(
            f"{where} cannot be resumed by this model ({(first or lines[0])[:300]}); use the "
            "run's own --preset, --seq-len and data, or another --output for a new run"
        ) from None
    if path is None:
        raise RuntimeError(
            f"{run_dir / CHECKPOINTS / name}: DeepSpeed could not load this checkpoint"
        )
    if universal and engine.zero_optimization_stage() == 3:
        from shatter.train.zero3_fix import repair_universal_load

        repair_universal_load(engine.optimizer, load_dir / load_tag)
    scheduler = engine.lr_scheduler
    if scheduler is not None:  # the optimizer's saved lr is the saved schedule's: recompute it
        scheduler.step(scheduler.last_batch_iteration)  # for this run's --max-steps, in place
    return TrainState(**client["train_state"]), client["data_position"], client.get("config")


def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between a checkpoint's config and the current one."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def _wrapper_masters(optimizer) -> dict[int, torch.Tensor]:
    """id(low-precision parameter) -> its fp32 master, for DeepSpeed's fp16/bf16 wrappers without
    ZeRO: FP16_UnfusedOptimizer keeps one fp32 copy per parameter, FP16_Optimizer one flat fp32
    buffer per group."""
    low = getattr(optimizer, "fp16_groups", None) or []
    if hasattr(optimizer, "fp32_groups"):  # FP16_UnfusedOptimizer
        pairs = zip(low, optimizer.fp32_groups)
        return {id(p): m for lows, highs in pairs for p, m in zip(lows, highs)}
    flats = getattr(optimizer, "fp32_groups_flat", None)  # FP16_Optimizer
    masters = {}
    for lows, flat in zip(low, flats or []):
        for p, m in zip(lows, flat.split([p.numel() for p in lows])):
            masters[id(p)] = m.view_as(p)
    return masters


def fp32_masters(engine) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it, in the same order): the module's state dict on the CPU
    with every parameter its fp32 master weight, wherever the optimizer keeps it."""
    from deepspeed.utils import safe_get_full_fp32_param

    module, wrapped = engine.module, None
    params = dict(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict().items():
        p = params.get(key)
        if p is None:  # a buffer: never partitioned
            out[key] = value.detach().float().cpu().clone()
            continue
        master = safe_get_full_fp32_param(p)  # ZeRO-1/2/3, bf16 optimizer: a collective
        if master is None:
            wrapped = _wrapper_masters(engine.optimizer) if wrapped is None else wrapped
            master = wrapped.get(id(p), p)  # fp32 without ZeRO: the parameter is the master
        out[key] = master.detach().float().cpu().clone()
    return out


def export(engine, run_dir: Path, name: str, tokenizer: Path) -> Path | None:
    """Collective (call on every rank after `save` of `name`); rank 0 writes RUN/export atomically."""
    # the engine holds checkpoint `name`'s weights: they are gathered from it, not from the files
    out = run_dir / EXPORT
    state = fp32_masters(engine)
    if torch.distributed.get_rank() == 0:
        model = type(engine.module)(engine.module.config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"mlm_head.word_embeddings.weight"}  # the decoder is the embedding table itself
        if set(missing) - tied or unexpected:
            raise RuntimeError(
                f"export of {name}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        tmp = run_dir / f".{EXPORT}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shatter.save_pretrained(model, tmp, tokenizer=tokenizer)
        (tmp / EXPORT_STEP).write_text(name + "\n")
        old = run_dir / f".{EXPORT}.old"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return out
