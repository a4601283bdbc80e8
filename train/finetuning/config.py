"""The finetuning config: one frozen dataclass per concern (data, optimizer, run), resolved from
defaults, then a YAML file, then the command-line flags (unknown keys rejected). The paper's
recipe (§4.2): AdamW, batch 16, lr 1e-5 (5e-6 for CoLA and SST-2), evaluation every 1k steps."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shatter.options import ConfigError, built, flag_fields, layered, option
from shatter.train.config import OptimArgs, default_zero_stage
from shatter.train.finetuning.data import DataConfig
from shatter.train.finetuning.tasks import TASKS

STRATEGIES = ("modified", "cls")
TASK_LR = {"cola": 5e-6, "sst2": 5e-6}  # §4.2.1; every other task 1e-5
DEFAULT_LR = 1e-5
BASE_HIDDEN = 768  # the width the paper's finetuning lr is for (base size, Table 2)
MAX_DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class FinetuneArgs:
    checkpoint: str | None = option(
        None, "Export directory (e.g. shatter-extend's output or RUN/export), or s3://, gs://."
    )
    output: str | None = option(
        None, "Run directory (metrics.json, predictions.json, best/, tensorboard/)."
    )
    cls_strategy: str = option(
        "modified", "Sequence classification strategy (§3.4; `cls`: BERT's).", choices=STRATEGIES
    )
    max_steps: int | None = option(None, "Optimizer steps (default: --epochs passes).", min=1)
    epochs: float = option(3.0, "Passes over the training set when --max-steps is not given.")
    batch_size: int = option(16, "Global batch size, split over ranks (§4.2).", min=1)
    eval_every: int = option(
        1000, "Steps between evaluations (§4.2); always at the last step too.", min=1
    )
    eval_batch_size: int = 64  # inputs per evaluation forward pass
    # share of the steps with linear warm-up, unless optim.warmup_steps is set
    warmup_ratio: float = 0.1
    precision: str = option("fp32", "Training precision.", choices=("fp32", "bf16", "fp16"))
    zero_stage: int = option(
        0, "The DeepSpeed ZeRO stage (unset: 1 under bf16/fp16, as pretraining).", min=0, max=2
    )
    seed: int = option(0, "Seeds the head's init, the batch order, dropout and the hold-out split.")
    log_every: int = 10  # steps between metrics.jsonl training lines
    progress: bool = True  # tqdm bar on rank 0
    tensorboard: bool = True  # TensorBoard event files under RUN/tensorboard
    save_best: bool = True  # write RUN/best/ whenever the main metric improves
    max_nonfinite: int = 100  # consecutive NaN/inf steps (each skipped and counted) before a stop
    deepspeed_config: str | None = option(
        None, "Expert: DeepSpeed JSON merged over the built one.", file=True
    )
    # an lr that neither --lr nor the config sets is scaled to the model's width (`scaled_lr`)
    scale_lr: bool = True


@dataclass(frozen=True)
class FinetuneConfig:
    data: DataConfig
    optim: OptimArgs = field(default_factory=lambda: OptimArgs(lr=DEFAULT_LR, warmup_steps=-1))
    run: FinetuneArgs = field(default_factory=FinetuneArgs)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))


SECTIONS = {"data": DataConfig, "optim": OptimArgs, "run": FinetuneArgs}
FLAGS = flag_fields(SECTIONS)  # click parameter -> config field, from the option() declarations


def resolve(config_file: str | None, flags: Mapping[str, Any]) -> FinetuneConfig:
    """Defaults (with the task's lr), then the YAML file, then the flags; unknown keys rejected."""
    sections, _ = layered(SECTIONS, config_file, flags)
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
    precision = sections["run"].get("precision", FinetuneArgs.precision)
    sections["run"].setdefault("zero_stage", default_zero_stage(precision))
    if "lr" in sections["optim"]:
        sections["run"]["scale_lr"] = False
    sections["optim"] = {
        "lr": TASK_LR.get(task, DEFAULT_LR),
        "warmup_steps": -1,
        **sections["optim"],
    }
    where = config_file or "flags"
    cfg = FinetuneConfig(**built(SECTIONS, sections, where))
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


def scaled_lr(lr: float, hidden: int) -> float:
    """The default lr for a model `hidden` wide: the paper's (§4.2, for base size, hidden 768)
    times (768 / hidden)², at most 1e-3. Narrow models need far more: the tutorial's shatter-tiny
    (hidden 64) stays at chance for 3 epochs at 1e-5 and learns at 1e-3."""
    return min(MAX_DEFAULT_LR, lr * max(1.0, BASE_HIDDEN / hidden) ** 2)


def default_steps(n_train: int, batch_size: int, epochs: float) -> int:
    return max(1, math.ceil(epochs * n_train / batch_size))
