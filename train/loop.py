"""The training loop: functions over a DeepSpeed engine and a small `TrainState` (no trainer class).

Per micro-batch: forward, one all-reduce of [loss not finite, stop requested, tokens] so every
rank takes the same decision, then backward and step unless some rank's loss was NaN/inf (then
all skip it and count it; fp16 overflow stays the loss scaler's job). At each optimizer step:
metrics, validation, checkpoint, export, and a SIGTERM stop after saving. Dropout is reseeded
from (seed, stream position, rank) before every micro-batch, so a resumed run draws the same
masks as an uninterrupted one without storing RNG state.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.format import Index
from pipeline.masking import mix64
from train import checkpoint
from train.config import TrainConfig
from train.data import ShardStream, StreamPosition, train_loader, validation_stream
from train.engine import loss_scale
from train.evaluate import evaluate
from train.metrics import MetricsWriter, Progress

MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "perm_rank")  # perm_rank: plm only


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a diverged loss); the message says what to do."""


class StopFlag:
    """Set by SIGTERM; the loop saves a checkpoint at the next step boundary and exits."""

    def __init__(self):
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


def _ignore_sigterm(worker_id: int) -> None:
    # Loader workers outlive a SIGTERM (the launcher signals the whole process tree) so that the
    # main process can still finish its step and save; they exit when the main process does.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def dropout_seed(seed: int, samples: int, rank: int) -> int:
    return int(mix64([seed, samples, rank]).sum() >> 1) & ((1 << 63) - 1)


@dataclass
class RunContext:
    cfg: TrainConfig
    index: Index
    engine: object
    rank: int
    world: int
    run_dir: Path
    seq_len: int
    writer: MetricsWriter
    stop: StopFlag


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def run_validation(ctx: RunContext, step: int, stream: ShardStream) -> dict:
    """One pass over `stream` (the run's validation stream, built once: its shards are hashed and
    decoded on the first pass, not at every evaluation)."""
    batches = ({k: b[k] for k in MODEL_INPUTS if k in b} for b in stream)
    result = evaluate(ctx.engine, batches, ctx.engine.device, distributed=ctx.world > 1)
    record = {
        "step": step,
        "split": "validation",
        "objective": ctx.cfg.data.objective,  # mlm or plm: never plotted against each other
        "loss": result["loss"],
        "accuracy": result["accuracy"],
        "predictions": result["predictions"],
    }
    ctx.writer.write(record)
    return record


def _log_line(
    ctx: RunContext, state: checkpoint.TrainState, lr: float, tokens_per_s: float
) -> dict:
    window = torch.tensor([state.window_loss, float(state.window_micro)], dtype=torch.float64)
    if ctx.world > 1:
        torch.distributed.all_reduce(window)
    loss = window[0].item() / window[1].item() if window[1] > 0 else float("nan")
    record = {
        "step": state.step,
        "objective": ctx.cfg.data.objective,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        "samples": state.samples,
        "epoch": state.samples / ctx.index.rows("train"),
        "tokens": state.tokens,
        "skipped_nonfinite": state.skipped_nonfinite,
        "grad_norm": _grad_norm(ctx.engine),
    }
    scale = loss_scale(ctx.engine)
    if scale is not None:
        record["loss_scale"] = scale
        record["overflow_skipped_steps"] = int(ctx.engine.skipped_steps)
    ctx.writer.write(record)
    state.window_loss, state.window_micro = 0.0, 0
    return record


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def save_and_export(
    ctx: RunContext, state: checkpoint.TrainState, export: bool, epoch_size: int
) -> str:
    position = StreamPosition(state.samples, epoch_size).to_dict()
    name = checkpoint.save(
        ctx.engine, ctx.run_dir, state, ctx.cfg.to_dict(), position, ctx.cfg.run.keep_checkpoints
    )
    if export:
        checkpoint.export(ctx.engine, ctx.run_dir, name, ctx.index.tokenizer)
    return name


