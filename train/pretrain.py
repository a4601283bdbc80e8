"""Masked-LM pretraining of the Shatter encoder and its baselines with DeepSpeed.

    deepspeed --num_gpus 8 train/pretrain.py --data OUT --output RUN --config configs/v100x8-shatter-base-256.yaml
    python train/pretrain.py --data OUT --output RUN --preset shatter-tiny --config configs/cpu-tiny.yaml

Parse, build, train, close (torchtitan's train.py shape). Running the same command again with the
same --output resumes from the newest checkpoint in RUN/checkpoints; --dry-run prints the resolved
config, the DeepSpeed config, parameter counts and a per-GPU memory estimate without training.
See docs/training.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: its folder (train/) would come first on sys.path and its modules would
    # shadow top-level names; the repository root goes there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import click  # noqa: E402

from pipeline.format import DatasetError, read_index  # noqa: E402
from train.config import PRECISIONS, ConfigError, TrainConfig, resolve  # noqa: E402


def _run(cfg: TrainConfig) -> str:
    import torch

    import shatter
    from train import checkpoint
    from train.data import StreamPosition
    from train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from train.loop import RunContext, StopFlag, train
    from train.metrics import MetricsWriter, truncate_after

    if not cfg.data.path or not cfg.run.output:
        raise ConfigError(
            "--data and --output are required (or data.path and run.output in --config)"
        )
    index = read_index(cfg.data.path)
    seq_len = cfg.data.seq_len or index.seq_len
    if seq_len > index.seq_len:
        raise ConfigError(
            f"--seq-len {seq_len} is longer than the data's seq_len {index.seq_len} "
            f"({Path(cfg.data.path) / 'index.json'}); rebuild the shards with --seq-len {seq_len}"
        )
    for split in ("train", "validation"):
        index.shards(split)  # both splits present, or an error naming index.json
    stop = StopFlag()
    stop.install()
    rank, world = init_distributed()
    run_dir = Path(cfg.run.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    ds_config = resolved_deepspeed_config(cfg, world)
    torch.manual_seed(cfg.run.seed)
    # The model is built for the length it is trained at (the paper pretrains BERT_GPU and
    # Shatter_GPU at 256); `shatter-extend` stretches it to 512 or 1024 for finetuning.
    overrides = {"vocab_size": index.vocab_size, "max_len": seq_len, **cfg.model.overrides}
    model = shatter.build_model(cfg.model.preset, **overrides)
    if seq_len > model.config.max_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_len {model.config.max_len}")
    engine = build_engine(model, cfg, ds_config)
    state, position, saved_config = checkpoint.resume(engine, run_dir)
    if position is not None:
        StreamPosition.from_dict(
            position, index.rows("train")
        )  # refuses a position on different data
    if rank == 0:
        if saved_config is not None:
            changes = checkpoint.config_changes(saved_config, cfg.to_dict())
            click.echo(
                f"resuming from step {state.step} (sample {state.samples})"
                + (": config changed: " + "; ".join(changes) if changes else ""),
                err=True,
            )
            truncate_after(run_dir / "metrics.jsonl", state.step)
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
    writer = MetricsWriter(run_dir, rank, cfg.run.tensorboard)
    ctx = RunContext(cfg, index, engine, rank, world, run_dir, seq_len, writer, stop)
    try:
        if state.step >= cfg.run.max_steps and not (run_dir / checkpoint.EXPORT).is_dir():
            checkpoint.export(engine, run_dir, checkpoint.latest_tag(run_dir), index.tokenizer)
        status = train(ctx, state) if state.step < cfg.run.max_steps else "complete"
    finally:
        writer.close()
    if rank == 0:
        where = (
            f"export in {run_dir / checkpoint.EXPORT}"
            if status == "complete"
            else f"checkpoint in {run_dir / 'checkpoints'}; run the same command again to resume"
        )
        click.echo(
            f"{status}: step {state.step}, {state.skipped_nonfinite} non-finite micro-batches skipped; "
            f"{where}",
            err=True,
        )
    return status


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML config (sections model, data, optim, run).",
)
@click.option("--data", help="Shard dataset directory (OUT of `shatter-data build`).")
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
@click.option("--seq-len", type=int, help="Truncate rows to this length (at most the data's).")
@click.option("--num-workers", type=int, help="DataLoader workers per rank.")
@click.option("--lr", type=float, help="Peak learning rate.")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps.")
@click.option("--num-gpus", type=int, help="World size the config is written for (--dry-run).")
@click.option(
    "--deepspeed-config",
    type=click.Path(dir_okay=False),
    help="Expert: DeepSpeed JSON merged over the built one.",
)
@click.option("--progress/--no-progress", default=None, help="tqdm progress bar on rank 0.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print configs, parameter counts and a memory estimate; do not train.",
)
@click.option(
    "--local_rank",
    "--local-rank",
    "local_rank",
    type=int,
    hidden=True,
    help="Set by the deepspeed launcher.",
)
def main(config_file, dry_run, local_rank, **flags):
    """Pretrain a masked-LM encoder on a shard dataset with DeepSpeed."""
    try:
        from train.plm import with_objective

        cfg = with_objective(resolve(config_file, flags))
        if dry_run:
            from train.memory import dry_run_report

            click.echo(dry_run_report(cfg))
            return
        status = _run(cfg)
    except (ConfigError, DatasetError) as err:
        raise click.ClickException(str(err)) from None
    except RuntimeError as err:
        from train.loop import TrainingError

        if not isinstance(err, TrainingError):
            raise
        raise click.ClickException(str(err)) from None
    if status == "stopped":
        sys.exit(143)  # 128 + SIGTERM: the run is not finished; the same command resumes it


if __name__ == "__main__":
    main()
