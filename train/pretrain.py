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

import click

from shatter.options import click_options, command
from shatter.shards import DatasetError, read_index
from shatter.shards.store import is_remote, local_path, open_store
from shatter.train import init_from
from shatter.train.config import (
    SECTIONS,
    ConfigError,
    PresetError,
    TrainConfig,
    check_output,
    data_sources,
    model_overrides,
    resolve,
    schedule_problem,
)
from shatter.train.init_from import SHAPE_FIELDS


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
    Returns (the checked index of the first --data, the training length, and with several
    --data the (index, weight) of each, else None)."""
    if not cfg.data.path or not cfg.run.output:
        raise ConfigError(
            "--data and --output are required (or data.path and run.output in --config)"
        )
    check_output(cfg.run.output, directory=True)
    d = cfg.data
    sources = data_sources(d.path)
    indexes = []
    for path, _ in sources:
        open_store(path, d.cache_dir, d.cache_limit_gb, d.store_retry_seconds)
        indexes.append(read_index(path))
        indexes[-1].check_files()
        indexes[-1].check_vocabulary()
        if indexes[-1].rows("train") == 0:
            raise DatasetError(
                f"{indexes[-1].path}: the train split has 0 rows; rebuild with more text"
            )
    check_one_vocabulary(indexes)
    index = indexes[0]  # its tokenizer goes into the exports, its validation split is the run's
    if is_remote(index.tokenizer):  # exports copy it: its node-local copy, never evicted
        local = local_path(index.tokenizer, index.tokenizer_sha256, keep=True)
        index = dataclasses.replace(index, tokenizer=local)
        # the validation shards too, now (they are small), never evicted: a validation, or the
        # stop that a store failure asks for, then never waits on a store that stopped answering
        for info in index.shards("validation"):
            local_path(index.shard_path(info), info.sha256, keep=True)
    # the shortest build's length by default; a longer build's rows are cut to it (each mixed
    # dataset by its own L // l, `shatter.train.loader.mix`)
    seq_len = cfg.data.seq_len or min(ix.seq_len for ix in indexes)
    for ix in indexes:
        if seq_len > ix.seq_len:
            raise ConfigError(
                f"--seq-len {seq_len} is longer than the data's seq_len {ix.seq_len} "
                f"({ix.path}); rebuild the shards with --seq-len {seq_len}"
            )
    _check_same_arch(cfg)
    check_model_vocabulary(cfg, index)
    if cfg.run.init_from:
        init_from.check(cfg, index, seq_len)
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
    mix = [(ix, w) for ix, (_, w) in zip(indexes, sources)] if len(indexes) > 1 else None
    return index, seq_len, mix


def check_model_vocabulary(cfg: TrainConfig, index) -> None:
    """A model's vocab_size set in the config (model.overrides) holds every id of the data."""
    size = cfg.model.overrides.get("vocab_size")
    if size is not None and int(size) < index.vocab_size:
        raise ConfigError(
            f"model.overrides vocab_size {size} is smaller than the data's vocab_size "
            f"{index.vocab_size} ({index.path}): remove it from the config, or set it to "
            f"{index.vocab_size} or more"
        )


def check_one_vocabulary(indexes: list) -> None:
    """Datasets mixed in one run must share their tokenizer: the same id is the same token."""
    first = indexes[0]
    for other in indexes[1:]:
        if other.tokenizer_sha256 != first.tokenizer_sha256:
            raise DatasetError(
                f"{other.path}: its tokenizer (vocab {other.vocab_size}, sha256 "
                f"{other.tokenizer_sha256[:12]}) is not {first.path}'s (vocab {first.vocab_size}, "
                f"sha256 {first.tokenizer_sha256[:12]}): datasets mixed by --data share one "
                f"vocabulary; rebuild it with `shatter-data build --tokenizer {first.tokenizer}`"
                + (
                    " (or --hf-tokenizer for a tokenizer.json)"
                    if first.tokenizer.endswith(".json")
                    else ""
                )
            )


