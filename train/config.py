"""Typed configuration of a pretraining run: one frozen dataclass per concern.

A run is described by `TrainConfig(model, data, optim, run)`. It is resolved in three layers, each
overriding the one before: the dataclass defaults (the paper's §A.2 settings), a YAML file
(`--config`, sections `model:`, `data:`, `optim:`, `run:`), and the command-line flags. Unknown
keys are rejected with the file name and the key, as in academic-budget-bert's argument groups
(one dataclass per concern) and torchtitan's job config. A field declared with `option(...)` is
also a flag of `train/pretrain.py` and a row of docs/training.md's table (`shatter.options`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shatter.options import (
    ConfigError,
    built,
    flag_fields,
    layered,
    option,
    read_yaml,
    sections_of,
)
from shatter.train.schedule import DECAYS, lr_factor

OPTIMIZER_IMPLS = ("auto", "master", "torch", "deepspeed")
PRECISIONS = ("fp32", "bf16", "fp16")
MASKINGS = ("static", "dynamic")


class PresetError(ConfigError):
    """An unknown --preset: a usage error (exit status 2)."""


@dataclass(frozen=True)
class ModelArgs:
    preset: str = option(
        "shatter-tiny", "Model preset, e.g. shatter-base, bert-tiny.", doc="`{arch}-{size}`"
    )  # of shatter.build_model
    overrides: Mapping[str, Any] = field(
        default_factory=dict
    )  # ModelConfig fields, e.g. {dropout: 0.0}


@dataclass(frozen=True)
class DataArgs:
    # several datasets, "DIR:WEIGHT" each (a list in the config file), are mixed by weight
    # (`data_sources`, train/loader/mix.py)
    path: str | tuple[str, ...] | None = option(
        None,
        "Shard dataset directory (OUT of `shatter-data build`); repeat as DIR:WEIGHT to mix "
        "datasets by weight.",
        flag="--data",
        multiple=True,
        doc="shard dataset (has `index.json`); repeated, `DIR:WEIGHT` each, datasets mixed by "
        "weight (below)",
    )
    seq_len: int | None = option(
        None,
        "Train at this length (at most the data's); L/k of the data's L cuts each row into k.",
        doc="train at this length: L/k of the data's L cuts each stored row into k rows "
        "(below); longer than L is an error; unset: the data's (mixed: the shortest)",
    )
    masking: str = option(
        "static",
        "Stored masks by epoch, or fresh ones.",
        choices=MASKINGS,
        doc="`static` (the shards' `dupe_factor` maskings, cycled by epoch) or `dynamic`",
    )
    mask_prob: float = (
        0.15  # dynamic masking: share of non-special tokens predicted (BERT §3.1; 80/10/10)
    )
    whole_word: bool = option(False, "Dynamic masking of whole words.")
    shuffle: bool = True  # deterministic per-epoch shuffle of shard order and rows, from run.seed
    num_workers: int = option(
        1, "DataLoader workers per rank.", doc="DataLoader workers per rank (0: in the trainer)"
    )
    verify_shards: bool = (
        True  # sha256 of each shard checked against index.json before its first use
    )
    eval_samples: int | None = None  # validation rows evaluated each time; None = the whole split
    objective: str | None = option(
        None,
        "Masked LM, or XLNet's permutation LM (xlnet's default).",
        choices=("mlm", "plm"),
        doc="`mlm` or `plm` (XLNet's permutation LM); unset: the arch's own, `plm` for `xlnet`, "
        "`mlm` otherwise; `plm` is refused for the MLM archs",
    )
    plm_targets: str = "spans"  # plm: "spans" (XLNet's span sampling) or "static" (stored masks)
    plm_ratio: int = 6  # plm spans: K, one token in about K predicted (XLNet)
    plm_max_span: int = 5  # plm spans: longest span, lengths drawn with p(n) ∝ 1/n (XLNet)
    # a remote data.path (s3://, gs://): shards are read from a node-local cache (docs/scale-out.md)
    cache_dir: str | None = (
        None  # one per node and user, shared by its ranks; None = $TMPDIR/shatter-cache-USER
    )
    cache_limit_gb: float = 50.0  # least recently used shards are evicted beyond this
    store_retry_seconds: float = 120.0  # how long a download retries a store that does not answer


@dataclass(frozen=True)
class OptimArgs:
    lr: float = option(1e-4, "Peak learning rate.", doc="peak learning rate (§A.2)")
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW β1, β2 (§A.2)
    eps: float = 1e-6  # AdamW ε
    weight_decay: float = option(
        0.01,
        "AdamW's decoupled weight decay.",
        min=0,
        doc="AdamW's decoupled weight decay, not on biases and LayerNorm weights (§A.2)",
    )
    # when neither --config nor --warmup-steps sets it, `resolve` uses default_warmup(max_steps)
    warmup_steps: int = option(
        10_000,
        "Linear warm-up steps.",
        doc="linear warm-up from 0 to the peak (unset: see below)",
    )
    decay: str = option(
        "linear",
        "The lr after warm-up.",
        choices=DECAYS,
        doc="`linear` to 0 at max_steps (§A.2), `constant`, `cosine`, `wsd`, `1-sqrt` "
        "(the peak, then a decay over the last `optim.cooldown` of the run; train/schedule.py)",
    )
    cooldown: float = 0.1  # wsd, 1-sqrt: share of the run's steps in the final decay to 0
    grad_clip: float = 1.0  # global gradient-norm clipping
    initial_scale_power: int = 16  # fp16 dynamic loss scaling starts at 2**this
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    min_loss_scale: float = 1.0  # fp16: the scale never goes below this
    # AdamW on a GPU (train/engine.py, train/master_step.py); on a CPU torch's AdamW always
    impl: str = option(
        "auto",
        "AdamW on a GPU: auto, master (one-pass bf16 ZeRO step), torch (fused AdamW) or "
        "deepspeed (JIT-built FusedAdam).",
        flag="--optim-impl",
        choices=OPTIMIZER_IMPLS,
        doc="AdamW on a GPU: `master` (bf16 ZeRO-1/2: gradient in, fp32 master and moments "
        "and the bf16 weights out in one kernel), `torch` (`AdamW(fused=True)`), `deepspeed` "
        "(FusedAdam, JIT-built), `auto` (default: `master` where it applies, else `torch`)",
    )


@dataclass(frozen=True)
class RunArgs:
    output: str | None = option(
        None,
        "Run directory; an existing run there is resumed.",
        doc="run directory: checkpoints/, export/, metrics.jsonl, tensorboard/",
    )
    max_steps: int = option(
        1000, "Optimizer steps of the run.", doc="optimizer steps; the lr reaches 0 here"
    )
    micro_batch: int = option(
        8,
        "Sequences per rank per micro-batch.",
        doc="sequences per rank per forward/backward; global batch = micro × accum × ranks",
    )
    grad_accum: int = option(1, "Micro-batches per optimizer step.")
    precision: str = option(
        "fp32",
        "fp32, bf16 or fp16 (GPU).",
        choices=PRECISIONS,
        doc="`fp32`, `bf16`, `fp16` (GPU; dynamic loss scaling, for V100s)",
    )
    zero_stage: int = option(
        0,
        "DeepSpeed ZeRO stage.",
        min=0,
        max=3,
        doc="DeepSpeed ZeRO stage 0-3 (unset: 0 in fp32, 1 in bf16/fp16)",
    )
    seed: int = option(
        0,
        "Seed of weights, shuffle, dynamic masks, dropout.",
        doc="seeds the weights, the shuffle, dynamic masks and dropout",
    )
    save_every: int = option(
        1000, "Steps between checkpoints.", doc="steps between checkpoints; 0 = only at the end"
    )  # (and on SIGTERM)
    eval_every: int = option(
        1000,
        "Steps between validation passes.",
        doc="steps between validation passes; 0 = only at the end",
    )
    export_every: int = option(
        0,
        "Steps between exports to RUN/export (always at the end).",
        doc="steps between exports to RUN/export; 0 = only at the end",
    )
    log_every: int = option(10, "Steps between metrics.jsonl lines.")
    max_nonfinite: int = (
        100  # consecutive NaN/inf micro-batches (each skipped and counted) before the run stops
    )
    keep_checkpoints: int = 2  # newest checkpoints kept under RUN/checkpoints (0 = keep all)
    diverge_factor: float = option(
        3.0,
        "A loss above this times its running median is a spike (0: no divergence check).",
        flag="",
        min=0,
        doc="a log line's loss above this × the running median of the last 50 is a spike; "
        "`diverge_lines` spikes in a row stop the run as diverged (0 = never)",
    )
    diverge_lines: int = option(
        3,
        "Log lines in a row with a spike that stop the run as diverged.",
        flag="",
        min=1,
        doc="log lines in a row with a loss spike that stop the run as diverged, keeping the "
        "checkpoint from before the spike",
    )
    num_gpus: int = option(
        1,
        "World size the config is written for (--dry-run).",
        doc="the world size the config is written for and `--dry-run` estimates for",
    )
    gpu_memory_gb: float = option(
        16.0,
        "Memory of one GPU that --dry-run compares its estimate with.",
        flag="",
        doc="the memory of one GPU `--dry-run` compares with",
    )
    peak_tflops: float | None = option(
        None,
        "Dense TFLOP/s of one device for MFU.",
        flag="",
        doc="dense TFLOP/s of one device for MFU (default: by GPU name, train/cost.py's table; "
        "none on a CPU)",
    )
    deepspeed_config: str | None = option(
        None,
        "Expert: DeepSpeed JSON merged over the built one.",
        file=True,
        doc="expert: a DeepSpeed JSON merged over the built DeepSpeed config",
    )
    progress: bool = option(True, "tqdm progress bar on rank 0.")
    # seconds a collective waits on a peer before it fails (and the run with it): longer than the
    # slowest rank-0-only pause (an export of a large model); a dead peer is noticed this late
    collective_timeout_s: float = 600.0
    tensorboard: bool = True  # TensorBoard event files under RUN/tensorboard
    budget_hours: float | None = option(
        None,
        "A wall-clock budget in hours: the schedule's length is set from the timed steps.",
        min=0,
        min_open=True,
        doc="wall-clock hours of training: the schedule's length comes from the measured step "
        "time, re-planned as it changes so that the decay ends inside them (max_steps is then a "
        "ceiling); the run ends annealed, with an export",
    )
    compile: bool | None = option(
        None,
        "torch.compile the model (default: on a GPU, off on a CPU).",
        doc="`torch.compile` the model with inductor; unset (`auto`): on a CUDA GPU where "
        "inductor can run (triton installed), off on a CPU",
    )
    init_from: str | None = option(
        None,
        "Continued pretraining: start from an export's (or a run's) weights.",
        doc="continued pretraining from an export's (or a run directory's) weights, with a "
        "fresh optimizer and schedule; ignored once the run has a checkpoint",
    )
    sample_log: str | None = option(
        None,
        "Debugging: each rank appends [stream position, row ids] of every micro-batch to "
        "PREFIX.rankR.jsonl.",
        doc="debugging: each rank appends `[stream position, row ids]` of every micro-batch to "
        "`PREFIX.rankR.jsonl`",
    )
    sync_debug: str | None = option(
        None,
        "Debugging on a GPU: torch warns (or errors) at each host sync inside a training step.",
        choices=("warn", "error"),
        doc="debugging on a GPU: torch's `set_sync_debug_mode` over each step's forward, "
        "backward and optimizer step (`warn` or `error`)",
    )


@dataclass(frozen=True)
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    run: RunArgs = field(default_factory=RunArgs)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def validate(self) -> TrainConfig:
        r, d = self.run, self.data
        EngineArgs.of(self)  # the optimizer, schedule, batch, precision and ZeRO stage
        checks = [
            (d.masking in MASKINGS, f"data.masking must be one of {MASKINGS}, got {d.masking!r}"),
            (r.collective_timeout_s > 0, "run.collective_timeout_s must be positive"),
            (0 < d.mask_prob < 1, "data.mask_prob must be in (0, 1)"),
            (d.seq_len is None or d.seq_len >= 8, "data.seq_len must be at least 8"),
            (0 < self.optim.cooldown <= 1, "optim.cooldown must be in (0, 1]"),
            (r.budget_hours is None or r.budget_hours > 0, "run.budget_hours must be positive"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        data_sources(d.path)  # each weight a positive number
        from shatter.config import (
            ARCHS,
            SIZES,
            preset_config,  # torch-free, but the package imports torch
        )

        arch, _, size = self.model.preset.rpartition("-")
        if arch not in ARCHS or size not in SIZES:
            raise PresetError(
                f"unknown --preset {self.model.preset!r}: it is ARCH-SIZE with ARCH one of "
                f"{', '.join(ARCHS)} and SIZE one of {', '.join(SIZES)} (e.g. shatter-tiny)"
            )
        try:
            preset_config(self.model.preset, **self.model.overrides)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model.overrides {dict(self.model.overrides)}: {err}") from None
        return self


@dataclass(frozen=True)
class EngineArgs:
    """What a DeepSpeed engine is built from (train/engine.py): the optimizer, the schedule's
    length, the batch, the precision, the ZeRO stage, and an expert's JSON merged over the built
    config. A pretraining run's come from its `TrainConfig` (`of`); finetuning builds its own."""

    optim: OptimArgs
    max_steps: int  # optimizer steps; the lr reaches 0 here (linear decay)
    micro_batch: int  # sequences per rank per forward/backward
    grad_accum: int = 1
    precision: str = "fp32"
    zero_stage: int = 0
    deepspeed_config: str | None = None  # a DeepSpeed JSON merged over the built one

    def __post_init__(self):
        o = self.optim
        checks = [
            (
                self.precision in PRECISIONS,
                f"run.precision must be one of {PRECISIONS}, got {self.precision!r}",
            ),
            (self.zero_stage in (0, 1, 2, 3), f"run.zero_stage must be 0-3, got {self.zero_stage}"),
            (self.max_steps > 0, "run.max_steps must be positive"),
            (
                self.micro_batch > 0 and self.grad_accum > 0,
                "run.micro_batch and run.grad_accum must be positive",
            ),
            (o.decay in DECAYS, f"optim.decay must be one of {DECAYS}, got {o.decay!r}"),
            (
                o.impl in OPTIMIZER_IMPLS,
                f"optim.impl must be one of {OPTIMIZER_IMPLS}, got {o.impl!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @classmethod
    def of(cls, cfg: TrainConfig | EngineArgs) -> EngineArgs:
        """A pretraining config's engine arguments (EngineArgs as they are)."""
        if isinstance(cfg, EngineArgs):
            return cfg
        r = cfg.run
        return cls(
            cfg.optim,
            max_steps=r.max_steps,
            micro_batch=r.micro_batch,
            grad_accum=r.grad_accum,
            precision=r.precision,
            zero_stage=r.zero_stage,
            deepspeed_config=r.deepspeed_config,
        )


def default_warmup(max_steps: int) -> int:
    """The paper's 10k warm-up steps (§A.2), or 10% of a shorter run: a 20-step run that kept 10k
    would end at lr 1.8e-7, having learnt nothing."""
    return max(1, min(OptimArgs.warmup_steps, max_steps // 10))


def default_zero_stage(precision: str) -> int:
    """ZeRO-1 under bf16/fp16, ZeRO-0 in fp32, when neither the file nor a flag sets it: the
    mixed-precision step then runs DeepSpeed's ZeRO optimizer (fp32 masters and Adam states
    partitioned over the ranks, its most used path) rather than its ZeRO-0 fp16/bf16 wrappers."""
    return 1 if precision in ("bf16", "fp16") else 0


def lr_at(optim: OptimArgs, max_steps: int, step: int) -> float:
    """The learning rate optimizer step `step` (1-based) runs at, as DeepSpeed's WarmupDecayLR /
    WarmupLR apply it (linear warm-up from 0, then `optim.decay`: train/schedule.py), and as
    metrics.jsonl logs it. DeepSpeed lags two steps behind the formula: step 1 runs at the
    initial lr (0) and the first scheduler step gives iteration 0, so step s uses iteration s - 2;
    its warm-up is at least 2 iterations."""
    warmup = max(optim.warmup_steps, 2)
    return optim.lr * lr_factor(optim.decay, step - 2, warmup, max_steps, optim.cooldown)


def model_overrides(cfg: TrainConfig, index: Any, seq_len: int) -> dict[str, Any]:
    """The ModelConfig fields a run builds its model with: the training length and, from the
    dataset's index (when read), its vocabulary and special ids ([SEP] counts xlnet's segments);
    the config's own model.overrides win."""
    from shatter.config import special_id_overrides

    fields: dict[str, Any] = {"max_len": seq_len}
    if index is not None:
        fields["vocab_size"] = index.vocab_size
        fields.update(special_id_overrides(index.special_ids))
    return {**fields, **cfg.model.overrides}


def schedule_problem(cfg: TrainConfig) -> str | None:
    """A sentence when the schedule keeps the lr near 0 for most of the run, else None."""
    o, steps = cfg.optim, cfg.run.max_steps
    if o.warmup_steps >= steps:
        return (
            f"warm-up ({o.warmup_steps} steps) is not shorter than the run ({steps} steps): the lr "
            f"never reaches its peak {o.lr:g} (it is {lr_at(o, steps, steps):.2g} at the last "
            f"step); lower --warmup-steps (e.g. {default_warmup(steps)}) or raise --max-steps"
        )
    low = sum(lr_at(o, steps, s) < 0.01 * o.lr for s in range(1, steps + 1))
    if low > steps / 2:
        return (
            f"the lr is below 1% of its peak {o.lr:g} for {low} of {steps} steps: "
            "check --warmup-steps, --max-steps and optim.decay"
        )
    return None


def check_output(path: str | Path, directory: bool, option: str = "--output") -> None:
    """Refuse, before any work, an output that cannot be written: a regular file where a directory
    is wanted (or the reverse), or a path under a regular file or an unwritable directory."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            raise ConfigError(f"{option} {path} is a file, not a directory; choose another path")
        if not directory and path.is_dir():
            raise ConfigError(f"{option} {path} is a directory; give a file name")
    parent = path if directory and path.is_dir() else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(
            f"{option} {path} is under {parent}, which is a file, not a directory; choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: {parent} is not writable; choose another path")


SECTIONS = {"model": ModelArgs, "data": DataArgs, "optim": OptimArgs, "run": RunArgs}

# {click parameter: config field} of the command-line flags (a contract, docs/training.md)
FLAGS = flag_fields(SECTIONS)
# the repeatable flags (--data): none given is not given, one is its value, several a tuple


def data_sources(path: str | Sequence[str] | None) -> list[tuple[str, float]]:
    """(dataset, weight) of each dataset of data.path: "DIR" (weight 1) or "DIR:WEIGHT"; a
    suffix that is not a positive number is part of the path."""
    values = [path] if isinstance(path, str) else list(path or ())
    sources = []
    for value in values:
        head, _, tail = str(value).rpartition(":")
        try:
            weight = float(tail) if head and not tail.startswith("/") else None
        except ValueError:
            weight = None
        if weight is not None and not (0 < weight < float("inf")):
            raise ConfigError(f"--data {value}: the weight must be a positive number")
        sources.append((head, weight) if weight is not None else (str(value), 1.0))
    return sources


def from_dict(values: Mapping[str, Any], where: str = "config") -> TrainConfig:
    """A TrainConfig from nested sections; unknown sections and keys are errors naming `where`."""
    return TrainConfig(**built(SECTIONS, sections_of(values, where, SECTIONS), where))


def load_yaml(path: str | Path) -> TrainConfig:
    return from_dict(read_yaml(path, SECTIONS), where=str(path))


def resolve(config_file: str | None, flags: Mapping[str, Any]) -> TrainConfig:
    """Defaults, then the YAML file, then the flags (`shatter.options.layered`); validated. A
    warm-up set by neither the file nor a flag is `default_warmup(run.max_steps)`, a ZeRO stage
    `default_zero_stage(precision)`."""
    parts, given = layered(SECTIONS, config_file, flags)
    cfg = TrainConfig(**built(SECTIONS, parts, str(config_file or "flags")))
    if "optim.warmup_steps" not in given:
        cfg = replace(cfg, optim=replace(cfg.optim, warmup_steps=default_warmup(cfg.run.max_steps)))
    if "run.zero_stage" not in given:
        cfg = replace(cfg, run=replace(cfg.run, zero_stage=default_zero_stage(cfg.run.precision)))
    return cfg.validate()
