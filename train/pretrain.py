"""Masked-LM pretraining of the Shatter encoder and its baselines with DeepSpeed.

    deepspeed --num_gpus 8 train/pretrain.py --data OUT --output RUN --config configs/v100x8-base-256.yaml [--preset bert-base]
    python train/pretrain.py --data OUT --output RUN --preset shatter-tiny --config configs/cpu-tiny.yaml

Parse, build, train, close (torchtitan's train.py shape). Running the same command again with the
same --output resumes from the newest checkpoint in RUN/checkpoints; --dry-run prints the resolved
config, the DeepSpeed config, parameter counts and a per-GPU memory estimate without training.
See docs/training.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: its folder (train/) would come first on sys.path and its modules would
    # shadow top-level names; the repository root goes there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import click  # noqa: E402

from pipeline.format import DatasetError, cache, read_index  # noqa: E402
from pipeline.options import click_options  # noqa: E402
from train.config import (  # noqa: E402
    SECTIONS,
    ConfigError,
    PresetError,
    TrainConfig,
    check_output,
    model_overrides,
    resolve,
    schedule_problem,
)

SHAPE_FIELDS = ("arch", "hidden", "layers", "heads", "ffn", "rpe_max_distance", "rab_buckets")


def _check_same_arch(cfg: TrainConfig) -> None:
    """A run directory is resumed only by the model it holds (RUN/config.json says which)."""
    from shatter.config import preset_config

    saved = Path(cfg.run.output) / "config.json"
    try:
        before = json.loads(saved.read_text())["config"]["model"]
        old = preset_config(before["preset"], **(before.get("overrides") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return  # no run there yet (or one too old to say): the checkpoint load decides
    new = preset_config(cfg.model.preset, **cfg.model.overrides)
    diff = [
        f"{k} {getattr(old, k)} -> {getattr(new, k)}"
        for k in SHAPE_FIELDS
        if getattr(old, k) != getattr(new, k)
    ]
    if diff:
        raise ConfigError(
            f"{cfg.run.output} holds a {before['preset']} run ({saved}); --preset "
            f"{cfg.model.preset} differs ({', '.join(diff)}): resume with --preset "
            f"{before['preset']} and its model overrides, or start a new run with another --output"
        )


def start_up_checks(cfg: TrainConfig) -> tuple:
    """Everything that can be refused before a process group, a model or a byte of output exists:
    the paths, the data's files and length, a resumed run's arch; the schedule is warned about.
    Returns (the checked index, the training length)."""
    if not cfg.data.path or not cfg.run.output:
        raise ConfigError(
            "--data and --output are required (or data.path and run.output in --config)"
        )
    check_output(cfg.run.output, directory=True)
    d = cfg.data
    cache.open_store(d.path, d.cache_dir, d.cache_limit_gb, d.store_retry_seconds)
    index = read_index(cfg.data.path)
    index.check_files()
    if cache.is_remote(index.tokenizer):  # exports copy it: its node-local copy
        local = cache.local_path(index.tokenizer, index.tokenizer_sha256)
        index = dataclasses.replace(index, tokenizer=local)
        # the validation shards too, now (they are small): a validation, or the stop that a
        # store failure asks for, then never waits on a store that stopped answering
        for info in index.shards("validation"):
            cache.local_path(index.shard_path(info), info.sha256)
    seq_len = cfg.data.seq_len or index.seq_len
    if seq_len > index.seq_len:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than the data's seq_len {index.seq_len} "
            f"({index.path}); rebuild the shards with --seq-len {seq_len}"
        )
    if index.rows("train") == 0:
        raise DatasetError(f"{index.path}: the train split has 0 rows; rebuild with more text")
    _check_same_arch(cfg)
    rank0 = os.environ.get("RANK", "0") == "0"  # before the process group exists
    if rank0 and (not index.splits.get("validation") or index.rows("validation") == 0):
        click.echo(
            f"no validation data in {index.path}: validation is skipped; rebuild the shards with "
            "`shatter-data build ... --validation-fraction 0.01` to get some",
            err=True,
        )
    problem = schedule_problem(cfg)
    if problem and rank0:
        click.echo(f"warning: {problem}", err=True)
    return index, seq_len


class UsageError(click.ClickException):
    """One line, like every other refusal, but the exit status of a usage error."""

    exit_code = 2


def _run(cfg: TrainConfig) -> int:
    import torch

    import shatter
    from train import checkpoint
    from train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from train.lifecycle import ProgressWatchdog, StopFlag
    from train.loader import StreamPosition
    from train.loop import RunContext, train
    from train.metrics import MetricsWriter

    index, seq_len = start_up_checks(cfg)
    stop = StopFlag().install()
    rank, world = init_distributed(cfg.run.collective_timeout_s)
    run_dir = Path(cfg.run.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.check_shared(run_dir)  # every node must see the same run directory
    ds_config = resolved_deepspeed_config(cfg, world)
    universal = _universal_if_resharded(run_dir, rank, world, ds_config)
    torch.manual_seed(cfg.run.seed)
    # The model is built for the length it is trained at (the paper pretrains BERT_GPU and
    # Shatter_GPU at 256); `shatter-extend` stretches it to 512 or 1024 for finetuning.
    model = shatter.build_model(cfg.model.preset, **model_overrides(cfg, index, seq_len))
    if seq_len > model.config.max_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_len {model.config.max_len}")
    engine = build_engine(model, cfg, ds_config)
    progress = ProgressWatchdog(ProgressWatchdog.limit_for(cfg.run.collective_timeout_s))
    engine.module.register_forward_pre_hook(progress.pet)  # a rank stuck between forwards ends
    state, position, saved_config = checkpoint.resume(engine, run_dir, universal)
    if position is not None:
        StreamPosition.from_dict(
            position, index.rows("train")
        )  # refuses a position on different data
    if rank == 0:
        _record_start(cfg, run_dir, state, saved_config, ds_config, world, seq_len)
    writer = MetricsWriter(run_dir, rank, cfg.run.tensorboard)
    ctx = RunContext(cfg, index, engine, rank, world, run_dir, seq_len, writer, stop)
    try:
        if state.step >= cfg.run.max_steps and not (run_dir / checkpoint.EXPORT).is_dir():
            checkpoint.export(engine, run_dir, checkpoint.latest_tag(run_dir), index.tokenizer)
        status = train(ctx, state) if state.step < cfg.run.max_steps else "complete"
    finally:
        progress.stop()
        writer.close()
    store_failed = cache.take_failure(os.getpid())  # a prefetch's: it stopped the run
    if store_failed and status == "stopped":
        raise DatasetError(
            f"{store_failed}; checkpoint saved at step {state.step} in {run_dir / 'checkpoints'}: "
            "run the same command again to resume once the store answers"
        )
    if rank == 0:
        _say_how_it_ended(status, state, run_dir, engine.device)
    return 0 if status == "complete" else stop.exit_code


def _universal_if_resharded(run_dir: Path, rank: int, world: int, ds_config: dict) -> bool:
    """A checkpoint written by another number of ranks is converted to a universal one (ZeRO's
    partitions re-cut for this world, train/checkpoint.py) and loaded as such; True if so."""
    from train import checkpoint

    saved_world = checkpoint.saved_world_size(run_dir)
    if saved_world is None or saved_world == world:
        return False
    if rank == 0:
        click.echo(
            f"the checkpoint was written by {saved_world} ranks, this run has {world}: "
            "converting it to a universal checkpoint to re-partition it",
            err=True,
        )
    checkpoint.to_universal(run_dir)
    ds_config["checkpoint"] = {"load_universal": True}
    return True


def _record_start(cfg, run_dir: Path, state, saved_config, ds_config, world, seq_len) -> None:
    """Rank 0: what a resume changes (the config, the schedule), metrics.jsonl cut back to the
    checkpoint's step, and RUN/config.json."""
    from train import checkpoint
    from train.metrics import truncate_after

    if saved_config is not None:
        changes = checkpoint.config_changes(saved_config, cfg.to_dict())
        click.echo(
            f"resuming from step {state.step} (sample {state.samples})"
            + (": config changed: " + "; ".join(changes) if changes else ""),
            err=True,
        )
        truncate_after(run_dir / "metrics.jsonl", state.step)
        planned = saved_config["run"]["max_steps"]
        if planned != cfg.run.max_steps and state.step < cfg.run.max_steps:
            click.echo(
                f"--max-steps {planned} -> {cfg.run.max_steps}: from step {state.step} the lr "
                f"follows the schedule of a {cfg.run.max_steps}-step run "
                f"({cfg.optim.decay} after warm-up)",
                err=True,
            )
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "config": cfg.to_dict(),
                "deepspeed": ds_config,
                "world_size": world,
                "seq_len": seq_len,
            },
            indent=2,
        )
        + "\n"
    )


