"""What a run reports: RUN/metrics.jsonl (docs/format.md), TensorBoard, a progress bar.

Only rank 0 writes. metrics.jsonl has one JSON object per line: training lines
`{"step", "loss", "lr", ...}` and validation lines `{"step", "split": "validation", "loss",
"accuracy"}`. On a resume the lines after the checkpoint's step are dropped (and TensorBoard's
events after it purged), so a restarted run's file reads as if it had never stopped; the hours
the dropped lines cost stay counted in `gpu_hours`, and apart in `gpu_hours_lost`.

Rates (tokens/s, MFU, the time left) are over training time only: `RunClock` keeps validation
and checkpoint time apart and reports them as such.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

METRICS = "metrics.jsonl"


def gpu_memory(device) -> dict:
    """{"gpu_mem_peak_gb": max allocated, "gpu_mem_reserved_gb": reserved by the caching
    allocator} of a CUDA device since the process began (GiB); {} elsewhere."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return {}
    gib = 2**30
    return {
        "gpu_mem_peak_gb": round(torch.cuda.max_memory_allocated(device) / gib, 3),
        "gpu_mem_reserved_gb": round(torch.cuda.memory_reserved(device) / gib, 3),
    }


def truncate_after(path: Path, step: int) -> int:
    """Drop lines of steps after `step` (work a crash lost); return how many were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill: dropped like the lost steps
            dropped += 1
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:  # a kill mid-rewrite must not cost the run its history: beside, then renamed
        from shatter.train.checkpoint import write_atomic

        write_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


def usage_before(path: Path, step: int) -> tuple[float, float]:
    """(GPU-hours, of which lost) of the earlier sessions of a run resumed at `step`, read from
    metrics.jsonl before its lines after `step` are dropped: every hour they used counts (to
    their last line), and the hours after the checkpoint's own line were lost."""
    last = at_step = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("gpu_hours") is None:
                continue
            last = record
            if record.get("step", 0) <= step:
                at_step = record
    used = last.get("gpu_hours", 0.0)
    lost = at_step.get("gpu_hours_lost", 0.0) + used - at_step.get("gpu_hours", 0.0)
    return used, lost


class MetricsWriter:
    """metrics.jsonl and TensorBoard scalars on rank 0; a no-op elsewhere. `resumed_step` (a
    pretraining run: 0 when fresh) drops what an earlier session logged after it, in both."""

    def __init__(
        self, run_dir: Path, rank: int, tensorboard: bool, resumed_step: int | None = None
    ):
        self.active = rank == 0
        self.path = run_dir / METRICS
        self.tb = None
        self.hours_before = self.hours_lost = 0.0
        if self.active and resumed_step is not None:
            self.hours_before, self.hours_lost = usage_before(self.path, resumed_step)
            truncate_after(self.path, resumed_step)
        if self.active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events of later steps an earlier session wrote are dropped on read
            purge = {} if resumed_step is None else {"purge_step": resumed_step + 1}
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), **purge)

    def write(self, record: dict) -> None:
        if not self.active:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if (
                    key not in ("step", "split")
                    and isinstance(value, (int, float))
                    and value is not None
                ):
                    self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def process_started() -> float:
    """When this process began (time.time() scale), so that GPU-hours count its start-up."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime")
        )
        return boot + int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError, StopIteration):  # not Linux: from now
        return time.time()


class RunClock:
    """Where a session's time goes. Training time is wall time less validation and checkpoint
    time (each kept apart, `aside`); GPU-hours are wall time since the process began x the
    world size, added to the earlier sessions' (lost work included)."""

    ASIDE = ("validation", "checkpoint")

    def __init__(self, world: int, hours_before: float = 0.0, hours_lost: float = 0.0):
        self.world, self.hours_before, self.hours_lost = world, hours_before, hours_lost
        self.started = process_started()
        self.total = dict.fromkeys(("training", *self.ASIDE), 0.0)  # this session's seconds
        self.window = dict.fromkeys(self.ASIDE, 0.0)  # since the last `lap`
        self._mark = time.perf_counter()

    @contextmanager
    def aside(self, kind: str):
        """Time spent in the block is `kind`'s (validation, checkpoint), not training time."""
        began = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - began
            self.window[kind] += spent
            self.total[kind] += spent

    def lap(self) -> dict:
        """{"training_s", "validation_s", "checkpoint_s"} since the last lap; starts the next."""
        now = time.perf_counter()
        training = max(now - self._mark - sum(self.window.values()), 1e-9)
        self.total["training"] += training
        out = {"training_s": training, **{f"{k}_s": v for k, v in self.window.items()}}
        self._mark, self.window = now, dict.fromkeys(self.ASIDE, 0.0)
        return out

    def gpu_hours(self) -> float:
        return self.hours_before + (time.time() - self.started) * self.world / 3600


log = logging.getLogger("shatter.train")
LOG_FILE = "train.log"  # RUN/train.log: rank 0's event and progress lines, time-stamped


def device_word(device) -> str:
    """What the run's devices are called in its lines: GPU-hours on GPUs, device-hours else."""
    return "GPU" if getattr(device, "type", device) == "cuda" else "device"


