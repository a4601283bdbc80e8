"""The trainer's peak memory on datasets that hold the same text in different shard counts.

    python tools/bench/bench_trainer_memory.py --data ONE_SHARD --data MANY_SHARDS [--steps 6]

Each `--data` (built by `shatter-data build` from the same text with `--num-shards 1`, `32`, ...)
is trained on for `--steps` steps by one process of `train/pretrain.py` (`--preset`,
configs/cpu-tiny.yaml, `--num-workers`), with a fresh output directory and a node cache of its
own (TMPDIR), so every shard is hashed as on a node's first run. The process tree is sampled
every 20 ms: each process's peak RSS (VmHWM) and the tree's summed RSS at its peak, printed with
the ratio to the first dataset.

DeepSpeed's CPU op is JIT-built before the first run (`build_extensions`): on a checkout's first
run the compiler (two jobs of about 1.6 GB each) would otherwise be the tree's largest process,
and whichever dataset ran first would look 2.5x heavier than the others.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shatter.shards import read_index

REPO = Path(__file__).resolve().parents[2]


def _tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc (Linux)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        tree += frontier
    return tree


def _memory(pid: int) -> tuple[int, int, str]:
    """(RSS, VmHWM) in bytes and the command name of `pid`; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0, 0, ""
    rss, hwm = (int(fields.get(key, "0 kB").split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))
    return rss, hwm, fields["Name"].strip()


def train(data: str, args, env: dict) -> dict:
    """One run's {'sum': peak summed RSS, 'peaks': {pid: (VmHWM, name)}, 'wall': s}."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "log", "w+") as log:
        cmd = [sys.executable, str(REPO / "train" / "pretrain.py"), "--data", data]
        cmd += ["--output", f"{tmp}/run", "--preset", args.preset]
        cmd += ["--config", str(REPO / "configs" / "cpu-tiny.yaml")]
        cmd += ["--num-workers", str(args.num_workers), "--max-steps", str(args.steps)]
        cmd += ["--save-every", "100000", "--eval-every", "100000", "--no-progress"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env={**env, "TMPDIR": tmp}, stdout=log, stderr=log)
        total, peaks = 0, {}
        while proc.poll() is None:
            rss = 0
            for pid in _tree(proc.pid):
                now, hwm, name = _memory(pid)
                rss += now
                if hwm >= peaks.get(pid, (0, ""))[0]:
                    peaks[pid] = hwm, name
            total = max(total, rss)
            time.sleep(0.02)
        if proc.returncode:
            log.seek(0)
            sys.exit(f"bench_trainer_memory: the run on {data} failed:\n{log.read()[-3000:]}")
    return {"sum": total, "peaks": peaks, "wall": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", action="append", required=True, help="a dataset (repeat)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--preset", default="bert-tiny")
    parser.add_argument("--num-workers", type=int, default=1)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    build = "from shatter.train.engine import build_extensions; build_extensions()"
    subprocess.run([sys.executable, "-c", build], env=env, check=True)  # no compiler in a run
    results = {data: train(data, args, env) for data in args.data}
    first = None  # the first dataset's (largest process, tree sum)
    print(f"{args.preset}, {args.steps} steps, --num-workers {args.num_workers}, one process")
    print(
        f"{'data':30s} {'shards':>6s} {'largest peaks MB':>18s} {'tree sum GB':>11s} {'ratios':>12s}"
    )
    for data, r in results.items():
        shards = len(read_index(data).shards("train"))
        top = sorted(r["peaks"].values(), reverse=True)[:3]
        largest = " ".join(f"{hwm / 1e6:.0f}" for hwm, _ in top)
        first = first or (top[0][0], r["sum"])
        print(
            f"{data[-30:]:30s} {shards:6d} {largest:>18s} {r['sum'] / 1e9:11.3f} "
            f"{top[0][0] / first[0]:5.2f}x {r['sum'] / first[1]:5.2f}x "
            f"({', '.join(name for _, name in top)}; {r['wall']:.0f} s)"
        )


if __name__ == "__main__":
    main()
