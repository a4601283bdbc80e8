"""The finetuning loop: build, train, evaluate every `eval_every` steps, keep the best.

Functions plus the engine (no trainer class): `finetune(cfg)` loads the export and its tokenizer,
builds the task data (train/finetuning/data.py) and the head (shatter.heads), a DeepSpeed engine
with the trainer's config builder (train/engine.py), and runs. Every rank draws the same global
batch order (seeded per epoch) and takes its slice, so the global batch is `batch_size` on any
world size. Evaluation runs on rank 0 while the others wait; the best model is saved from the
optimizer's fp32 master weights (gathered by every rank).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shatter.train.checkpoint import TrainState, fp32_masters
from shatter.train.config import ConfigError, EngineArgs, OptimArgs, check_output
from shatter.train.finetuning.config import FinetuneConfig, default_steps, scaled_lr
from shatter.train.finetuning.data import SpanData, build_task_data
from shatter.train.finetuning.metrics import learned_nothing
from shatter.train.guard import StepGuard, step_guard


def global_batches(
    n: int, batch_size: int, seed: int, rank: int, world: int
) -> Iterator[list[int]]:
    """This rank's share of each global batch, over reshuffled epochs without end: the global
    batches cut one stream, the concatenation of the permutations drawn from (seed, epoch)."""
    if batch_size % world:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by the world size {world}")
    epoch, order, at = 0, np.random.default_rng([seed, 0]).permutation(n), 0
    while True:
        parts, need = [], batch_size
        while need:
            if at == n:
                epoch, at = epoch + 1, 0
                order = np.random.default_rng([seed, epoch]).permutation(n)
            take = min(need, n - at)
            parts.append(order[at : at + take])
            at, need = at + take, need - take
        yield np.concatenate(parts)[rank::world].tolist()


@torch.no_grad()
def predict(
    model: torch.nn.Module, data, batch_size: int, show: bool = False
) -> dict[str, list[np.ndarray]]:
    """Head outputs for every evaluation feature, each trimmed to its own length; with `show`, a
    progress bar of its own below the training bar (gone when done)."""
    from tqdm import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs: dict[str, list[np.ndarray]] = {}
    features = data.eval_features
    starts = range(0, len(features), batch_size)
    bar = show and sys.stderr.isatty()  # a log gets no carriage returns
    for start in tqdm(starts, desc="evaluate", unit="batch", leave=False, disable=not bar):
        chunk = features[start : start + batch_size]
        batch = data.collate(chunk)
        out = model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
        )
        for key, value in out.items():
            if key == "loss" or value is None:
                continue
            value = value.float().cpu().numpy()
            rows = outputs.setdefault(key, [])
            for i, f in enumerate(chunk):
                rows.append(
                    value[i, : len(f["input_ids"])]
                    if value.ndim == 2 and key != "logits"
                    else value[i]
                )
    model.train(was_training)
    return outputs


def _head(backbone, data, strategy: str):
    from shatter.heads import SequenceClassificationModel, SpanExtractionModel

    if isinstance(data, SpanData):
        return SpanExtractionModel(backbone)
    return SequenceClassificationModel(backbone, data.num_labels, strategy=strategy)


def _save_best(module: torch.nn.Module, masters: dict, tokenizer: Path, out: Path) -> None:
    """A standalone fp32 copy with the optimizer's fp32 `masters` (under bf16/fp16 the module's
    own weights are rounded), written atomically."""
    from shatter.heads import build_head
    from shatter.model import ShatterForMaskedLM
    from shatter.sources import write_export

    copy = build_head(ShatterForMaskedLM(module.config), module.head_config())
    copy.load_state_dict(masters)
    write_export(copy, tokenizer, out, overwrite=True)


def _agreed(flag: bool, device: torch.device, world: int) -> bool:
    """Rank 0's `flag` on every rank (one broadcast)."""
    if world == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.broadcast(value, src=0)
    return bool(value.item())


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


@dataclass(frozen=True)
class Prepared:
    """A finetuning's inputs, checked: the export, its tokenizer and backbone, the task data."""

    tokenizer_file: Path
    backbone: torch.nn.Module
    data: object  # train/finetuning/data.py: ClassifyData or SpanData
    max_len: int
    steps: int  # optimizer steps of the run
    optim: OptimArgs  # with the warm-up resolved