def h_mm_ss(hours: float) -> str:
    """0.0204 -> '0:01:14' (hours:minutes:seconds, rounded up: seconds to go never show as
    0:00:00; a budget of seconds reads as such, not as 0:01)."""
    seconds = math.ceil(max(hours, 0.0) * 3600 - 1e-6)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def postfix(record: dict, lr: float, per: str = "gpu") -> str:
    """The progress line's numbers: loss, lr, tokens/s (total and per device), MFU, time left."""
    loss = record.get("loss")
    parts = [f"loss={loss:.4f}" if loss is not None and math.isfinite(loss) else "loss=-"]
    parts += [f"lr={lr:.2e}", f"tok/s={record['tokens_per_s']:,.0f}"]
    if "tokens_per_s_per_gpu" in record:
        parts.append(f"tok/s/{per}={record['tokens_per_s_per_gpu']:,.0f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu={record['mfu']:.1%}")
    if "hours_to_max_steps" in record:
        parts.append(f"left={h_mm_ss(record['hours_to_max_steps'])}")
    return " ".join(parts)


def log_to_run(run_dir: Path, rank: int) -> None:
    """Rank 0 writes its event and progress lines to RUN/train.log (appended across resumes);
    Python warnings go through logging there and to stderr, above the bar, once each. A second
    run in the same process (an API caller's, or the tests') takes the log over from the first."""
    if rank != 0:
        return
    path = os.path.abspath(run_dir / LOG_FILE)  # as FileHandler keeps it (baseFilename)
    for old in [h for h in log.handlers if getattr(h, "shatter_run", False)]:
        if old.baseFilename == path:
            return
        log.removeHandler(old)
        old.close()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler.shatter_run = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # stderr gets each line once, from the bar's writer
    warnings.showwarning = _show_warning


_SHOWN: set[str] = set()  # a library's change of filters resets Python's once-per-place registry


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = warnings.formatwarning(message, category, filename, lineno, line).strip()
    if text in _SHOWN:
        return
    _SHOWN.add(text)
    tqdm.write(text, file=sys.stderr)  # above the bar, never spliced into it
    log.warning(text)


LINE_EVERY_S = 30.0  # a piped evaluation's progress line, every this many seconds


def counted(items, total: int, desc: str, show: bool = True):
    """`items` with their progress: on stderr a tqdm bar on a terminal (gone when done), else a
    plain line every LINE_EVERY_S seconds; that line also goes to RUN/train.log when a run logs
    there, terminal or not. A long evaluation in a job's log shows it is alive and how far it got."""
    terminal = sys.stderr.isatty()
    if terminal:
        items = tqdm(items, total=total, desc=desc, unit="batch", leave=False, disable=not show)
    start = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if show and now - last >= LINE_EVERY_S:
            last = now
            line = f"{desc}: {done}/{total} batches, {now - start:.0f} s"
            if not terminal:
                print(line, file=sys.stderr, flush=True)
            if log.handlers:
                log.info("%s", line)


class Progress:
    """tqdm bar on rank 0 (loss, lr, tokens/s; tqdm's own ETA); silent elsewhere."""

    def __init__(
        self,
        rank: int,
        enabled: bool,
        start: int,
        total: int | None,
        desc: str = "pretrain",
        device=None,
    ):
        self.speaks, self.total, self.desc = rank == 0, total, desc
        self.per = device_word(device).lower() if device is not None else "gpu"
        # a terminal gets the bar; a pipe or a file gets plain lines (no carriage returns or
        # cursor escapes in a job's log)
        self.lines = enabled and rank == 0 and not sys.stderr.isatty()
        self.step = start
        self.bar = tqdm(
            total=total,
            initial=start,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            disable=not (enabled and rank == 0) or self.lines,
            smoothing=0.05,
        )

    def update(
        self,
        steps: int,
        loss: float | None,
        lr: float,
        tokens_per_s: float,
        cost: dict | None = None,
    ) -> None:
        """`cost`: tokens/s per GPU, MFU and the hours to max_steps (train/cost.py), if any."""
        record = {"loss": loss, "tokens_per_s": tokens_per_s, **(cost or {})}
        numbers = postfix(record, lr, self.per)
        self.step += steps
        line = f"{self.desc} {self.step}/{self.total or '?'} {numbers}"  # ?: not planned yet
        if self.speaks:
            log.info("%s", line)
        if self.lines:
            print(line, file=sys.stderr, flush=True)
        self.bar.set_postfix_str(numbers, refresh=False)
        self.bar.update(steps)

    def plan(self, total: int) -> None:
        """The run's last step, planned (a budgeted run's, train/budget.py)."""
        self.total = self.bar.total = total
        self.bar.refresh()

    def write(self, text: str) -> None:
        """An event line on rank 0 (stderr, above the bar), with or without the bar; also in
        RUN/train.log."""
        if self.speaks:
            try:
                tqdm.write(text, file=sys.stderr)
            except (OSError, ValueError):  # a hung-up terminal, a dead pipe: train.log has it
                pass
            log.info("%s", text)

    def close(self) -> None:
        self.bar.close()
