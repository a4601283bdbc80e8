"""How long a stop's checkpoint takes: the grace a scheduler must give a run (docs/training.md).

    python tools/bench/save_time.py --presets shatter-tiny,shatter-small,shatter-base

One process (a world of one, gloo, fp32, ZeRO-1, as configs/cpu-tiny.yaml): each preset's engine
after one step, then `checkpoint.save` (every file written, hashed and listed in its manifest)
and the verifying resume's checksum pass (`manifest_problem`), each timed. Prints one line per
preset: parameters, checkpoint bytes, save s, verify s. Under ZeRO each rank writes and hashes
its own partition side by side, so on several ranks the save takes about this over the ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import shatter
from shatter.train import checkpoint
from shatter.train.config import resolve
from shatter.train.engine import build_engine, init_distributed, resolved_deepspeed_config
from shatter.train.resumable import manifest_problem


def one(preset: str, run: Path) -> tuple[int, int, float, float]:
    cfg = resolve(None, {"zero_stage": 1, "micro_batch": 2, "max_steps": 10, "warmup_steps": 1})
    model = shatter.build_model(preset, vocab_size=32000, max_len=128)
    engine = build_engine(model, cfg, resolved_deepspeed_config(cfg, 1))
    ids = torch.randint(5, 32000, (2, 128))
    loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)["loss"]
    engine.backward(loss)
    engine.step()
    started = time.perf_counter()
    name = checkpoint.save(engine, run, checkpoint.TrainState(step=1), {}, {}, keep=0)
    saved = time.perf_counter() - started
    started = time.perf_counter()
    assert manifest_problem(run / checkpoint.CHECKPOINTS / name) is None
    verified = time.perf_counter() - started
    size = sum(p.stat().st_size for p in (run / checkpoint.CHECKPOINTS / name).iterdir())
    return sum(p.numel() for p in model.parameters()), size, saved, verified


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="shatter-tiny,shatter-small")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_PORT", "29571")
    init_distributed()
    print(f"{'preset':16} {'params':>12} {'checkpoint':>12} {'save s':>8} {'verify s':>9}")
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            params, size, saved, verified = one(preset, Path(tmp))
        print(f"{preset:16} {params:12,} {size / 2**20:9.1f} MiB {saved:8.2f} {verified:9.2f}")


if __name__ == "__main__":
    main()
