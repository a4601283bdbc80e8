"""The training loop: functions over a DeepSpeed engine and a small `TrainState` (no trainer class).

One loop for a CPU and a GPU: what differs sits behind the step guard (train/guard.py). No host
sync per step on a GPU: the loss window and the non-finite counters stay on the device and are
read at log steps and checkpoints only; the stop request (SIGTERM, Ctrl-C) is agreed between
ranks one optimizer step late. A micro-batch whose loss is NaN/inf on some rank is skipped on
every rank and counted; `run.max_nonfinite` in a row stop the run. At each optimizer step:
metrics, validation, checkpoint, export, and a stop after saving when one was requested. Dropout is reseeded
from (seed, stream position, rank) before every micro-batch, so a resumed run draws the same
masks as an uninterrupted one without storing RNG state.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shatter.pipeline.masking import mix64
from shatter.shards import Index
from shatter.train import checkpoint, lifecycle
from shatter.train.budget import Budget
from shatter.train.compiling import mark_varying
from shatter.train.config import TrainConfig
from shatter.train.cost import cost_model
from shatter.train.engine import LossScaleStall, loss_scale, skipped_steps
from shatter.train.evaluate import evaluate
from shatter.train.guard import LossSpike, StepDeadline, StepGuard, TrainingError, step_guard
from shatter.train.lifecycle import StopFlag, ignore_stop_signals
from shatter.train.loader import (
    LOADER_WAIT_SHARE,
    ShardStream,
    StreamPosition,
    WorkerBatches,
    source_epochs,
    stream_shape,
    train_loader,
    validation_stream,
)
from shatter.train.loader.stream import STORE_ERROR
from shatter.train.metrics import MetricsWriter, Progress, RunClock, device_word, gpu_memory

# perm_rank: plm only; predicted: the labels' positions, counted by the loader (no host sync)
MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "perm_rank", "predicted")


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
    mix: list | None = None  # several --data: (index, weight) of each (`shatter.train.loader.mix`)
    budget_ceiling: int = 0  # a budgeted run's --max-steps, the most its plan may hold

    def __post_init__(self):
        self.budget_ceiling = self.budget_ceiling or self.cfg.run.max_steps


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
    batches = WorkerBatches(loader, run.collective_timeout_s * LOADER_WAIT_SHARE)
    try:
        return _steps(ctx, state, batches, validation, epoch_size)
    finally:
        batches.close()
        del batches


@dataclass
class Loop:
    """What the step loop keeps besides the `TrainState`."""

    progress: Progress
    guard: StepGuard
    clock: RunClock  # training time apart from validation and checkpoints; GPU-hours
    stall: LossScaleStall  # fp16: stops the run before DeepSpeed's minimum loss scale
    cost: object  # shatter.train.cost's model: tokens/s and MFU per log line
    validation: ShardStream
    epoch_size: int
    sample_log: object | None  # a file (run.sample_log), or None
    tokens_at: int  # state.tokens at the last log line
    steps_shown: int  # state.step then
    deadline: StepDeadline | None = None  # after a stop request: can the step still be saved
    marked: checkpoint.TrainState | None = None  # the state at the last step boundary
    last: tuple[dict, dict] = ({}, {})  # the last micro-batch: (its inputs, its batch)
    status: str = "complete"
    spike: LossSpike | None = None  # divergence: loss spikes at log lines
    spike_kept: Path | None = None  # the checkpoint protected at a spike's start


def _steps(ctx: RunContext, state, batches, validation, epoch_size: int) -> str:
    """Micro-batches until max_steps or an agreed stop; returns "complete" or "stopped"."""
    loop = _start_loop(ctx, state, validation, epoch_size)
    ctx.engine.train()
    while state.step < ctx.cfg.run.max_steps:
        lr = _micro_batch(ctx, loop, state, next(batches))
        if loop.guard.abandoned:
            _abandon(ctx, loop, state)
            break
        if ctx.engine.global_steps == state.step:
            continue  # inside a gradient accumulation
        state.step = ctx.engine.global_steps
        loop.deadline.step_ended()
        if _step_boundary(ctx, loop, state, lr):
            break
        _mark(loop, state)
    loop.progress.close()
    clock = loop.clock
    clock.lap()
    seconds = ", ".join(f"{kind} {s:.0f} s" for kind, s in clock.total.items())
    word = device_word(ctx.engine.device)
    loop.progress.write(
        f"{clock.gpu_hours():.3f} {word}-hours used to step {state.step} (world size "
        f"{ctx.world}); this session: {seconds}"
    )
    return loop.status


def _start_loop(ctx: RunContext, state, validation, epoch_size: int) -> Loop:
    engine, run = ctx.engine, ctx.cfg.run
    unplanned = ctx.budget is not None and ctx.budget.planned is None  # its length not yet set
    total = None if unplanned else run.max_steps
    progress = Progress(ctx.rank, run.progress, state.step, total, device=engine.device)
    advice = f"lower the lr or resume from an earlier checkpoint in {ctx.run_dir / 'checkpoints'}"
    guard = step_guard(engine.device, ctx.world, run.max_nonfinite, progress.write, advice)
    clock = RunClock(ctx.world, ctx.writer.hours_before, ctx.writer.hours_lost)
    stall = LossScaleStall(engine, run.max_nonfinite)
    cost = cost_model(ctx.cfg, engine.module.config, ctx.seq_len, ctx.world, engine.device)
    log = run.sample_log and open(f"{run.sample_log}.rank{ctx.rank}.jsonl", "a", buffering=1)
    deadline = StepDeadline(run.grad_accum, lifecycle.LAUNCHER_KILL_S, time.monotonic)
    return Loop(
        progress,
        guard,
        clock,
        stall,
        cost,
        validation,
        epoch_size,
        log or None,
        state.tokens,
        state.step,
        spike=LossSpike(run.diverge_factor, run.diverge_lines),
        deadline=deadline,
        marked=replace(state),
    )


def _micro_batch(ctx: RunContext, loop: Loop, state, batch: dict) -> float:
    """Forward, backward and step of one micro-batch (through the guard); returns the lr it ran
    at."""
    engine, run = ctx.engine, ctx.cfg.run
    if STORE_ERROR in batch and ctx.store_failure is None:  # in-band, from a loader worker
        ctx.store_failure, ctx.stop.requested = batch[STORE_ERROR], True
        ctx.stop.name = "store failure"
    if loop.sample_log is not None:  # run.sample_log: [stream position, its row ids]
        loop.sample_log.write(json.dumps([state.samples, batch["sample_id"].tolist()]) + "\n")
    # seeded by the micro-batch's step and slot (train/loader/order.py): the same on any world size
    per_micro = run.micro_batch * ctx.world
    micro = engine.micro_steps % run.grad_accum
    slot = micro * ctx.world + ctx.rank
    torch.manual_seed(dropout_seed(run.seed, state.samples - micro * per_micro, slot))
    state.samples += per_micro
    watch = run.sync_debug if engine.device.type == "cuda" else None
    if watch:  # run.sync_debug: torch flags each host sync of the step
        torch.cuda.set_sync_debug_mode(watch)
    tokens = int(batch["attention_mask"].sum())  # a CPU tensor: no sync
    # a batch without padding goes without its mask: BERT's SDPA then runs the flash kernel
    # (any mask, all ones included, keeps it on the memory-efficient one)
    full = tokens == batch["attention_mask"].numel()
    names = [k for k in MODEL_INPUTS if k in batch and not (full and k == "attention_mask")]
    inputs = {k: batch[k].to(engine.device, non_blocking=True) for k in names}
    mark_varying(inputs)
    lr = engine.optimizer.param_groups[0]["lr"]
    loss = engine(**inputs)["loss"]
    stop = ctx.stop
    over = stop.requested and loop.deadline.over(stop.requested_at, micro)
    loop.guard.micro_step(engine, loss, tokens, stop.requested, state, over)
    if watch:
        torch.cuda.set_sync_debug_mode(0)  # the boundary's reads (logs, saves) are expected
    loop.last = (inputs, batch)
    return lr


def _step_boundary(ctx: RunContext, loop: Loop, state, lr: float) -> bool:
    """After optimizer step `state.step`: metrics, validation, checkpoint, export; True when the
    run stops here (after saving)."""
    run = ctx.cfg.run if ctx.budget is None else _replan(ctx, loop, state.step)
    stop_seen = loop.guard.stop(ctx.stop.requested)
    if stop_seen:
        ctx.stop.agreed()  # this rank's own cause, in its line of train.log
    log_now = _due(state.step, run.log_every, run.max_steps)
    last = run.max_steps if ctx.final_save else 0  # 0: no step is the last one to save at
    export_now = _due(state.step, run.export_every, last)
    save_now = stop_seen or export_now or _due(state.step, run.save_every, last)
    if log_now or save_now:
        loop.guard.settle(state)
    stalled = loop.stall.check(state.step, *loop.last)  # fp16: before DeepSpeed's min scale
    if stalled:
        raise TrainingError(stalled)
    if log_now:
        _log(ctx, loop, state, lr)
    if _due(state.step, run.eval_every, run.max_steps):
        with loop.clock.aside("validation"):
            record = run_validation(ctx, state.step, loop.validation)
        loop.progress.write(
            f"step {state.step}: validation loss {record['loss']:.4f} accuracy {record['accuracy']:.4f}"
            if record["predictions"]
            else f"step {state.step}: no validation data (0 masked tokens), validation skipped"
        )
    if save_now:
        with loop.clock.aside("checkpoint"):
            began = time.monotonic()
            name = save_and_export(ctx, state, export_now, loop.epoch_size)
            loop.deadline.save_s = time.monotonic() - began
        loop.progress.write(
            f"step {state.step}: checkpoint {name}" + (" and export" if export_now else "")
        )
    if stop_seen:
        _stop(ctx, loop, state, save=False)
    return stop_seen


def _log(ctx: RunContext, loop: Loop, state, lr: float) -> None:
    lap = loop.clock.lap()  # training time apart from validation and checkpoints
    tokens_per_s = (state.tokens - loop.tokens_at) / lap["training_s"]
    s_per_step = lap["training_s"] / max(state.step - loop.steps_shown, 1)
    costs = loop.cost.fields(tokens_per_s, s_per_step, state.step, loop.clock.gpu_hours())
    costs.update(lap, gpu_hours_lost=loop.clock.hours_lost)
    if ctx.budget is not None and not ctx.budget.tail:  # its budget's time left, whatever its
        costs["hours_to_max_steps"] = ctx.budget.left() / 3600  # plan (in a tail: its steps')
    record = _log_line(ctx, state, lr, tokens_per_s, costs)
    loop.progress.update(state.step - loop.steps_shown, record["loss"], lr, tokens_per_s, costs)
    loop.tokens_at, loop.steps_shown = state.tokens, state.step
    _watch_divergence(ctx, loop, state.step, record["loss"])


def _watch_divergence(ctx: RunContext, loop: Loop, step: int, loss: float) -> None:
    """A loss spike keeps the checkpoint from before it from pruning; `run.diverge_lines` of them
    in a row stop the run (train/guard.py's `LossSpike`), with that checkpoint the newest."""
    spike = loop.spike
    event = spike.check(step, loss)
    if event is None:
        return
    directory = ctx.run_dir / checkpoint.CHECKPOINTS
    before = checkpoint.newest_complete(directory, spike.healthy_step)
    if event == "spike":
        loop.progress.write(
            f"step {step}: loss {loss:.4g} above {spike.factor:g} × its running median "
            f"{spike.median:.4g}: a spike" + (f"; {before.name} kept" if before else "")
        )
        if ctx.rank == 0 and before is not None and not (before / checkpoint.PROTECTED).exists():
            checkpoint.protect(before, "the newest checkpoint from before a loss spike")
            loop.spike_kept = before
    elif event == "over":
        if ctx.rank == 0 and loop.spike_kept is not None:
            (loop.spike_kept / checkpoint.PROTECTED).unlink(missing_ok=True)
        loop.spike_kept = None
    else:
        if ctx.rank == 0:
            checkpoint.set_aside_after(directory, spike.healthy_step, "diverged-")
            if before is not None:
                checkpoint.write_atomic(directory / checkpoint.LATEST, before.name)
        raise spike.error(step, loss, before.name if before else None)


def _mark(loop: Loop, state) -> None:
    """A step boundary done: what an abandoned next step goes back to."""
    loop.guard.mark()
    loop.marked = replace(state)
    loop.deadline.step_began()


def _abandon(ctx: RunContext, loop: Loop, state) -> None:
    """The ranks agreed that the step in progress cannot finish and be saved before the
    launcher's SIGKILL (`StepDeadline`): its micro-batches' gradients are dropped (the optimizer
    has not stepped, so the engine holds the last completed step), the state and stream position
    go back to that step's, and its checkpoint is saved; a resume redoes the whole step."""
    engine, accum = ctx.engine, ctx.cfg.run.grad_accum
    done = engine.micro_steps % accum
    engine.optimizer.zero_grad(set_to_none=True)
    engine.micro_steps -= done
    vars(state).update(vars(loop.marked))
    loop.guard.rewind()
    line = (
        f"{ctx.stop.agreed()}: step {state.step + 1} abandoned after {done} of its {accum} "
        f"micro-batches: it could not finish and be saved within {loop.deadline.grace_s:.0f} s "
        "of the stop request (the deepspeed launcher's SIGKILL)"
    )
    ctx.stop.note(line)
    loop.progress.write(line)
    loop.guard.settle(state)
    _stop(ctx, loop, state, save=True)


def _stop(ctx: RunContext, loop: Loop, state, save: bool) -> None:
    """An agreed stop request: the checkpoint (`save`: not written yet), and the run ends."""
    if save:
        save_and_export(ctx, state, False, loop.epoch_size)
    loop.status = "stopped"
    line = f"{ctx.stop.name or 'stop'}: checkpoint saved at step {state.step}; exiting"
    ctx.stop.note(line)
    loop.progress.write(line)


def _replan(ctx: RunContext, loop: Loop, step: int):
    """The run's settings after its budget's check at `step`: a new last step as the step time
    is measured, or this step when the budget is spent (it then saves and exports here); the
    progress counts to the planned step."""
    last = ctx.budget.check(step, ctx.budget_ceiling)
    if ctx.budget.note:
        loop.progress.write(ctx.budget.note)
    if last is not None and last != ctx.cfg.run.max_steps:
        ctx.cfg = replace(ctx.cfg, run=replace(ctx.cfg.run, max_steps=last))
        scheduler = ctx.engine.lr_scheduler  # the next step's lr, from a new plan
        scheduler.step(scheduler.last_batch_iteration)
        loop.progress.plan(last)
        loop.cost = replace(loop.cost, max_steps=last)
    return ctx.cfg.run
