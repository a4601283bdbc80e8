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

from pipeline.format import DatasetError, read_index  # noqa: E402
from pipeline.format.store import is_remote, local_path, open_store  # noqa: E402
from train import init_from  # noqa: E402
from train.config import (  # noqa: E402
    OPTIMIZER_IMPLS,
    PRECISIONS,
    ConfigError,
    PresetError,
    TrainConfig,
    check_output,
    data_sources,
    model_overrides,
    resolve,
    schedule_problem,
)
from train.init_from import SHAPE_FIELDS  # noqa: E402
from train.schedule import DECAYS  # noqa: E402


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
    # dataset by its own L // l, `train.loader.mix`)
    seq_len = cfg.data.seq_len or min(ix.seq_len for ix in indexes)
    for ix in indexes:
        if seq_len > ix.seq_len:
            raise ConfigError(
                f"--seq-len {seq_len} is longer than the data's seq_len {ix.seq_len} "
                f"({ix.path}); rebuild the shards with --seq-len {seq_len}"
            )
    _check_same_arch(cfg)
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
    if cfg.run.compile:
        from train.compiling import compile_model

        compile_model(model)
    return model


def compiled_run(ctx, state) -> str:
    """train(), with a failure of torch.compile's first compilation as one line."""
    from torch._dynamo.exc import TorchDynamoException

    from train.compiling import one_line
    from train.loop import TrainingError, train

    try:
        return train(ctx, state)
    except TorchDynamoException as err:
        raise TrainingError(one_line(err)) from None


class UsageError(click.ClickException):
    """One line, like every other refusal, but the exit status of a usage error."""

    exit_code = 2


def _run(cfg: TrainConfig) -> int:
    import torch

    from train import budget, checkpoint
    from train.engine import (
        build_engine,
        deepspeed_schedule,
        init_distributed,
        resolved_deepspeed_config,
    )
    from train.lifecycle import ProgressWatchdog, StopFlag, hold_run_directory
    from train.loader import StreamPosition, stream_shape
    from train.loop import RunContext
    from train.metrics import MetricsWriter, gpu_memory
    from train.node_env import check_nodes_env
    from train.schedule import Plan

    index, seq_len, mix = start_up_checks(cfg)
    cfg = budget.planned_config(cfg, Path(cfg.run.output))  # a resumed budgeted run's length
    stop = StopFlag().install()
    rank, world = init_distributed(cfg.run.collective_timeout_s)
    check_nodes_env()  # the store's settings, TMPDIR and HF_* on every node
    run_dir = Path(cfg.run.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_run_directory(run_dir, rank)  # noqa: F841 (held until the process ends)
    checkpoint.check_shared(run_dir)  # every node must see the same run directory
    ds_config = resolved_deepspeed_config(cfg, world)
    found = checkpoint.find_resumable(run_dir, say=lambda line: click.echo(line, err=True))
    universal = found.world_size is not None and found.world_size != world
    if universal:  # ZeRO's partitions re-cut for this world (train/checkpoint.py)
        if ds_config["zero_optimization"]["stage"] == 3:
            from train.zero3_fix import check_version

            check_version()
        if rank == 0:
            click.echo(
                f"the checkpoint was written by {found.world_size} ranks, this run has {world}: "
                "converting it to a universal checkpoint to re-partition it",
                err=True,
            )
        checkpoint.to_universal(run_dir, found.tag)
        ds_config["checkpoint"] = {"load_universal": True}
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
    engine.module.register_forward_pre_hook(progress.pet)  # a rank stuck between forwards ends
    state, position, saved_config = checkpoint.resume(engine, run_dir, found.tag, universal)
    if position is not None:  # refuses a position on different data
        StreamPosition.from_dict(position, *stream_shape(index, mix, seq_len))
    if rank == 0:
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
    writer = MetricsWriter(run_dir, rank, cfg.run.tensorboard, resumed_step=state.step)
    ctx = RunContext(
        cfg, index, engine, rank, world, run_dir, seq_len, writer, stop, budget=run_budget, mix=mix
    )
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
        where = (
            f"export in {run_dir / checkpoint.EXPORT}"
            if status == "complete"
            else f"checkpoint in {run_dir / 'checkpoints'}; run the same command again to resume"
        )
        memory = gpu_memory(engine.device)
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
    return 0 if status == "complete" else stop.exit_code


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML config (sections model, data, optim, run).",
)
@click.option(
    "--data",
    multiple=True,
    help="Shard dataset directory (OUT of `shatter-data build`); repeat as DIR:WEIGHT to mix "
    "datasets by weight.",
)
@click.option("--output", help="Run directory; an existing run there is resumed.")
@click.option("--preset", help="Model preset, e.g. shatter-base, bert-tiny.")
@click.option("--max-steps", type=int, help="Optimizer steps of the run.")
@click.option("--micro-batch", type=int, help="Sequences per rank per micro-batch.")
@click.option("--grad-accum", type=int, help="Micro-batches per optimizer step.")
@click.option("--precision", type=click.Choice(PRECISIONS), help="fp32, bf16 or fp16 (GPU).")
@click.option("--zero-stage", type=click.IntRange(0, 3), help="DeepSpeed ZeRO stage.")
@click.option("--save-every", type=int, help="Steps between checkpoints.")
@click.option("--eval-every", type=int, help="Steps between validation passes.")
@click.option(
    "--export-every", type=int, help="Steps between exports to RUN/export (always at the end)."
)
@click.option("--log-every", type=int, help="Steps between metrics.jsonl lines.")
@click.option("--seed", type=int, help="Seed of weights, shuffle, dynamic masks, dropout.")
@click.option(
    "--masking",
    type=click.Choice(["static", "dynamic"]),
    help="Stored masks by epoch, or fresh ones.",
)
@click.option(
    "--objective",
    type=click.Choice(["mlm", "plm"]),
    help="Masked LM, or XLNet's permutation LM (xlnet's default).",
)
@click.option("--whole-word/--no-whole-word", default=None, help="Dynamic masking of whole words.")
@click.option(
    "--seq-len",
    type=int,
    help="Train at this length (at most the data's L): L/k cuts each stored row into k rows.",
)
@click.option("--num-workers", type=int, help="DataLoader workers per rank.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps.")
@click.option(
    "--optim-impl",
    type=click.Choice(OPTIMIZER_IMPLS),
    help="AdamW on a GPU: torch's fused AdamW (default) or DeepSpeed's JIT-built FusedAdam.",
)
@click.option("--num-gpus", type=int, help="World size the config is written for (--dry-run).")
@click.option(
    "--deepspeed-config",
    type=click.Path(dir_okay=False),
    help="Expert: DeepSpeed JSON merged over the built one.",
)
@click.option("--progress/--no-progress", default=None, help="tqdm progress bar on rank 0.")
@click.option(
    "--init-from",
    help="Export (or run directory) whose weights start the run; fresh optimizer and schedule.",
)
@click.option("--decay", type=click.Choice(DECAYS), help="The lr schedule after warm-up.")
@click.option("--budget-hours", type=float, help="Wall-clock budget; sets the schedule's length.")
@click.option("--compile/--no-compile", default=None, help="torch.compile the model.")
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
    from train.lifecycle import process_exit
    from train.loop import TrainingError
    from train.plm import with_objective

    with process_exit(known=(ConfigError, DatasetError, TrainingError)):
        data = flags["data"]  # one --data: its path; several: the mixture's DIR:WEIGHT list
        flags["data"] = (data[0] if len(data) == 1 else tuple(data)) if data else None
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
