"""What a run reports: RUN/metrics.jsonl (the DESIGN.md contract), TensorBoard, a progress bar.

Only rank 0 writes. metrics.jsonl has one JSON object per line: training lines
`{"step", "loss", "lr", ...}` and validation lines `{"step", "split": "validation", "loss",
"accuracy"}`. On a resume the lines after the checkpoint's step are dropped, so a restarted run's
file reads as if it had never stopped.
"""

from __future__ import annotations

import json
import math
import sys
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
    path.write_text("".join(f"{line}\n" for line in kept))
    return dropped


class MetricsWriter:
    """metrics.jsonl and TensorBoard scalars on rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool):
        self.active = rank == 0
        self.path = run_dir / METRICS
        self.tb = None
        if self.active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def gpu_hours_before(self, step: int) -> float:
        """GPU-hours of the earlier sessions of a resumed run: its last training line at or
        before `step` (metrics.jsonl is truncated to the checkpoint's step on resume)."""
        hours = 0.0
        if not self.path.is_file():
            return hours
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("gpu_hours") is not None and record.get("step", 0) <= step:
                hours = record["gpu_hours"]
        return hours

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


def postfix(record: dict, lr: float) -> str:
    """The progress line's numbers: loss, lr, tokens/s (total and per GPU), MFU, hours left."""
    loss = record.get("loss")
    parts = [f"loss={loss:.4f}" if loss is not None and math.isfinite(loss) else "loss=-"]
    parts += [f"lr={lr:.2e}", f"tok/s={record['tokens_per_s']:,.0f}"]
    if "tokens_per_s_per_gpu" in record:
        parts.append(f"tok/s/gpu={record['tokens_per_s_per_gpu']:,.0f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu={record['mfu']:.1%}")
    if "hours_to_max_steps" in record:
        parts.append(f"left={record['hours_to_max_steps']:.1f}h")
    return " ".join(parts)


class Progress:
    """tqdm bar on rank 0 (loss, lr, tokens/s; tqdm's own ETA); silent elsewhere."""

    def __init__(self, rank: int, enabled: bool, start: int, total: int, desc: str = "pretrain"):
        self.speaks = rank == 0
        self.bar = tqdm(
            total=total,
            initial=start,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            disable=not (enabled and rank == 0),
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
        self.bar.set_postfix_str(postfix(record, lr), refresh=False)
        self.bar.update(steps)

    def write(self, text: str) -> None:
        """An event line on rank 0 (stderr, above the bar), with or without the bar."""
        if self.speaks:
            tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