def _say_how_it_ended(status: str, state, run_dir: Path, device) -> None:
    """Rank 0's last line: complete or stopped, at which step, the skips, the GPU memory peak,
    and where the export or the checkpoint is."""
    from train import checkpoint
    from train.metrics import gpu_memory

    where = (
        f"export in {run_dir / checkpoint.EXPORT}"
        if status == "complete"
        else f"checkpoint in {run_dir / 'checkpoints'}; run the same command again to resume"
    )
    memory = gpu_memory(device)
    peak = (
        f"; GPU memory peak {memory['gpu_mem_peak_gb']:.2f} GiB allocated, "
        f"{memory['gpu_mem_reserved_gb']:.2f} GiB reserved"
        if memory
        else ""
    )
    click.echo(
        f"{status}: step {state.step}, {state.skipped_nonfinite} non-finite micro-batches skipped"
        f"{peak}; {where}",
        err=True,
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML config (sections model, data, optim, run).",
)
@click_options(SECTIONS, defaults=False)  # train/config.py: the config fields declared as flags
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print configs, parameter counts and a memory estimate; do not train.",
)
@click.option(
    "--target",
    type=click.Choice(("auto", "gpu")),
    default="auto",
    help="--dry-run for a GPU from any box (its DeepSpeed config and buffers); auto: this one.",
)
@click.option(
    "--local_rank",
    "--local-rank",
    "local_rank",
    type=int,
    hidden=True,
    help="Set by the deepspeed launcher.",
)
def main(config_file, dry_run, target, local_rank, **flags):
    """Pretrain a masked-LM encoder on a shard dataset with DeepSpeed."""
    from train.guard import TrainingError
    from train.lifecycle import process_exit
    from train.plm import with_objective

    with process_exit(known=(ConfigError, DatasetError, TrainingError)):
        try:
            cfg = with_objective(resolve(config_file, flags))
            if dry_run:
                from train.memory import dry_run_report

                click.echo(
                    "dry run: building the model and measuring one micro-batch's activations on "
                    "CPU (41 s for shatter-base on a loaded 2-vCPU box)...",
                    err=True,
                )
                click.echo(dry_run_report(cfg, target))
                return
            code = _run(cfg)
        except PresetError as err:
            raise UsageError(str(err)) from None
        if code:
            sys.exit(code)  # 128 + the signal: the run is not finished; the same command resumes it


if __name__ == "__main__":
    from train.lifecycle import run_cli

    run_cli(main)