def prepare(cfg: FinetuneConfig) -> Prepared:
    """Everything that can be refused before a process group or a byte of output exists: the
    export (a remote one through the node's cache), its tokenizer, the length, the task data;
    the step count (`epochs` passes unless `max_steps`) and the warm-up (`warmup_ratio` of them
    unless `optim.warmup_steps`)."""
    from shatter.sources import open_export
    from shatter.train.finetuning.features import Tokenizer

    export = open_export(cfg.run.checkpoint)
    check_output(Path(cfg.run.output), directory=True)
    tokenizer_file, backbone = export.tokenizer, export.model
    tokenizer = Tokenizer(tokenizer_file)
    max_len = cfg.data.max_len or backbone.config.max_len
    if max_len > backbone.config.max_len:
        raise ConfigError(
            f"--max-len {max_len} exceeds {cfg.run.checkpoint}'s max_len {backbone.config.max_len}; "
            f"extend it first: shatter-extend {cfg.run.checkpoint} --max-len {max_len} --output DIR"
        )
    if tokenizer.vocab_size > backbone.config.vocab_size:
        raise ConfigError(
            f"{tokenizer_file} has {tokenizer.vocab_size} pieces, more than the model's "
            f"vocab_size {backbone.config.vocab_size}"
        )
    data = build_task_data(dataclasses.replace(cfg.data, max_len=max_len), tokenizer)
    r, optim = cfg.run, cfg.optim
    steps = r.max_steps or default_steps(len(data.train_features), r.batch_size, r.epochs)
    if r.scale_lr:  # the default lr scales with the model's width (train/finetuning/config.py)
        optim = dataclasses.replace(optim, lr=scaled_lr(optim.lr, backbone.config.hidden))
    warmup = int(r.warmup_ratio * steps) if optim.warmup_steps < 0 else optim.warmup_steps
    optim = dataclasses.replace(optim, warmup_steps=max(1, warmup))  # DeepSpeed needs >= 1
    return Prepared(tokenizer_file, backbone, data, max_len, steps, optim)


def engine_args(cfg: FinetuneConfig, prepared: Prepared, world: int) -> EngineArgs:
    """The DeepSpeed engine's arguments: the global batch split over the ranks, one
    micro-batch a step."""
    r = cfg.run
    return EngineArgs(
        prepared.optim,
        max_steps=prepared.steps,
        micro_batch=r.batch_size // world,
        precision=r.precision,
        zero_stage=r.zero_stage,
        deepspeed_config=r.deepspeed_config,
    )


def _write_start(cfg: FinetuneConfig, prepared: Prepared, ds_config: dict, world: int) -> None:
    """Rank 0: RUN/config.json, and what the task data skipped or corrected."""
    data = prepared.data
    _write_json(
        Path(cfg.run.output) / "config.json",
        {
            "config": cfg.to_dict(),
            "deepspeed": ds_config,
            "world_size": world,
            "max_len": prepared.max_len,
            "steps": prepared.steps,
            "lr": prepared.optim.lr,
            "labels": getattr(data, "labels", None),
        },
    )
    for split, counts in data.skipped.items():
        if counts:
            print(f"{split}: skipped {sum(counts.values())} rows: {counts}", flush=True)
    for split, counts in getattr(data, "corrected", {}).items():
        if counts:
            print(
                f"{split}: kept {sum(counts.values())} rows after correcting {counts}",
                flush=True,
            )


@dataclass
class Run:
    """A finetuning in progress: the engine, its rank, and what the steps keep."""

    cfg: FinetuneConfig
    prepared: Prepared
    engine: object
    rank: int
    world: int
    writer: object  # shatter.train.metrics.MetricsWriter
    progress: object  # shatter.train.metrics.Progress
    guard: StepGuard
    state: TrainState = dataclasses.field(default_factory=TrainState)
    best: dict | None = None
    evaluations: list = dataclasses.field(default_factory=list)


