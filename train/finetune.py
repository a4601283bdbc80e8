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

import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: the repository root, not train/, goes first on sys.path (as pretrain.py).
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import click  # noqa: E402

from train.config import ConfigError, OptimArgs, _section, read_yaml  # noqa: E402
from train.finetune_data import DataConfig  # noqa: E402
from train.tasks import TASKS  # noqa: E402

STRATEGIES = ("modified", "cls")
TASK_LR = {"cola": 5e-6, "sst2": 5e-6}  # §4.2.1; every other task 1e-5
DEFAULT_LR = 1e-5


@dataclass(frozen=True)
class FinetuneArgs:
    checkpoint: str | None = (
        None  # export directory: config.json, model.safetensors, tokenizer.model
    )
    output: str | None = (
        None  # run directory for metrics.json, predictions.json, best/, tensorboard/
    )
    cls_strategy: str = "modified"  # §3.4 "modified" or BERT's "cls"
    max_steps: int | None = None  # optimizer steps; None: `epochs` passes over the training set
    epochs: float = 3.0  # used only when max_steps is None
    batch_size: int = 16  # global batch, split over ranks (§4.2: 16 for every task)
    eval_every: int = 1000  # steps between evaluations (§4.2); always at the last step too
    eval_batch_size: int = 64  # inputs per evaluation forward pass
    warmup_ratio: float = (
        0.1  # share of the steps with linear warm-up, unless optim.warmup_steps is set
    )
    precision: str = "fp32"  # fp32 or bf16 (fp16 on GPUs)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-2 (3 would need a gather to save the best model)
    seed: int = 0  # seeds the head's init, the batch order, dropout and the hold-out split
    log_every: int = 10  # steps between metrics.jsonl training lines
    progress: bool = True  # tqdm bar on rank 0
    tensorboard: bool = True  # TensorBoard event files under RUN/tensorboard
    save_best: bool = True  # write RUN/best/ whenever the main metric improves
    deepspeed_config: str | None = None  # expert: a DeepSpeed JSON merged over the built one


@dataclass(frozen=True)
class FinetuneConfig:
    data: DataConfig
    optim: OptimArgs = field(default_factory=lambda: OptimArgs(lr=DEFAULT_LR, warmup_steps=-1))
    run: FinetuneArgs = field(default_factory=FinetuneArgs)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


# command-line flag -> config field
FLAGS = {
    "task": "data.task",
    "train_file": "data.train_file",
    "validation_file": "data.validation_file",
    "validation_fraction": "data.validation_fraction",
    "max_len": "data.max_len",
    "text_columns": "data.text_columns",
    "label_column": "data.label_column",
    "id_column": "data.id_column",
    "labels": "data.labels",
    "regression": "data.regression",
    "doc_stride": "data.doc_stride",
    "checkpoint": "run.checkpoint",
    "output": "run.output",
    "cls_strategy": "run.cls_strategy",
    "max_steps": "run.max_steps",
    "epochs": "run.epochs",
    "batch_size": "run.batch_size",
    "eval_every": "run.eval_every",
    "precision": "run.precision",
    "zero_stage": "run.zero_stage",
    "seed": "run.seed",
    "deepspeed_config": "run.deepspeed_config",
    "lr": "optim.lr",
    "weight_decay": "optim.weight_decay",
    "warmup_steps": "optim.warmup_steps",
}
_SECTIONS = {"data": DataConfig, "optim": OptimArgs, "run": FinetuneArgs}


def resolve(config_file: str | None, flags: Mapping[str, Any]) -> FinetuneConfig:
    """Defaults (with the task's lr), then the YAML file, then the flags; unknown keys rejected."""
    sections = (
        read_yaml(config_file, _SECTIONS) if config_file else {name: {} for name in _SECTIONS}
    )
    for flag, value in flags.items():
        if value is not None:
            section, key = FLAGS[flag].split(".")
            sections[section][key] = value
    task = sections["data"].get("task")
    if task not in TASKS:
        raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    for key in ("train_file", "validation_file"):
        if sections["data"].get(key) is not None:
            sections["data"][key] = Path(sections["data"][key])
    for key in ("text_columns", "labels"):
        if isinstance(sections["data"].get(key), (str, list)):
            value = sections["data"][key]
            sections["data"][key] = tuple(value.split(",") if isinstance(value, str) else value)
    sections["data"].setdefault("max_len", 0)
    sections["optim"] = {
        "lr": TASK_LR.get(task, DEFAULT_LR),
        "warmup_steps": -1,
        **sections["optim"],
    }
    where = config_file or "flags"
    cfg = FinetuneConfig(
        **{
            name: _section(cls, sections[name], f"{where} [{name}]")
            for name, cls in _SECTIONS.items()
        }
    )
    r = cfg.run
    checks = [
        (cfg.data.train_file is not None, "--train-file is required"),
        (
            r.checkpoint is not None and r.output is not None,
            "--checkpoint and --output are required",
        ),
        (r.cls_strategy in STRATEGIES, f"--cls-strategy must be one of {STRATEGIES}"),
        (r.zero_stage in (0, 1, 2), "--zero-stage must be 0, 1 or 2 for finetuning"),
        (r.batch_size > 0 and r.eval_every > 0, "--batch-size and --eval-every must be positive"),
        (r.max_steps is None or r.max_steps > 0, "--max-steps must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return cfg


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
@click.option("--checkpoint", help="Export directory (e.g. shatter-extend's output or RUN/export).")
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
    from train.finetune_loop import finetune
    from train.tasks import TaskDataError

    try:
        cfg = resolve(config_file, flags)
        result = finetune(cfg)
    except (ConfigError, CheckpointError, TaskDataError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    if result is not None:
        best = result["best"]
        click.echo(
            f"best {result['main_metric']} {best[result['main_metric']]:.4f} at step {best['step']}; "
            f"results in {cfg.run.output}",
            err=True,
        )


def default_steps(n_train: int, batch_size: int, epochs: float) -> int:
    return max(1, math.ceil(epochs * n_train / batch_size))


if __name__ == "__main__":
    main()
