"""The training loop: functions over a DeepSpeed engine and a small `TrainState` (no trainer class).

No host sync per step on a GPU: the loss window and the non-finite counters stay on the device
and are read at log steps and checkpoints only; the stop request (SIGTERM, Ctrl-C) is agreed
between ranks one optimizer step late through a pinned copy. A micro-batch whose loss is NaN/inf
on some rank is skipped on every rank and counted: on a CPU (where reading a value costs
nothing) before its backward; on a GPU its loss is zeroed instead (fp16 overflow stays the loss
scaler's job). `run.max_nonfinite` in a row stop the run. At each optimizer step: metrics,
validation, checkpoint, export, and a stop after saving when one was requested. Dropout is reseeded
from (seed, stream position, rank) before every micro-batch, so a resumed run draws the same
masks as an uninterrupted one without storing RNG state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline.format import Index
from pipeline.masking import mix64
from train import checkpoint
from train.budget import Budget
from train.config import TrainConfig
from train.cost import cost_model
from train.engine import LossScaleStall, loss_scale, skipped_steps
from train.evaluate import evaluate
from train.lifecycle import StopFlag, ignore_stop_signals
from train.loader import (
    ShardStream,
    StreamPosition,
    source_epochs,
    stream_shape,
    train_loader,
    validation_stream,
)
from train.loader.stream import STORE_ERROR
from train.metrics import MetricsWriter, Progress, RunClock, gpu_memory

MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "perm_rank")  # perm_rank: plm only


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a diverged loss); the message says what to do."""


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
    final_save: bool = True  # checkpoint and export at max_steps (a benchmark's run skips them)
    store_failure: str | None = None  # a loader's store failure (STORE_ERROR): why it stopped
    budget: Budget | None = None  # run.budget_hours: re-plans the run's length (train/budget.py)
    mix: list | None = None  # several --data: (index, weight) of each (`train.loader.mix`)


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
    if record["predictions"]:  # an empty split has no loss: no line rather than a fake 0.0
        ctx.writer.write(record)
    return record


def _log_line(
    ctx: RunContext, state: checkpoint.TrainState, lr: float, tokens_per_s: float, cost: dict
) -> dict:
    window = torch.tensor([state.window_loss, float(state.window_micro)], dtype=torch.float64)
    if ctx.world > 1:
        window = window.to(ctx.engine.device)
        torch.distributed.all_reduce(window)
    window = window.tolist()
    loss = window[0] / window[1] if window[1] > 0 else float("nan")
    record = {
        "step": state.step,
        "objective": ctx.cfg.data.objective,
        "loss": loss,
        "lr": lr,
        "tokens_per_s": tokens_per_s,
        **cost,  # tokens_per_s_per_gpu, mfu, hours_to_max_steps, gpu_hours (train/cost.py)
        "samples": state.samples,
        "epoch": state.samples / stream_shape(ctx.index, ctx.mix, ctx.seq_len)[0],
        "tokens": state.tokens,
        "skipped_nonfinite": state.skipped_nonfinite,
        "grad_norm": _grad_norm(ctx.engine),
        "skipped_steps": skipped_steps(ctx.engine),  # non-finite gradients or an fp16 overflow
        **gpu_memory(ctx.engine.device),
    }
    if ctx.mix:  # each mixed dataset's own epochs
        record["source_epochs"] = source_epochs(
            ctx.mix, ctx.cfg.run.seed, state.samples, ctx.seq_len
        )
    scale = loss_scale(ctx.engine)
    if scale is not None:
        record["loss_scale"] = scale
    ctx.writer.write(record)
    state.window_loss, state.window_micro = 0.0, 0
    return record