def finetune(cfg: FinetuneConfig) -> dict | None:
    """Run one finetuning; return metrics.json's content on rank 0 (None elsewhere)."""
    from shatter.train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from shatter.train.metrics import MetricsWriter, Progress, log_to_run

    prepared = prepare(cfg)
    r, data = cfg.run, prepared.data
    rank, world = init_distributed()
    torch.manual_seed(r.seed)
    model = _head(prepared.backbone, data, r.cls_strategy).train()
    args = engine_args(cfg, prepared, world)
    ds_config = resolved_deepspeed_config(args, world)
    engine = build_engine(model, args, ds_config)
    Path(r.output).mkdir(parents=True, exist_ok=True)
    log_to_run(Path(r.output), rank)  # RUN/train.log
    if rank == 0:
        _write_start(cfg, prepared, ds_config, world)
    writer = MetricsWriter(Path(r.output), rank, r.tensorboard)
    progress = Progress(
        rank, r.progress, 0, prepared.steps, f"finetune {cfg.data.task}", engine.device
    )
    advice = "lower --lr, or check the task data"
    guard = step_guard(engine.device, world, r.max_nonfinite, progress.write, advice)
    run = Run(cfg, prepared, engine, rank, world, writer, progress, guard)
    try:
        _steps(run)
    finally:
        progress.close()
        writer.close()
    if rank != 0:
        return None
    summary = {
        "task": cfg.data.task,
        "main_metric": data.main_metric,
        "max_len": prepared.max_len,
        "steps": prepared.steps,
        "train_features": len(data.train_features),
        "validation_features": len(data.eval_features),
        "skipped": data.skipped,
        "corrected": getattr(data, "corrected", {}),
        "evaluations": run.evaluations,
        "final": run.evaluations[-1],
        "best": run.best,
    }
    warning = learned_nothing(run.best, data.main_metric)
    if warning:
        print(warning, file=sys.stderr, flush=True)
        summary["warnings"] = [warning]
    _write_json(Path(r.output) / "metrics.json", summary)
    return summary


def _steps(run: Run) -> None:
    """The optimizer steps, each through the step guard (train/guard.py: a non-finite loss is
    skipped on every rank and counted), a log line every `log_every`, an evaluation every
    `eval_every` and at the last step."""
    r, data, engine, steps = run.cfg.run, run.prepared.data, run.engine, run.prepared.steps
    batches = global_batches(len(data.train_features), r.batch_size, r.seed, run.rank, run.world)
    started = window_start = time.time()
    tokens_at, steps_shown = 0, 0
    for step in range(1, steps + 1):
        batch = data.collate([data.train_features[i] for i in next(batches)])
        inputs = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
        loss = engine(**inputs)["loss"]
        tokens = int(batch["attention_mask"].sum())  # a CPU tensor: no sync
        run.guard.micro_step(engine, loss, tokens, False, run.state)
        run.state.step = step
        if step % r.log_every == 0 or step == steps:
            run.guard.settle(run.state)  # the loss window and the tokens, read here only
            now = time.time()
            tokens_per_s = (run.state.tokens - tokens_at) / max(now - window_start, 1e-9)
            _log(run, tokens_per_s, step - steps_shown, now - started)
            window_start, tokens_at, steps_shown = now, run.state.tokens, step
        if step % r.eval_every == 0 or step == steps:
            _evaluate(run, step)


def _log(run: Run, tokens_per_s: float, steps: int, elapsed_s: float) -> None:
    """A metrics.jsonl line and the progress bar, over the `steps` since the last line."""
    state = run.state
    loss = state.window_loss / state.window_micro if state.window_micro else float("nan")
    lr = run.engine.get_lr()[0]
    run.writer.write(
        {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": round(tokens_per_s, 1),
            "elapsed_s": round(elapsed_s, 2),
            "skipped_nonfinite": state.skipped_nonfinite,
        }
    )
    run.progress.update(steps, loss, lr, tokens_per_s)
    state.window_loss, state.window_micro = 0.0, 0


def _evaluate(run: Run, step: int) -> None:
    """Rank 0 scores the validation set (ZeRO-0..2: a forward is no collective; the other ranks
    wait); an improvement of the main metric writes predictions.json and RUN/best (from the
    fp32 masters, which every rank gathers)."""
    r, data = run.cfg.run, run.prepared.data
    improved = False
    if run.rank == 0:
        outputs = predict(run.engine.module, data, r.eval_batch_size, show=r.progress)
        scores, predictions = data.score(outputs)
        record = {"step": step, **scores}
        run.evaluations.append(record)
        run.writer.write({"split": "validation", **record})
        run.progress.write(
            f"step {step}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float))
        )
        if run.best is None or scores[data.main_metric] > run.best[data.main_metric]:
            run.best, improved = record, True
            _write_json(Path(r.output) / "predictions.json", predictions)
    if r.save_best and _agreed(improved, run.engine.device, run.world):
        masters = fp32_masters(run.engine)  # a collective under ZeRO: every rank gathers
        if run.rank == 0:
            out = Path(r.output) / "best"
            _save_best(run.engine.module, masters, run.prepared.tokenizer_file, out)
        del masters
    if run.world > 1:
        torch.distributed.barrier()
