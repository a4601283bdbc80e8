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

import click

from shatter.options import click_options, command
from shatter.train.config import ConfigError
from shatter.train.finetuning.config import SECTIONS, resolve


@command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML config (sections data, optim, run).",
)
@click_options(SECTIONS, defaults=False)  # train/finetuning/config.py: the fields declared as flags
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
    from shatter.train.finetuning.loop import finetune
    from shatter.train.finetuning.tasks import TaskDataError
    from shatter.train.guard import TrainingError
    from shatter.train.lifecycle import process_exit

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
    from shatter.train.lifecycle import run_cli

    run_cli(main)