class DeviceWindow:
    """What the loop sums per micro-batch, kept where the loss is: [loss sum, micro-batches,
    non-finite micro-batches, current run of them in a row, longest run]. `fold` reads it into
    the `TrainState` (one host sync) at log steps and checkpoints."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def add(self, loss: torch.Tensor, bad: torch.Tensor) -> None:
        s, bad = self.sums, bad.to(torch.float64)
        s[0] += torch.where(bad > 0, 0.0, loss.detach().to(torch.float64))
        s[1] += 1 - bad
        s[2] += bad
        s[3] = (s[3] + 1) * bad  # eq. of a run: reset to 0 by a finite micro-batch
        s[4] = torch.maximum(s[4], s[3])

    def fold(self, state: checkpoint.TrainState) -> tuple[int, int]:
        """Move the sums into `state`; returns (new non-finite micro-batches, longest run)."""
        loss, micro, bad, run, longest = self.sums.tolist()
        state.window_loss += loss
        state.window_micro += int(micro)
        state.skipped_nonfinite += int(bad)
        self.sums[:3] = 0
        self.sums[4] = run
        return int(bad), int(longest)


class LaggedStop:
    """The ranks' agreement on a stop request, one optimizer step late: each boundary posts
    this rank's flag (an async all-reduce and a pinned copy) and reads the previous boundary's
    agreed value, which the GPU finished long ago. One rank alone reads its flag directly."""

    def __init__(self, device: torch.device, world: int):
        self.device, self.world, self.pending = device, world, None

    def __call__(self, requested: bool) -> bool:
        if self.world == 1:
            return requested
        flag = torch.full((1,), float(requested), device=self.device)
        torch.distributed.all_reduce(flag)
        host = torch.empty(1, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        previous, self.pending = self.pending, (host, done)
        if previous is None:
            return False
        previous[1].synchronize()
        return bool(previous[0][0] > 0)


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def save_and_export(
    ctx: RunContext, state: checkpoint.TrainState, export: bool, epoch_size: int
) -> str:
    shape = stream_shape(ctx.index, ctx.mix, ctx.seq_len)[1]
    position = StreamPosition(state.samples, epoch_size, shape).to_dict()
    name = checkpoint.save(
        ctx.engine, ctx.run_dir, state, ctx.cfg.to_dict(), position, ctx.cfg.run.keep_checkpoints
    )
    if export:
        checkpoint.export(ctx.engine, ctx.run_dir, name, ctx.index.tokenizer)
    return name


def _raise_diverged(ctx: RunContext, run: int, step: int) -> None:
    raise TrainingError(
        f"the loss was NaN/inf for {run} micro-batches in a row at step {step}: the run "
        f"has diverged; lower the lr or resume from an earlier checkpoint in {ctx.run_dir / 'checkpoints'}"
    )


def train(ctx: RunContext, state: checkpoint.TrainState) -> str:
    """Run until max_steps or a stop request; returns "complete" or "stopped"."""
    cfg, engine, run = ctx.cfg, ctx.engine, ctx.cfg.run
    epoch_size = stream_shape(ctx.index, ctx.mix, ctx.seq_len)[0]
    loader = train_loader(
        ctx.index,
        cfg.data,
        batch_size=run.micro_batch,
        seq_len=ctx.seq_len,
        seed=run.seed,
        rank=ctx.rank,
        world_size=ctx.world,
        start=state.samples,
        grad_accum=run.grad_accum,
        pin_memory=engine.device.type == "cuda",
        mix=ctx.mix,
    )
    loader.worker_init_fn = ignore_stop_signals
    validation = validation_stream(
        ctx.index,
        cfg.data,
        batch_size=run.micro_batch,
        seq_len=ctx.seq_len,
        rank=ctx.rank,
        world_size=ctx.world,
    )
    batches = iter(loader)
    try:
        return _steps(ctx, state, batches, validation, epoch_size)
    finally:
        # the workers, blocked on their index queues, end now rather than be joined at exit
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del batches


def _steps(ctx: RunContext, state, batches, validation, epoch_size: int) -> str:
    engine, run = ctx.engine, ctx.cfg.run
    progress = Progress(ctx.rank, run.progress, state.step, run.max_steps)
    per_micro = run.micro_batch * ctx.world
    tokens_at, steps_shown = state.tokens, state.step
    stop_seen, status, in_a_row, local_tokens = False, "complete", 0, 0
    cost = cost_model(ctx.cfg, engine.module.config, ctx.seq_len, ctx.world, engine.device)
    clock = RunClock(ctx.world, ctx.writer.hours_before, ctx.writer.hours_lost)
    stall = LossScaleStall(engine, run.max_nonfinite)
    # on a CPU a value costs nothing to read: skip decisions are taken before the backward
    host_reads = engine.device.type == "cpu"
    window = DeviceWindow(engine.device)
    agreed_stop = LaggedStop(engine.device, ctx.world)
    sample_log = _sample_log(ctx.rank)
    sync_debug = os.environ.get("SHATTER_SYNC_DEBUG") if engine.device.type == "cuda" else None
    engine.train()
    while state.step < run.max_steps:
        batch = next(batches)
        if STORE_ERROR in batch and ctx.store_failure is None:  # in-band, from a loader worker
            ctx.store_failure, ctx.stop.requested = batch[STORE_ERROR], True
            ctx.stop.name = "store failure"
        if sample_log is not None:
            sample_log.write(json.dumps([state.samples, batch["sample_id"].tolist()]) + "\n")
        # seeded by the micro-batch's step and slot (train/loader/order.py): the same on any world size
        micro = engine.micro_steps % run.grad_accum
        slot = micro * ctx.world + ctx.rank
        torch.manual_seed(dropout_seed(run.seed, state.samples - micro * per_micro, slot))
        state.samples += per_micro
        if sync_debug:  # SHATTER_SYNC_DEBUG=warn|error: torch flags each host sync of the step
            torch.cuda.set_sync_debug_mode(sync_debug)
        inputs = {
            k: batch[k].to(engine.device, non_blocking=True) for k in MODEL_INPUTS if k in batch
        }
        lr = engine.optimizer.param_groups[0]["lr"]
        loss = engine(**inputs)["loss"]
        if host_reads:
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
                    _raise_diverged(ctx, in_a_row, state.step + 1)
                # it keeps its place in the accumulation, so the step boundary (and the stream
                # position a checkpoint saves) never moves: its loss is zeroed, as on a GPU
                engine.backward(torch.where(flags[0] > 0, torch.zeros_like(loss), loss))
                engine.step()
            else:
                in_a_row = 0
                engine.backward(loss)
                engine.step()
                window.add(loss, torch.zeros((), dtype=torch.float64))
        else:
            local_tokens += int(batch["attention_mask"].sum())  # a CPU tensor: no sync
            bad = (~torch.isfinite(loss.detach())).to(torch.float64)
            if ctx.world > 1:
                torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
            loss = torch.where(bad > 0, torch.zeros_like(loss), loss)  # skipped: no gradient
            engine.backward(loss)
            engine.step()
            window.add(loss, bad)
        if sync_debug:
            torch.cuda.set_sync_debug_mode(0)  # the boundary's reads (logs, saves) are expected
        if engine.global_steps == state.step:
            continue  # inside a gradient accumulation
        state.step = engine.global_steps
        if ctx.budget is not None:
            run = _replan(ctx, state.step)
        if not host_reads:
            stop_seen = stop_seen or agreed_stop(ctx.stop.requested)
        log_now = _due(state.step, run.log_every, run.max_steps)
        last = run.max_steps if ctx.final_save else 0  # 0: no step is the last one to save at
        export_now = _due(state.step, run.export_every, last)
        save_now = stop_seen or export_now or _due(state.step, run.save_every, last)
        if log_now or save_now:
            if not host_reads:
                state.tokens += _global_tokens(ctx, local_tokens)
                local_tokens = 0
            new_bad, longest = window.fold(state)
            if not host_reads and new_bad:
                progress.write(
                    f"step {state.step}: {new_bad} non-finite micro-batches skipped "
                    f"({state.skipped_nonfinite} so far)"
                )
            if not host_reads and longest >= run.max_nonfinite:
                _raise_diverged(ctx, longest, state.step)
        stalled = stall.check(state.step, inputs, batch)  # fp16: before DeepSpeed's min scale
        if stalled:
            raise TrainingError(stalled)
        if log_now:
            lap = clock.lap()  # training time apart from validation and checkpoints
            tokens_per_s = (state.tokens - tokens_at) / lap["training_s"]
            s_per_step = lap["training_s"] / max(state.step - steps_shown, 1)
            costs = cost.fields(tokens_per_s, s_per_step, state.step, clock.gpu_hours())
            costs.update(lap, gpu_hours_lost=clock.hours_lost)
            record = _log_line(ctx, state, lr, tokens_per_s, costs)
            progress.update(state.step - steps_shown, record["loss"], lr, tokens_per_s, costs)
            tokens_at, steps_shown = state.tokens, state.step
        if _due(state.step, run.eval_every, run.max_steps):
            with clock.aside("validation"):
                record = run_validation(ctx, state.step, validation)
            progress.write(
                f"step {state.step}: validation loss {record['loss']:.4f} accuracy {record['accuracy']:.4f}"
                if record["predictions"]
                else f"step {state.step}: no validation data (0 masked tokens), validation skipped"
            )
        if save_now:
            with clock.aside("checkpoint"):
                name = save_and_export(ctx, state, export_now, epoch_size)
            progress.write(
                f"step {state.step}: checkpoint {name}" + (" and export" if export_now else "")
            )
        if stop_seen:
            status = "stopped"
            progress.write(
                f"{ctx.stop.name or 'stop'}: checkpoint saved at step {state.step}; exiting"
            )
            break
    progress.close()
    clock.lap()
    seconds = ", ".join(f"{kind} {s:.0f} s" for kind, s in clock.total.items())
    progress.write(
        f"{clock.gpu_hours():.3f} GPU-hours used to step {state.step} (world size {ctx.world}); "
        f"this session: {seconds}"
    )
    return status


def _replan(ctx: RunContext, step: int):
    """The run's settings after its budget's check at `step`: a new last step once the step time
    is measured, or this step when the budget is spent (it then saves and exports here)."""
    last = ctx.budget.check(step, ctx.cfg.run.max_steps)
    if last is not None and last != ctx.cfg.run.max_steps:
        ctx.cfg = replace(ctx.cfg, run=replace(ctx.cfg.run, max_steps=last))
        scheduler = ctx.engine.lr_scheduler  # the next step's lr, from a new plan
        scheduler.step(scheduler.last_batch_iteration)
    return ctx.cfg.run


def _sample_log(rank: int):
    """SHATTER_SAMPLE_LOG=PREFIX (a debugging aid): each rank appends [stream position, the
    canonical row ids of its micro-batch] per micro-batch to PREFIX.rankR.jsonl."""
    prefix = os.environ.get("SHATTER_SAMPLE_LOG")
    return open(f"{prefix}.rank{rank}.jsonl", "a", buffering=1) if prefix else None


def _global_tokens(ctx: RunContext, local: int) -> int:
    if ctx.world == 1:
        return local
    total = torch.tensor([float(local)], dtype=torch.float64, device=ctx.engine.device)
    torch.distributed.all_reduce(total)
    return int(total.item())
