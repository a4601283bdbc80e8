"""Finetuning a pretrained (and possibly length-extended) export on GLUE, SQuAD v1.1, BoolQ,
MultiRC or any CSV/JSONL classification or regression table.

    python train/finetune.py --task sst2 --checkpoint EXPORT --train-file train.tsv \
        --validation-file dev.tsv --output RUN
    deepspeed --num_gpus 8 train/finetune.py --task squad --checkpoint EXPORT ...

The paper's recipe (§4.2): Adam (AdamW, weight decay 0.01 off biases and LayerNorm), batch 16,
lr 1e-5 (5e-6 for CoLA and SST-2), evaluation every 1k steps, the best checkpoint by the task's
main metric kept. Linear warm-up over 10% of the steps then linear decay to 0 (BERT's finetuning
schedule; the paper does not say). Heads are shatter.heads: the §3.4 modified classification
strategy by default (`--cls-strategy cls` for BERT's), span extraction for SQuAD.

The same code runs under the deepspeed launcher or as one process (a DeepSpeed world of one);
the DeepSpeed config, parameter groups, metrics.jsonl/TensorBoard writer and progress bar are
the pretraining trainer's (train/engine.py, train/metrics.py). RUN/ gets metrics.json (final and
best evaluation), predictions.json (the best checkpoint's), best/ (an export with head.json),
metrics.jsonl, tensorboard/ and config.json. See docs/finetune.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: the repository root, not train/, goes first on sys.path (as pretrain.py).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import click  # noqa: E402

from train.config import ConfigError  # noqa: E402
from train.finetuning.config import STRATEGIES, resolve  # noqa: E402
from train.finetuning.tasks import TASKS  # noqa: E402


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML config (sections data, optim, run).",
)
@click.option(
    "--task",
    type=click.Choice(list(TASKS)),
    help="Task (GLUE name, squad, boolq, multirc, classify).",
)
@click.option(
    "--checkpoint",
    help="Export directory (e.g. shatter-extend's output or RUN/export), or s3://, gs://.",
)
@click.option("--train-file", help="Training file in the task's official format.")
@click.option(
    "--validation-file",
    help="Validation file (default: hold out --validation-fraction of --train-file).",
)
@click.option(
    "--validation-fraction", type=float, help="Share held out when there is no --validation-file."
)
@click.option("--output", help="Run directory.")
@click.option("--max-steps", type=int, help="Optimizer steps (default: --epochs passes).")
@click.option(
    "--epochs", type=float, help="Passes over the training set when --max-steps is not given."
)
@click.option("--lr", type=float, help="Peak learning rate (default 1e-5; 5e-6 for cola and sst2).")
@click.option("--max-len", type=int, help="Input length (default: the checkpoint's max_len).")
@click.option("--batch-size", type=int, help="Global batch size (default 16).")
@click.option("--eval-every", type=int, help="Steps between evaluations (default 1000).")
@click.option(
    "--cls-strategy", type=click.Choice(STRATEGIES), help="Sequence classification strategy (§3.4)."
)
@click.option("--text-columns", help="classify: one or two comma-separated text columns.")
@click.option("--label-column", help="classify: the label column.")
@click.option(
    "--id-column", help="classify: an id column for predictions.json (default: row number)."
)
@click.option(
    "--labels",
    help="classify: comma-separated label set in id order; rows with other labels are skipped.",
)
@click.option(
    "--regression",
    is_flag=True,
    default=None,
    help="classify: float labels (MSE, Pearson/Spearman).",
)
@click.option(
    "--doc-stride", type=int, help="squad: tokens between the starts of context windows (128)."
)
@click.option("--weight-decay", type=float, help="AdamW weight decay (0.01).")
@click.option("--warmup-steps", type=int, help="Linear warm-up steps (default: 10% of the steps).")
@click.option(
    "--precision", type=click.Choice(["fp32", "bf16", "fp16"]), help="Training precision."
)
@click.option("--zero-stage", type=click.IntRange(0, 2), help="DeepSpeed ZeRO stage.")
@click.option("--seed", type=int, help="Seed.")
@click.option("--deepspeed-config", help="Expert: DeepSpeed JSON merged over the built one.")
@click.option(
    "--local_rank",
    "--local-rank",
    "local_rank",
    type=int,
    hidden=True,
    help="Set by the deepspeed launcher.",
)
def main(config_file, local_rank, **flags):
    """Finetune an export on a task; writes RUN/metrics.json and RUN/predictions.json."""
    from shatter.checkpoint import CheckpointError
    from train.finetuning.loop import finetune
    from train.finetuning.tasks import TaskDataError
    from train.guard import TrainingError
    from train.lifecycle import process_exit

    known = (ConfigError, CheckpointError, TaskDataError, FileNotFoundError, TrainingError)
    with process_exit(known=known):
        cfg = resolve(config_file, flags)
        result = finetune(cfg)
    if result is not None:
        best = result["best"]
        click.echo(
            f"best {result['main_metric']} {best[result['main_metric']]:.4f} at step {best['step']}; "
            f"results in {cfg.run.output}",
            err=True,
        )


if __name__ == "__main__":
    from train.lifecycle import run_cli

    run_cli(main)