def _initial_model(cfg: TrainConfig, index, seq_len: int):
    """The model the run starts from: the preset's fresh weights, or --init-from's (built at the
    export's max_len, which is at least the training length); `torch.compile`d with run.compile."""
    import torch

    import shatter

    overrides = model_overrides(cfg, index, seq_len)
    export = None
    if cfg.run.init_from:
        export, saved = init_from.check(cfg, index, seq_len)
        overrides["max_len"] = saved.max_len
    model = shatter.build_model(cfg.model.preset, **overrides)
    if seq_len > model.config.max_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_len {model.config.max_len}")
    if export is not None:
        init_from.load_weights(model, export)
    from shatter.train.compiling import compile_model, wants_compile

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and cfg.run.precision == "fp16":
        _keep_rows_where_they_fit(model, cfg, seq_len)
    if wants_compile(cfg.run.compile, device_type, cfg.run.zero_stage):
        compile_model(model)
    return model


def _keep_rows_where_they_fit(model, cfg: TrainConfig, seq_len: int) -> None:
    """`auto` resolved to `rows-keep` in the partition layers where it pays and its kept W fits
    a tenth of this GPU's memory (shatter.attention.single_head): every rank's choice, rank 0's
    line (stderr and RUN/train.log)."""
    import torch

    from shatter.attention.impls import KEEP_SHARE
    from shatter.attention.single_head import keep_rows_where_they_fit
    from shatter.train.metrics import log

    gpu = torch.cuda.get_device_properties(torch.cuda.current_device())
    batch = cfg.run.micro_batch
    kept = keep_rows_where_they_fit(
        model, batch, seq_len, torch.float16, (gpu.major, gpu.minor), gpu.total_memory
    )
    if kept and torch.distributed.get_rank() == 0:
        line = (
            f"attention_impl auto: rows-keep on this sm_{gpu.major}{gpu.minor} at {batch} x "
            f"{seq_len}: W kept from the forward ({kept / 2**30:.2f} GiB, at most "
            f"{KEEP_SHARE:.0%} of the GPU's memory); set model.overrides.attention_impl to "
            "keep another"
        )
        click.echo(line, err=True)
        log.info("%s", line)


def compiled_run(ctx, state) -> str:
    """train(), with a failure of torch.compile's first compilation as one line."""
    from torch._dynamo.exc import TorchDynamoException

    from shatter.train.compiling import one_line
    from shatter.train.loop import TrainingError, train

    try:
        return train(ctx, state)
    except TorchDynamoException as err:
        raise TrainingError(one_line(err)) from None


class UsageError(click.ClickException):
    """One line, like every other refusal, but the exit status of a usage error."""

    exit_code = 2


