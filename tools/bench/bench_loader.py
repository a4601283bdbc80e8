"""Loader throughput (sequences per second at length 256, on one core), and loader memory and
stalls at large shards.

    python tools/bench/bench_loader.py [--data OUT] [--rows 20000] [--batch 128] [--rounds 3]
    python tools/bench/bench_loader.py --memory [--shard-mb 1024] [--baseline CHECKOUT] [--data OUT]
    python tools/bench/bench_loader.py --data s3://BUCKET/OUT   # the store: cold and warm cache vs local
    python tools/bench/bench_loader.py --cut 512 --cut-to 128,256 [--rows 4000]   # cut rows vs uncut

Contenders, interleaved round by round so that a busy machine slows them alike: static masks
(from the shards), the same without checking sha256s (`data.verify_shards` false: neither the
shard's on first use nor each record batch's as it is read, so the gap is their cost), dynamic
masking, dynamic whole-word masking. The stream runs in this process
(no DataLoader workers) pinned to one CPU, and includes everything a training step waits for:
shard decode (sha256 on first use), shuffle, gather, masking, padding, tensors. Without --data,
a dataset of random rows is written by the pipeline's own shard writer (full-length rows, as
packing produces; vocabulary 32000, dupe factor 5). The target is >= 20,000 seq/s; the
paper's 8 V100s consume about 339 seq/s (128 x 1.6M steps in 161 h).

`--memory`: one loader worker (a subprocess running the stream, as a DataLoader worker does) per
code checkout, this one and `--baseline` (e.g. a checkout of an older commit), on the same
dataset of two train shards of `--shard-mb` MB each. It starts `--before` batches ahead of the
boundary between the epoch's first and second shard and reports the worker's peak RSS (VmHWM,
less its RSS after imports and a warm-up batch of the validation split), its first batch's latency, and the median and worst gap between two
consecutive batches, and where it fell (batch 0 is the first one to read the second shard): where
a shard is decoded whole, the worst gap is that boundary.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import shatter.shards as pshards
from shatter.pipeline.tokenizer import SPECIAL_PIECES
from shatter.pipeline.transforms import MaskSpec, mask_table
from shatter.shards import read_index, sha256_file
from shatter.train.loader import MaskingSpec, ShardStream


def synthetic_dataset(
    root: Path,
    rows: int,
    seq_len: int,
    vocab: int,
    dupe: int,
    seed: int = 0,
    train_shards: int = 2,
) -> Path:
    """Random full-length rows in the shard layout (docs/format.md), written chunk by chunk (bounded memory)
    with shatter.shards's writer."""
    rng = np.random.default_rng(seed)
    word_start_table = rng.random(vocab) < 0.7
    root.mkdir(parents=True, exist_ok=True)
    (root / pshards.TOKENIZER_FILE).write_bytes(b"benchmark: random ids, no tokenizer")
    splits = {}
    chunk = pshards.record_batch_rows(seq_len)
    for split, n, shards in (("train", rows, train_shards), ("validation", 256, 1)):
        entries = []
        per = -(-n // shards)
        for i in range(shards):
            name = pshards.shard_name(split, i, shards)
            with pshards.ShardWriter(str(root), name, pshards.schema(vocab), chunk) as writer:
                for lo in range(0, min(per, n - i * per), chunk):
                    count = min(chunk, per - lo, n - i * per - lo)
                    ids = rng.integers(5, vocab, (count, seq_len), dtype=np.int32)
                    ids[:, 0], ids[:, -1] = SPECIAL_PIECES["[CLS]"], SPECIAL_PIECES["[SEP]"]
                    keys = np.sort(rng.integers(0, 2**63, count, dtype=np.uint64))
                    spec = MaskSpec("", seed, dupe, 0.15, False)
                    lengths = np.full(count, seq_len, np.int32)
                    writer.write(mask_table(keys, ids, lengths, word_start_table, vocab, spec))
            entries.append(writer.info)
        splits[split] = entries
    index = pshards.build_index(
        splits,
        seq_len=seq_len,
        dupe_factor=dupe,
        tokenizer_sha256=sha256_file(root / pshards.TOKENIZER_FILE),
        vocab_size=vocab,
        special_ids=SPECIAL_PIECES,
        config={"benchmark": True},
    )
    pshards.write_index(str(root), index)
    return root


# One loader worker's stream in a fresh process that imports `train` from the checkout on its
# PYTHONPATH (this one or --baseline); it prints one JSON line.
WORKER = """
import json, sys, time
import numpy as np, torch
from shatter.shards import read_index
from shatter.train.loader import MaskingSpec, ShardStream

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

root, batch, before, after, seed = sys.argv[1], *map(int, sys.argv[2:6])
torch.set_num_threads(1)
index = read_index(root)
rows = [s.rows for s in index.shards("train")]
first = int(np.random.default_rng([seed, 0]).permutation(len(rows))[0])  # epoch 0's first shard
warm = ShardStream(index, "validation", batch_size=batch, seq_len=index.seq_len,
                   masking=MaskingSpec("static"), seed=seed, finite=True, shuffle=False)
next(iter(warm))  # the reading code's own pages (Arrow's IPC and zstd code) are not the loader's
del warm
rss0 = status("VmRSS")
stream = ShardStream(index, "train", batch_size=batch, seq_len=index.seq_len,
                     masking=MaskingSpec("static"), seed=seed, start=rows[first] - before * batch)
t0 = time.perf_counter()
it = iter(stream)
next(it)
t1 = time.perf_counter()
first_batch, gaps, last = t1 - t0, [], t1
for _ in range(before + after):
    next(it)
    now = time.perf_counter()
    gaps.append(now - last)
    last = now
print(json.dumps({"rss0": rss0, "hwm": status("VmHWM"), "first": first_batch,
                  "median_gap": float(np.median(gaps)), "worst_gap": max(gaps),
                  "worst_at": int(np.argmax(gaps)) + 1 - before}))
"""


def worker_run(root: Path, checkout: str, batch: int, before: int, after: int) -> dict:
    """One loader worker's figures (`WORKER`) in a fresh process importing from `checkout`:
    {rss0, hwm (bytes), first (s), median_gap, worst_gap (s), worst_at (batch from the boundary)}."""
    import json
    import subprocess

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")])),
    }
    argv = [str(root), batch, before, after, 1]
    done = subprocess.run(
        [sys.executable, "-c", WORKER, *map(str, argv)],
        env=env,
        cwd=checkout,  # `python -c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"bench_loader: the loader worker of {checkout} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def memory(args) -> None:
    """Per-worker peak RSS and worst gap between batches, this checkout vs --baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data or Path(tmp) / "data")
        if not (root / pshards.INDEX_FILE).exists():  # written here (and kept, with --data)
            # rows of a shard of --shard-mb MB: measured bytes per row of a small sample shard
            sample = synthetic_dataset(Path(tmp) / "sample", 2048, args.seq_len, 32000, 5, 1, 1)
            per_row = read_index(sample).shards("train")[0].bytes / 2048
            rows = 2 * int(args.shard_mb * 2**20 / per_row)
            root.mkdir(parents=True, exist_ok=True)
            t = time.perf_counter()
            synthetic_dataset(root, rows, args.seq_len, 32000, 5)
            print(f"wrote {rows} rows in 2 train shards in {time.perf_counter() - t:.0f} s")
        index = read_index(root)
        mb = [s.bytes / 2**20 for s in index.shards("train")]
        checkouts = {"this checkout": str(Path(__file__).resolve().parents[2])}
        if args.baseline:
            checkouts = {"baseline": str(Path(args.baseline).resolve()), **checkouts}
        results = {
            name: worker_run(root, checkout, args.batch, args.before, args.after)
            for name, checkout in checkouts.items()
        }
        print(
            f"2 train shards of {mb[0]:.0f} and {mb[1]:.0f} MB, {index.shards('train')[0].rows} "
            f"rows each, length {index.seq_len}, batch {args.batch}, static masks, shuffled; "
            f"{args.before} batches before the shard boundary, {args.after} after "
            f"(load average {os.getloadavg()[0]:.2f})"
        )
        print(
            f"{'checkout':14s} {'peak RSS MB':>12s} {'after imports':>14s} {'first batch s':>14s}"
            f" {'median gap ms':>14s} {'worst gap ms':>13s} {'at batch':>9s}"
        )
        for name, r in results.items():
            print(
                f"{name:14s} {(r['hwm'] - r['rss0']) / 2**20:12.0f} {r['rss0'] / 2**20:14.0f} "
                f"{r['first']:14.2f} {r['median_gap'] * 1e3:14.1f} {r['worst_gap'] * 1e3:13.0f} "
                f"{r['worst_at']:+9d}"
            )
        if len(results) == 2:
            old, new = results.values()
            print(
                f"ratio baseline / this: peak RSS {(old['hwm'] - old['rss0']) / (new['hwm'] - new['rss0']):.1f}x, "
                f"worst gap {old['worst_gap'] / new['worst_gap']:.1f}x"
            )


def run(
    index, spec: MaskingSpec, batch: int, samples: int, seq_len: int, start: int, verify: bool
) -> float:
    stream = ShardStream(
        index, "train", batch_size=batch, seq_len=seq_len, masking=spec, seed=1, start=start,
        verify=verify,
    )  # fmt: skip
    seen, t0 = 0, time.perf_counter()
    for b in stream:
        seen += len(b["input_ids"])
        if seen >= samples:
            break
    return seen / (time.perf_counter() - t0)


def epoch_tokens_per_s(
    index, batch: int, seq_len: int, prefetch: bool = True, verify: bool = True
) -> float:
    """Tokens/s of one epoch of the static-mask stream (shard fetches and decode included; a
    local shard's sha256 checked on first use unless not `verify`, a cached one's on download)."""
    spec = MaskingSpec("static")
    stream = ShardStream(
        index, "train", batch_size=batch, seq_len=seq_len, masking=spec, seed=1, verify=verify
    )
    if not prefetch:  # no shard is opened (downloaded) ahead: each when the stream reaches it
        stream.order.next_shard = lambda epoch, shard: shard
    n, tokens, t0 = stream.order.size, 0, time.perf_counter()
    for seen, b in enumerate(stream, 1):
        tokens += int(b["attention_mask"].sum())
        if seen * batch >= n:
            break
    return tokens / (time.perf_counter() - t0)


def cut_main(args) -> None:
    """Rows/s of a dataset built at L = --cut, trained at each l of --cut-to (each row cut into
    L // l), against a dataset built at l with the same tokens, static and dynamic masks,
    interleaved round by round."""
    L = args.cut
    lengths = [int(x) for x in args.cut_to.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        built = {L: read_index(synthetic_dataset(Path(tmp) / str(L), args.rows, L, 32000, 5))}
        for short in lengths:
            rows = args.rows * (L // short)
            built[short] = read_index(
                synthetic_dataset(Path(tmp) / str(short), rows, short, 32000, 5)
            )
        results: dict = {}
        for r in range(args.rounds):
            for short in lengths:
                n = args.rows * (L // short)  # one epoch's rows, both ways
                for mode in ("static", "dynamic"):
                    for source in (L, short):
                        rate = run(built[source], MaskingSpec(mode), args.batch, n, short, r * n)
                        results.setdefault((short, mode, source), []).append(rate)
        print(
            f"built at {L}: {args.rows} rows; batch {args.batch}, 1 core, {args.rounds} rounds "
            f"(load average {os.getloadavg()[0]:.2f})"
        )
        print(
            f"{'length':>6s} {'masks':8s} {'cut from ' + str(L):>14s} {'built at l':>11s} {'ratio':>6s}"
        )
        for short in lengths:
            for mode in ("static", "dynamic"):
                cut_rate = np.median(results[(short, mode, L)])
                own = np.median(results[(short, mode, short)])
                print(f"{short:6d} {mode:8s} {cut_rate:14,.0f} {own:11,.0f} {cut_rate / own:5.2f}x")


def store_main(remote: str, batch: int, seq_len: int, rounds: int) -> None:
    """`--data s3://...`: the stream from the store through the node's shard cache, cold (an
    empty cache, with and without the prefetcher) and warm (every shard cached), against the same
    shards on local disk; one epoch each, interleaved round by round."""
    from shatter.shards.store import configure, current, fs

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "local"
        local.mkdir()
        remote_index = read_index(remote)
        for name in [pshards.INDEX_FILE, pshards.TOKENIZER_FILE] + [
            s.file for split in remote_index.splits for s in remote_index.shards(split)
        ]:
            with fs.open_read(fs.join(remote, name)) as f:
                (local / name).write_bytes(f.read())
        local_index = read_index(local)
        results = {"local disk": [], "local, no sha256": []}
        results.update({"cold, no prefetch": [], "cold, prefetch": [], "warm": []})
        for r in range(rounds):
            results["local disk"].append(epoch_tokens_per_s(local_index, batch, seq_len))
            results["local, no sha256"].append(
                epoch_tokens_per_s(local_index, batch, seq_len, verify=False)
            )
            for prefetch in (False, True):
                configure(
                    current().replace(
                        cache_dir=str(Path(tmp) / f"cache{r}-{prefetch}"), cache_limit_gb=100.0
                    )
                )
                name = "cold, prefetch" if prefetch else "cold, no prefetch"
                results[name].append(
                    epoch_tokens_per_s(remote_index, batch, seq_len, prefetch=prefetch)
                )
            results["warm"].append(epoch_tokens_per_s(remote_index, batch, seq_len))
        rows = remote_index.rows("train")
        print(
            f"{remote}: {rows} rows, {len(remote_index.shards('train'))} shards, batch {batch}, "
            f"1 core, {rounds} rounds (load average {os.getloadavg()[0]:.2f})"
        )
        base = np.median(results["local disk"])
        print(f"{'source':20s} {'tokens/s (median)':>18s} {'vs local':>9s}")
        for name, values in results.items():
            print(f"{name:20s} {np.median(values):18,.0f} {np.median(values) / base:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--data", help="a dataset built by shatter-data build (default: a synthetic one)"
    )
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="peak RSS and worst batch gap")
    parser.add_argument("--cut", type=int, help="rows/s of rows cut from this length vs uncut")
    parser.add_argument("--cut-to", default="128,256", help="--cut: the lengths trained at")
    parser.add_argument("--shard-mb", type=float, default=1024, help="--memory: shard size")
    parser.add_argument("--baseline", help="--memory: another checkout to compare with")
    parser.add_argument("--before", type=int, default=3000, help="--memory: batches before")
    parser.add_argument("--after", type=int, default=50, help="--memory: batches after")
    args = parser.parse_args()
    if args.memory:
        memory(args)
        return
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    import torch

    torch.set_num_threads(1)
    if args.cut:
        cut_main(args)
        return
    if args.data and "://" in args.data:  # an object store: its own table (`store_main`)
        store_main(args.data, args.batch, args.seq_len, args.rounds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = (
            Path(args.data)
            if args.data
            else synthetic_dataset(Path(tmp), args.rows, args.seq_len, 32000, 5)
        )
        index = read_index(root)
        n = sum(s.rows for s in index.shards("train"))
        contenders = {
            "static (stored masks)": (MaskingSpec("static"), True),
            "static, no sha256": (MaskingSpec("static"), False),  # data.verify_shards false
            "dynamic": (MaskingSpec("dynamic"), True),
            "dynamic, whole word": (MaskingSpec("dynamic", whole_word=True), True),
        }
        results = {name: [] for name in contenders}
        for r in range(args.rounds):
            for name, (spec, verify) in contenders.items():
                seq_s = run(index, spec, args.batch, n, args.seq_len, r * n, verify)
                results[name].append(seq_s)
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
