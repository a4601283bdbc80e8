"""What each pretraining config costs: tokens, steps and modelled hours per GPU kind.

    shatter-config-cost configs/*.yaml [--mfu 0.4]

Tokens are max_steps x the global batch x the length (packed rows are full). Hours are modelled,
not measured: tokens x the model's training FLOPs per token at that length (train/cost.py) / the
GPU's dense peak at the config's precision (bf16; fp16 on a V100) x `--mfu` x the config's GPU
count. The V100 column also gives the paper's own rate: 1.6M steps of 128 x 256 tokens of
Shatter_GPU in 161 h on 8 V100s is 4.7% of their fp16 peak.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from pathlib import Path

from shatter.config import preset_config
from shatter.options import DISTRIBUTION
from shatter.train.config import resolve
from shatter.train.cost import DEVICE_PEAK_TFLOPS, training_flops_per_token

GPUS = ("H100", "A100", "L4", "V100")
PAPER_V100_MFU = 0.047  # 52.4B tokens x 0.520 GFLOP in 161 h on 8 x 125 TFLOP/s


def cost(path: str, mfu: float) -> dict:
    cfg = resolve(path, {})
    r, length = cfg.run, cfg.data.seq_len or 128
    tokens = r.max_steps * r.micro_batch * r.grad_accum * r.num_gpus * length
    model = preset_config(cfg.model.preset, max_len=length, vocab_size=32000)
    flops = tokens * training_flops_per_token(
        model, length, cfg.data.mask_prob, micro_batch=r.micro_batch
    )
    peaks = dict(DEVICE_PEAK_TFLOPS)
    hours = {}
    for gpu in GPUS:
        peak = peaks[gpu].get("bf16", peaks[gpu]["fp16"]) * 1e12
        hours[gpu] = flops / (peak * mfu * r.num_gpus) / 3600
    hours["V100 (paper's rate)"] = (
        flops / (peaks["V100"]["fp16"] * 1e12 * PAPER_V100_MFU * r.num_gpus) / 3600
    )
    return dict(config=Path(path).name, preset=cfg.model.preset, length=length, gpus=r.num_gpus,
                steps=r.max_steps, tokens=tokens, flops=flops, hours=hours)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    version = importlib.metadata.version(DISTRIBUTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s, version {version}")
    args = parser.parse_args()
    names = list(GPUS) + ["V100 (paper's rate)"]
    print("| config | preset | length | GPUs | steps | tokens | PFLOP | "
          + " | ".join(f"h on {g}" for g in names) + " |")  # fmt: skip
    print("|---" * (7 + len(names)) + "|")
    for path in args.configs:
        c = cost(path, args.mfu)
        hours = " | ".join(f"{c['hours'][g]:,.1f}" for g in names)
        print(f"| {c['config']} | {c['preset']} | {c['length']} | {c['gpus']} | {c['steps']:,} | "
              f"{c['tokens'] / 1e9:.2f}B | {c['flops'] / 1e15:,.0f} | {hours} |")  # fmt: skip


if __name__ == "__main__":
    main()
