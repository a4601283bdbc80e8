"""Training throughput per arch: tokens per second of the trainer's step on this CPU, side by side.

    python tools/bench_train.py [--sizes tiny,small] [--seq-len 128] [--micro-batch 16] [--steps 4] [--rounds 2]

Each contender is a real DeepSpeed engine (one process, fp32, ZeRO-0, torch AdamW, as
configs/cpu-tiny.yaml uses) over batches of the real loader (static masks, length --seq-len)
stepping forward, backward and optimizer. Contenders are interleaved round by round, so a busy
machine slows them alike; the table gives the median tokens/s and the ratio to `bert` of the same
size. Random full-length rows from tools/bench_loader.synthetic_dataset (vocabulary 32000).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shatter  # noqa: E402
from pipeline.format import read_index  # noqa: E402
from tools.bench_loader import synthetic_dataset  # noqa: E402
from train.config import resolve  # noqa: E402
from train.data import MaskingSpec, ShardStream  # noqa: E402
from train.engine import build_engine, deepspeed_config, init_distributed  # noqa: E402

INPUTS = ("input_ids", "attention_mask", "labels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--archs", default=",".join(shatter.ARCHS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per contender per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared box OpenMP spin-waiting swamps 2 threads)",
    )
    args = parser.parse_args()
    init_distributed()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        index = read_index(synthetic_dataset(Path(tmp), 2048, args.seq_len, 32000, 1))
        batches = list(
            ShardStream(
                index,
                "train",
                batch_size=args.micro_batch,
                seq_len=args.seq_len,
                masking=MaskingSpec("static"),
                seed=0,
                finite=True,
            )
        )
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


if __name__ == "__main__":
    main()
