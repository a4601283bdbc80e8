"""DeepSpeed checkpoints with the data position inside, automatic resume, and the fp32 export.

RUN/checkpoints/step{N:08d}/ is a DeepSpeed checkpoint (engine.save_checkpoint, so model,
optimizer, scheduler, loss scaler and ZeRO partitions) whose client state carries the trainer
state (`TrainState`: step, stream position, counters) and the resolved config. DeepSpeed's
`latest` file names the newest; a run started again with the same --output loads it.

The export (RUN/export/) is the DESIGN.md format written by `shatter.save_pretrained`:
consolidated fp32 weights. Under ZeRO (and bf16/fp16) the fp32 master weights live in the
optimizer partitions, so they are gathered from the checkpoint files with DeepSpeed's
zero_to_fp32 (which handles ZeRO-1/2/3); in plain fp32 without ZeRO the module's own weights
are the masters.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import shatter

CHECKPOINTS = "checkpoints"
EXPORT = "export"


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


def tag(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(run_dir: Path) -> str | None:
    latest = run_dir / CHECKPOINTS / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def save(
    engine, run_dir: Path, state: TrainState, config: dict, data_position: dict, keep: int
) -> str:
    """Collective: every rank calls it. Returns the tag written."""
    name = tag(state.step)
    client = {
        "train_state": state.to_dict(),
        "data_position": data_position,
        "config": config,
        "model_config": engine.module.config.to_dict(),  # shatter-extend reads the length here
    }
    engine.save_checkpoint(str(run_dir / CHECKPOINTS), tag=name, client_state=client)
    if torch.distributed.get_rank() == 0 and keep > 0:
        prune(run_dir / CHECKPOINTS, keep)
    torch.distributed.barrier()
    return name


def prune(directory: Path, keep: int) -> None:
    tags = sorted(p for p in directory.glob("step*") if p.is_dir())
    for old in tags[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resume(engine, run_dir: Path) -> tuple[TrainState, dict | None, dict | None]:
    """(state, data position, saved config) from the newest checkpoint, or a fresh state."""
    name = latest_tag(run_dir)
    if name is None:
        return TrainState(), None, None
    try:
        path, client = engine.load_checkpoint(str(run_dir / CHECKPOINTS), tag=name)
    except (RuntimeError, KeyError, ValueError) as err:  # e.g. weights of another shape
        from train.config import ConfigError

        where = run_dir / CHECKPOINTS / name
        lines = [line.strip() for line in str(err).strip().splitlines()] or [type(err).__name__]
        added = sorted(
            {
                n
                for m in engine.module.modules()
                for n in getattr(m, "zero_if_missing", ())
                if f'.{n}"' in str(err)
            }
        )
        if added and "Missing key" in str(err):  # weights the arch gained after this run began
            raise ConfigError(
                f"{where} was written before this {engine.module.config.arch} model had "
                f"{', '.join(added)}: a run cannot resume across that change (its optimizer "
                "state has no slot for them); start another --output, or finetune or "
                "shatter-extend its export or checkpoint, which load them at zero"
            ) from None
        first = next((line for line in lines if "key(s)" in line or "size mismatch" in line), None)
        raise ConfigError(
            f"{where} cannot be resumed by this model ({(first or lines[0])[:300]}); use the "
            "run's own --preset, --seq-len and data, or another --output for a new run"
        ) from None
    if path is None:
        raise RuntimeError(
            f"{run_dir / CHECKPOINTS / name}: DeepSpeed could not load this checkpoint"
        )
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


def fp32_state_dict(engine, run_dir: Path, name: str) -> dict:
    """The consolidated fp32 weights of checkpoint `name` (rank 0 only)."""
    module = engine.module
    if engine.zero_optimization_stage() == 0 and not (
        engine.fp16_enabled() or engine.bfloat16_enabled()
    ):
        return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / CHECKPOINTS), tag=name)


def export(engine, run_dir: Path, name: str, tokenizer: Path) -> Path | None:
    """Collective (call on every rank after `save` of `name`); rank 0 writes RUN/export atomically."""
    out = run_dir / EXPORT
    if torch.distributed.get_rank() == 0:
        state = fp32_state_dict(engine, run_dir, name)
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
        (tmp / "STEP").write_text(name + "\n")
        old = run_dir / f".{EXPORT}.old"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return out
