"""Loader throughput: sequences per second of the training stream at length 256, on one core.

    python tools/bench_loader.py [--data OUT] [--rows 20000] [--batch 128] [--rounds 3]

Contenders, interleaved round by round so that a busy machine slows them alike: static masks
(from the shards), dynamic masking, dynamic whole-word masking. The stream runs in this process
(no DataLoader workers) pinned to one CPU, and includes everything a training step waits for:
shard decode (sha256 on first use), shuffle, gather, masking, padding, tensors. Without --data,
a dataset of random rows is written by the pipeline's own shard writer (full-length rows, as
packing produces; vocabulary 32000, dupe factor 5). The target is >= 20,000 seq/s; the
paper's 8 V100s consume about 339 seq/s (128 x 1.6M steps in 161 h).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import format as pshards  # noqa: E402
from pipeline.format import read_index, sha256_file  # noqa: E402
from pipeline.tokenizer import SPECIAL_PIECES  # noqa: E402
from pipeline.transforms import MaskSpec, mask_table  # noqa: E402
from train.data import MaskingSpec, ShardStream  # noqa: E402


def synthetic_dataset(
    root: Path, rows: int, seq_len: int, vocab: int, dupe: int, seed: int = 0
) -> Path:
    """Random full-length rows in the DESIGN.md layout, written with pipeline.format."""
    rng = np.random.default_rng(seed)
    word_start_table = rng.random(vocab) < 0.7
    (root / pshards.TOKENIZER_FILE).write_bytes(b"benchmark: random ids, no tokenizer")
    splits = {}
    for split, n, shards in (("train", rows, 2), ("validation", 256, 1)):
        entries = []
        per = -(-n // shards)
        for i in range(shards):
            count = min(per, n - i * per)
            ids = rng.integers(5, vocab, (count, seq_len), dtype=np.int32)
            ids[:, 0], ids[:, -1] = SPECIAL_PIECES["[CLS]"], SPECIAL_PIECES["[SEP]"]
            keys = np.sort(rng.integers(0, 2**63, count, dtype=np.uint64))
            table = mask_table(
                keys,
                ids,
                np.full(count, seq_len, np.int32),
                word_start_table,
                vocab,
                MaskSpec("", seed, dupe, 0.15, False),
            )
            info = pshards.write_shard(
                str(root), pshards.shard_name(split, i, shards), table, vocab
            )
            entries.append(info.__dict__)
        splits[split] = {"shards": entries}
    tok = {
        "file": pshards.TOKENIZER_FILE,
        "sha256": sha256_file(root / pshards.TOKENIZER_FILE),
        "vocab_size": vocab,
        "special_ids": dict(SPECIAL_PIECES),
    }
    index = {
        "format": pshards.FORMAT,
        "version": pshards.VERSION,
        "seq_len": seq_len,
        "dupe_factor": dupe,
        "tokenizer": tok,
        "config": {"benchmark": True},
        "splits": splits,
        "counters": {},
    }
    pshards.write_index(str(root), index)
    return root


def run(index, spec: MaskingSpec, batch: int, samples: int, seq_len: int, start: int) -> float:
    stream = ShardStream(
        index, "train", batch_size=batch, seq_len=seq_len, masking=spec, seed=1, start=start
    )
    seen, t0 = 0, time.perf_counter()
    for b in stream:
        seen += len(b["input_ids"])
        if seen >= samples:
            break
    return seen / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", help="a dataset built by shatter-data build (default: a synthetic one)"
    )
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = (
            Path(args.data)
            if args.data
            else synthetic_dataset(Path(tmp), args.rows, args.seq_len, 32000, 5)
        )
        index = read_index(root)
        n = sum(s.rows for s in index.shards("train"))
        contenders = {
            "static (stored masks)": MaskingSpec("static"),
            "dynamic": MaskingSpec("dynamic"),
            "dynamic, whole word": MaskingSpec("dynamic", whole_word=True),
        }
        results = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name, spec in contenders.items():
                results[name].append(run(index, spec, args.batch, n, args.seq_len, start=r * n))
        print(
            f"rows {n}, length {args.seq_len}, batch {args.batch}, 1 core, {args.rounds} rounds "
            f"(load average {os.getloadavg()[0]:.2f})"
        )
        base = np.median(results["dynamic"])
        print(f"{'masking':24s} {'seq/s (median)':>15s} {'best':>10s} {'vs dynamic':>11s}")
        for name, values in results.items():
            print(
                f"{name:24s} {np.median(values):15,.0f} {max(values):10,.0f} {np.median(values) / base:10.2f}x"
            )


if __name__ == "__main__":
    main()