def _run(cfg: TrainConfig, restart: bool = False) -> int:
    import torch

    from shatter.train import budget, checkpoint, resumable
    from shatter.train.engine import (
        build_engine,
        deepspeed_schedule,
        init_distributed,
        resolved_deepspeed_config,
    )
    from shatter.train.launcher_watch import watch_launcher
    from shatter.train.lifecycle import ProgressWatchdog, StopFlag, hold_run_directory
    from shatter.train.loader import StreamPosition, stream_shape
    from shatter.train.loop import RunContext
    from shatter.train.metrics import MetricsWriter, log_to_run
    from shatter.train.node_env import check_nodes_env
    from shatter.train.schedule import Plan

    index, seq_len, mix = start_up_checks(cfg)
    ceiling = cfg.run.max_steps  # a budgeted run's plan never goes past --max-steps
    cfg = budget.planned_config(cfg, Path(cfg.run.output))  # a resumed budgeted run's length
    stop = StopFlag().install()
    watch_launcher(stop)  # the runner's death (docker stop, Kubernetes) stops with a save
    rank, world = init_distributed(cfg.run.collective_timeout_s)
    check_nodes_env()  # the store's settings, TMPDIR and HF_* on every node
    run_dir = Path(cfg.run.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_run_directory(run_dir, rank)  # noqa: F841 (held until the process ends)
    log_to_run(run_dir, rank)  # RUN/train.log
    stop.log_to(run_dir / "train.log")  # every rank's stop cause
    checkpoint.check_shared(run_dir)  # every node must see the same run directory
    ds_config = resolved_deepspeed_config(cfg, world)
    say = lambda line: click.echo(line, err=True)  # noqa: E731
    found = resumable.find_resumable(run_dir, say, restart)
    resumable.check_same_setup(run_dir, found, cfg, ds_config, seq_len)  # before DeepSpeed's load
    universal = _universal_if_resharded(run_dir, rank, world, ds_config, found)
    torch.manual_seed(cfg.run.seed)
    # The model is built for the length it is trained at (the paper pretrains BERT_GPU and
    # Shatter_GPU at 256); `shatter-extend` stretches it to 512 or 1024 for finetuning.
    model = _initial_model(cfg, index, seq_len)
    plan = None
    if not deepspeed_schedule(cfg):
        o = cfg.optim
        plan = Plan(o.decay, max(2, o.warmup_steps), cfg.run.max_steps, o.cooldown)
    # a budgeted run's clock and plan, before the resume recomputes the lr from the plan
    run_budget = budget.Budget(cfg, plan, run_dir, rank, world) if cfg.run.budget_hours else None
    engine = build_engine(model, cfg, ds_config, plan)
    progress = ProgressWatchdog(ProgressWatchdog.limit_for(cfg.run.collective_timeout_s))
    # a rank stuck between forwards ends; on the engine, never compiled, so that the hook runs
    # outside a compiled model's graph (Dynamo would warn it cannot trace time.monotonic)
    engine.register_forward_pre_hook(progress.pet)
    state, position, saved_config = checkpoint.resume(engine, run_dir, found.tag, universal)
    if position is not None:  # refuses a position on different data
        StreamPosition.from_dict(position, *stream_shape(index, mix, seq_len))
    if rank == 0:
        _record_start(cfg, run_dir, state, saved_config, ds_config, world, seq_len)
    writer = MetricsWriter(run_dir, rank, cfg.run.tensorboard, resumed_step=state.step)
    ctx = RunContext(
        cfg, index, engine, rank, world, run_dir, seq_len, writer, stop, budget=run_budget, mix=mix,
        budget_ceiling=ceiling,
    )  # fmt: skip
    try:
        if state.step >= cfg.run.max_steps and not (run_dir / checkpoint.EXPORT).is_dir():
            checkpoint.export(engine, run_dir, found.tag, index.tokenizer)
        status = compiled_run(ctx, state) if state.step < cfg.run.max_steps else "complete"
    finally:
        progress.stop()
        writer.close()
    if ctx.store_failure and status == "stopped":  # a loader's, in-band: it stopped the run
        raise DatasetError(
            f"{ctx.store_failure}; checkpoint saved at step {state.step} in "
            f"{run_dir / 'checkpoints'}: run the same command again to resume once the store answers"
        )
    if rank == 0:
        _say_how_it_ended(status, state, run_dir, engine.device)
    return 0 if status == "complete" else stop.exit_code


def _universal_if_resharded(run_dir: Path, rank: int, world: int, ds_config: dict, found) -> bool:
    """The newest complete checkpoint (`found`, its manifest), when written by another number of
    ranks, is converted to a universal one (ZeRO's partitions re-cut for this world,
    train/checkpoint.py) and loaded as such; True if so."""
    from shatter.train import checkpoint

    if found.world_size is None or found.world_size == world:
        return False
    if ds_config["zero_optimization"]["stage"] == 3:
        from shatter.train.zero3_fix import check_version

        check_version()
    if rank == 0:
        click.echo(
            f"the checkpoint was written by {found.world_size} ranks, this run has {world}: "
            "converting it to a universal checkpoint to re-partition it",
            err=True,
        )
    checkpoint.to_universal(run_dir, found.tag)
    ds_config["checkpoint"] = {"load_universal": True}
    return True


def _record_start(cfg, run_dir: Path, state, saved_config, ds_config, world, seq_len) -> None:
    """Rank 0: what a resume changes (the config, the schedule), metrics.jsonl cut back to the
    checkpoint's step, and RUN/config.json."""
    from shatter.train import checkpoint

    if cfg.run.init_from:
        _say_init_from(cfg, state)
    if saved_config is not None:
        changes = checkpoint.config_changes(saved_config, cfg.to_dict())
        click.echo(
            f"resuming from step {state.step} (sample {state.samples})"
            + (": config changed: " + "; ".join(changes) if changes else ""),
            err=True,
        )
        planned = saved_config["run"]["max_steps"]
        if planned != cfg.run.max_steps and state.step < cfg.run.max_steps:
            click.echo(
                f"--max-steps {planned} -> {cfg.run.max_steps}: from step {state.step} the lr "
                f"follows the schedule of a {cfg.run.max_steps}-step run "
                f"({cfg.optim.decay} after warm-up)",
                err=True,
            )
    checkpoint.write_atomic(  # a full disk or a kill leaves the old one, never half of it
        run_dir / "config.json",
        json.dumps(
            {
                "config": cfg.to_dict(),
                "deepspeed": ds_config,
                "world_size": world,
                "seq_len": seq_len,
            },
            indent=2,
        )
        + "\n",
    )


def _say_init_from(cfg: TrainConfig, state) -> None:
    """Rank 0's line (stderr and RUN/train.log) on what --init-from did: the weights it loaded,
    or nothing when a checkpoint of this run is resumed instead."""
    from shatter.train.metrics import log

    export = init_from.export_dir(cfg.run.init_from)
    line = (
        f"--init-from: weights from {init_from.describe(export)}; new: the optimizer's state, "
        f"the {cfg.optim.decay} schedule (from its warm-up) and the data stream (from its start)"
        if state.step == 0
        else f"--init-from {export}: not used, resuming this run's checkpoint at step {state.step}"
    )
    click.echo(line, err=True)
    log.info("%s", line)


def _say_how_it_ended(status: str, state, run_dir: Path, device) -> None:
    """Rank 0's last line: complete or stopped, at which step, the skips, the GPU memory peak,
    and where the export or the checkpoint is."""
    from shatter.train import checkpoint
    from shatter.train.metrics import gpu_memory

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


@command()
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
    "--restart",
    is_flag=True,
    help="Start again from step 0 where --output holds a run (its files are moved aside).",
)
@click.option(
    "--local_rank",
    "--local-rank",
    "local_rank",
    type=int,
    hidden=True,
    help="Set by the deepspeed launcher.",
)
def main(config_file, dry_run, target, restart, local_rank, **flags):
    """Pretrain a masked-LM encoder on a shard dataset with DeepSpeed."""
    from shatter.train.guard import TrainingError
    from shatter.train.lifecycle import process_exit
    from shatter.train.plm import with_objective

    with process_exit(known=(ConfigError, DatasetError, TrainingError)):
        try:
            cfg = with_objective(resolve(config_file, flags))
            if dry_run:
                from shatter.train.memory import dry_run_report

                click.echo(
                    "dry run: building the model and measuring one micro-batch's activations on "
                    "CPU (41 s for shatter-base on a loaded 2-vCPU box)...",
                    err=True,
                )
                click.echo(dry_run_report(cfg, target))
                return
            code = _run(cfg, restart)
        except PresetError as err:
            raise UsageError(str(err)) from None
        if code:
            sys.exit(code)  # 128 + the signal: the run is not finished; the same command resumes it


if __name__ == "__main__":
    from shatter.train.lifecycle import run_cli

    run_cli(main)
