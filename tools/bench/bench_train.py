"""Training throughput per arch: tokens per second of the trainer's step on this CPU, side by side.

    python tools/bench/bench_train.py [--sizes tiny,small] [--seq-len 128] [--micro-batch 16] [--steps 4] [--rounds 2]

Each contender is a real DeepSpeed engine (one process, fp32, ZeRO-0, torch AdamW, as
configs/cpu-tiny.yaml uses) over batches of the real loader (static masks, length --seq-len)
stepping forward, backward and optimizer. Contenders are interleaved round by round, so a busy
machine slows them alike; the table gives the median tokens/s and the ratio to `bert` of the same
size. Random full-length rows from tools/bench/bench_loader.synthetic_dataset (vocabulary 32000).

    python tools/bench/bench_train.py --device cuda [--sizes base] [--archs shatter,bert]

With `--device cuda` the defaults are what users run (configs/h100x8-base-256.yaml): bf16,
ZeRO-1, length 256, micro-batches 16 and 64 (`--micro-batch 16,64`). `--vs-bare` (the default
with `--device cuda`): per contender, the trainer's own loop (train/loop.py over the real loader,
tokens/s and MFU of its metrics.jsonl line after a warm-up window; the model compiled where
`run.compile` unset compiles, a GPU) beside the bare model step (eager: forward, backward,
torch's fused AdamW, the same precision, batches already on the device) and
their ratio: what the trainer's host work, DeepSpeed's wrapper and syncs cost. Each contender
starts from freed memory with the peak counter reset, so its peak GiB is its own.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import shatter
from shatter.shards import read_index
from shatter.tools.bench.bench_loader import synthetic_dataset
from shatter.train.config import resolve
from shatter.train.engine import build_engine, deepspeed_config, init_distributed
from shatter.train.loader import MaskingSpec, ShardStream

# the model's inputs of the trainer's batches: `predicted`, the labels' positions the loader counts
INPUTS = ("input_ids", "attention_mask", "labels", "predicted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--archs", default=",".join(shatter.ARCHS))
    parser.add_argument("--seq-len", type=int, help="default: 256 on cuda, 128 on cpu")
    parser.add_argument(
        "--micro-batch", help="comma-separated; default: 16,64 on cuda (--vs-bare), 16 on cpu"
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared box OpenMP spin-waiting swamps 2 threads)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), help="cuda: bf16; cpu: fp32"
    )
    parser.add_argument("--zero-stage", type=int, help="the trainer's ZeRO stage (cuda: 1)")
    parser.add_argument(
        "--vs-bare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trainer loop vs bare model step (default: on with --device cuda)",
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help="--vs-bare: the trainer checkpoints and exports at its last step, as a run does "
        "(off: the timing needs neither, and a base-size save costs seconds per contender)",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_train.py: --device cuda but torch sees no CUDA device; use --device cpu")
    cuda = args.device == "cuda"
    args.seq_len = args.seq_len or (256 if cuda else 128)
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.zero_stage = args.zero_stage if args.zero_stage is not None else int(cuda)
    if args.vs_bare if args.vs_bare is not None else cuda:
        for micro_batch in (args.micro_batch or ("16,64" if cuda else "16")).split(","):
            trainer_vs_bare(argparse.Namespace(**{**vars(args), "micro_batch": int(micro_batch)}))
        return
    args.micro_batch = int(args.micro_batch or 16)
    init_distributed()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        index = read_index(synthetic_dataset(Path(tmp), 2048, args.seq_len, 32000, 1))
        batches = static_batches(index, args)
    cfg = resolve(None, {"micro_batch": args.micro_batch, "max_steps": 10**6, "warmup_steps": 10})
    contenders = {}
    for size in args.sizes.split(","):
        for arch in args.archs.split(","):
            torch.manual_seed(0)
            model = shatter.build_model(
                f"{arch}-{size}", vocab_size=32000, max_len=max(512, args.seq_len)
            )
            contenders[(arch, size)] = build_engine(model, cfg, deepspeed_config(cfg, 1))
    results = {key: [] for key in contenders}
    cursor = 0
    for r in range(args.rounds + 1):  # round 0 warms up allocator and kernels; not recorded
        for key, engine in contenders.items():
            tokens, t0 = 0, time.perf_counter()
            for _ in range(args.steps if r else 1):
                batch = batches[cursor % len(batches)]
                cursor += 1
                loss = engine(**{k: batch[k] for k in INPUTS})["loss"]
                engine.backward(loss)
                engine.step()
                tokens += int(batch["attention_mask"].sum())
            if r:
                results[key].append(tokens / (time.perf_counter() - t0))
    print(
        f"micro-batch {args.micro_batch} x length {args.seq_len}, fp32, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds x {args.steps} steps (load average {os.getloadavg()[0]:.2f})"
    )
    sizes = args.sizes.split(",")
    print(f"{'arch':12s}" + "".join(f"{size + ' tok/s':>14s}{'vs bert':>9s}" for size in sizes))
    for arch in args.archs.split(","):
        row = f"{arch:12s}"
        for size in sizes:
            value = np.median(results[(arch, size)])
            bert = np.median(results[("bert", size)]) if ("bert", size) in results else float("nan")
            row += f"{value:14,.0f}{value / bert:8.2f}x"
        print(row)


def static_batches(index, args, max_samples: int | None = None) -> list[dict]:
    """One pass of the train split with static masks, in memory."""
    stream = ShardStream(
        index,
        "train",
        batch_size=args.micro_batch,
        seq_len=args.seq_len,
        masking=MaskingSpec("static"),
        seed=0,
        finite=True,
        max_samples=max_samples,
    )
    return list(stream)


def bare_tokens_per_s(model, batches, precision: str, device: torch.device, steps: int) -> float:
    """Forward, backward and AdamW (fused on a GPU) on batches already on the device."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    staged = [{k: b[k].to(device) for k in INPUTS} for b in batches]

    def step(batch):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**batch)["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for i in range(steps):  # warm-up
        step(staged[i % len(staged)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    tokens, t0 = 0, time.perf_counter()
    for i in range(steps):
        batch = staged[i % len(staged)]
        step(batch)
        tokens += int(batches[i % len(batches)]["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def trainer_tokens_per_s(model, index, data_dir: Path, run_dir: Path, args) -> dict:
    """The real loop for 2 x --steps steps; tokens/s of its second metrics window."""
    import json

    from shatter.train import checkpoint
    from shatter.train.lifecycle import StopFlag
    from shatter.train.loop import RunContext, train
    from shatter.train.metrics import MetricsWriter

    flags = {
        "data": str(data_dir),
        "output": str(run_dir),
        "micro_batch": args.micro_batch,
        "max_steps": 2 * args.steps,
        "warmup_steps": 1,
        "log_every": args.steps,
        "eval_every": 10**9,
        "save_every": 10**9,
        "export_every": 10**9,
        "precision": args.precision,
        "zero_stage": args.zero_stage,
        "progress": False,
        "num_workers": 2,
    }
    cfg = resolve(None, flags)
    cfg = type(cfg)(
        cfg.model,
        replace(cfg.data, eval_samples=args.micro_batch),
        cfg.optim,
        replace(cfg.run, tensorboard=False),
    )
    from shatter.train.compiling import compile_model, wants_compile

    if wants_compile(cfg.run.compile, args.device, cfg.run.zero_stage):
        compile_model(model)  # as train/pretrain.py does: `run.compile` unset compiles on a GPU
    engine = build_engine(model, cfg, deepspeed_config(cfg, 1))
    run_dir.mkdir(parents=True, exist_ok=True)
    writer = MetricsWriter(run_dir, 0, False)
    ctx = RunContext(cfg, index, engine, 0, 1, run_dir, args.seq_len, writer, StopFlag(), args.save)
    train(ctx, checkpoint.TrainState())
    engine.destroy()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "split" not in x]
    return train_lines[1]


def fresh_peak(device: torch.device) -> None:
    """Free what earlier contenders left and restart the peak counter, so that a contender's
    peak GiB is its own (torch's counter is otherwise the process's maximum so far)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def trainer_vs_bare(args) -> None:
    if not torch.distributed.is_initialized():
        init_distributed()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    print(
        f"{args.device}, {args.precision}, ZeRO-{args.zero_stage}, micro-batch {args.micro_batch} "
        f"x length {args.seq_len}, {args.steps} timed steps (load average {os.getloadavg()[0]:.2f})"
    )
    print(
        f"{'model':16s}{'trainer tok/s':>15s}{'MFU':>7s}{'bare tok/s':>13s}{'ratio':>8s}"
        f"{'trainer GiB':>13s}{'bare GiB':>10s}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = synthetic_dataset(Path(tmp), 4096, args.seq_len, 32000, 1)
        index = read_index(data_dir)
        batches = static_batches(index, args, max_samples=args.micro_batch * args.steps)
        for size in args.sizes.split(","):
            for arch in args.archs.split(","):
                name = f"{arch}-{size}"
                fresh_peak(device)
                torch.manual_seed(0)
                model = shatter.build_model(name, vocab_size=32000, max_len=max(512, args.seq_len))
                record = trainer_tokens_per_s(
                    model, index, data_dir, Path(tmp) / f"run-{name}-{args.micro_batch}", args
                )
                trainer_peak = peak_gib(device)
                del model
                fresh_peak(device)
                torch.manual_seed(0)
                bare_model = shatter.build_model(
                    name, vocab_size=32000, max_len=max(512, args.seq_len)
                ).to(device)
                bare = bare_tokens_per_s(bare_model, batches, args.precision, device, args.steps)
                print_row(name, record, trainer_peak, bare, peak_gib(device))  # as it comes
                del bare_model


def print_row(name: str, record: dict, trainer_peak, bare: float, bare_peak) -> None:
    gib = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    mfu = record.get("mfu")
    print(
        f"{name:16s}{record['tokens_per_s']:15,.0f}{(f'{mfu:.1%}' if mfu else '-'):>7s}"
        f"{bare:13,.0f}{record['tokens_per_s'] / bare:8.2f}"
        f"{gib(trainer_peak):>13s}{gib(bare_peak):>10s}",
        flush=True,
    )


if __name__ == "__main__":
    main()