def train(ctx: RunContext, state: checkpoint.TrainState) -> str:
    """Run until max_steps or SIGTERM; returns "complete" or "stopped"."""
    cfg, engine, run = ctx.cfg, ctx.engine, ctx.cfg.run
    epoch_size = ctx.index.rows("train")
    loader = train_loader(
        ctx.index,
        cfg.data,
        batch_size=run.micro_batch,
        seq_len=ctx.seq_len,
        seed=run.seed,
        rank=ctx.rank,
        world_size=ctx.world,
        start=state.samples,
    )
    loader.worker_init_fn = _ignore_sigterm
    validation = validation_stream(
        ctx.index,
        cfg.data,
        batch_size=run.micro_batch,
        seq_len=ctx.seq_len,
        rank=ctx.rank,
        world_size=ctx.world,
    )
    batches = iter(loader)
    progress = Progress(ctx.rank, run.progress, state.step, run.max_steps)
    per_micro = run.micro_batch * ctx.world
    clock, tokens_at, steps_shown = time.perf_counter(), state.tokens, state.step
    stop_seen, status, in_a_row = False, "complete", 0
    engine.train()
    while state.step < run.max_steps:
        batch = next(batches)
        torch.manual_seed(dropout_seed(run.seed, state.samples, ctx.rank))
        state.samples += per_micro
        inputs = {k: batch[k].to(engine.device) for k in MODEL_INPUTS if k in batch}
        lr = engine.optimizer.param_groups[0]["lr"]
        loss = engine(**inputs)["loss"]
        flags = torch.tensor(
            [
                float(not torch.isfinite(loss.detach()).item()),
                float(ctx.stop.requested),
                float(batch["attention_mask"].sum()),
            ],
            dtype=torch.float64,
        )
        if ctx.world > 1:
            torch.distributed.all_reduce(flags)
        state.tokens += int(flags[2])
        stop_seen = stop_seen or flags[1] > 0
        if flags[0] > 0:
            state.skipped_nonfinite += 1
            in_a_row += 1
            progress.write(
                f"step {state.step + 1}: non-finite loss, micro-batch skipped ({state.skipped_nonfinite} so far)"
            )
            if in_a_row >= run.max_nonfinite:
                raise TrainingError(
                    f"the loss was NaN/inf for {in_a_row} micro-batches in a row at step {state.step + 1}: the run "
                    f"has diverged; lower the lr or resume from an earlier checkpoint in {ctx.run_dir / 'checkpoints'}"
                )
            if stop_seen and engine.micro_steps % run.grad_accum == 0:
                save_and_export(ctx, state, False, epoch_size)
                status = "stopped"
                progress.write(f"SIGTERM: checkpoint saved at step {state.step}; exiting")
                break
            continue
        in_a_row = 0
        engine.backward(loss)
        engine.step()
        state.window_loss += loss.item()
        state.window_micro += 1
        if engine.global_steps == state.step:
            continue  # inside a gradient accumulation
        state.step = engine.global_steps
        now = time.perf_counter()
        tokens_per_s = (state.tokens - tokens_at) / max(now - clock, 1e-9)
        if _due(state.step, run.log_every, run.max_steps):
            record = _log_line(ctx, state, lr, tokens_per_s)
            progress.update(state.step - steps_shown, record["loss"], lr, tokens_per_s)
            clock, tokens_at, steps_shown = now, state.tokens, state.step
        if _due(state.step, run.eval_every, run.max_steps):
            record = run_validation(ctx, state.step, validation)
            progress.write(
                f"step {state.step}: validation loss {record['loss']:.4f} accuracy {record['accuracy']:.4f}"
            )
        export_now = _due(state.step, run.export_every, run.max_steps)
        if stop_seen or export_now or _due(state.step, run.save_every, run.max_steps):
            name = save_and_export(ctx, state, export_now, epoch_size)
            progress.write(
                f"step {state.step}: checkpoint {name}" + (" and export" if export_now else "")
            )
        if stop_seen:
            status = "stopped"
            progress.write(f"SIGTERM: checkpoint saved at step {state.step}; exiting")
            break
    progress.close()
    del batches
    return status
