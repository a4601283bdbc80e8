"""Benchmark of `shatter-data build`'s memory and time against the size of the corpus.

The same cleaned text (`--data`: a folder with a wiki sample and book texts, as in
`tools/bench/bench_pipeline.py`) is repeated to each of --mb megabytes and built with one worker (the
in-process FnApiRunner, or the runner options given after `--`), training the tokenizer
(--vocab-size) unless --tokenizer-given, with --num-shards scaled with the corpus so that shards
keep one size (--mb-per-shard). Each build runs in its own process; its peak RSS is that
process's (and its children's) maximum resident set size (`os.wait4` in a small launcher:
Linux would count this process's own memory in a child's peak). Printed side by side with
the ratios to the smallest corpus: memory should stay flat, time should grow like the text.

    .venv/bin/python tools/bench/bench_pipeline_memory.py --data DATA --mb 50 150 200

With --dask-workers N, every build runs on `--runner DaskRunner` against a LocalCluster of N
worker processes (1 thread each) that this tool starts before the clock and restarts before each
build; each worker's peak RSS is its VmHWM (`/proc/self/status`, read on the worker after the
build), printed beside the driver's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shatter.tools.bench.bench_pipeline import cleaned_documents, write_corpus

REPO = Path(__file__).resolve().parents[2]


def build_command(corpus: Path, out: Path, args, shards: int, tokenizer: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "shatter.pipeline.cli", "build", "--corpus", "text"]
    cmd += ["--input", str(corpus), "--output", str(out), "--text-mode", "line"]
    cmd += ["--seq-len", str(args.seq_len), "--num-shards", str(shards)]
    cmd += ["--progress-seconds", "0"]
    if getattr(args, "spill_rows", None):
        cmd += ["--spill-rows", str(args.spill_rows)]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    else:
        cmd += ["--vocab-size", str(args.vocab_size)]
    return cmd + args.beam_args


# Runs the command as its child and writes the child's rusage peak to argv[1]. A process started
# straight from this one would not do: Linux keeps the peak RSS across fork and exec (`ru_maxrss`
# of a child of a 1 GB process is at least 1 GB), so it is started from this small launcher, whose
# own peak is a few MB. ru_maxrss of the waited children is the largest peak among the build's
# process and its descendants (e.g. multi_processing workers), never a sum.
LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in GB of the build's process and its children, stderr tail)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    with tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "maxrss"
        launcher = [sys.executable, "-S", "-c", LAUNCHER, str(peak_file)]
        start = time.perf_counter()
        proc = subprocess.run(
            launcher + cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO
        )
        elapsed = time.perf_counter() - start
        err.seek(0)
        tail = err.read().decode(errors="replace")[-3000:]
        if proc.returncode:
            raise SystemExit(f"build failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        peak = int(peak_file.read_text()) * 1024 / 1e9
    return elapsed, peak, tail


def worker_peak_gb() -> float:
    """This process's peak RSS (VmHWM: since its exec, never inherited), in GB; run on a worker."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb * 1024 / 1e9


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="wiki/*.xml.bz2 and books/*.txt")
    parser.add_argument("--mb", type=float, nargs="+", default=[50, 150, 200])
    parser.add_argument("--mb-per-shard", type=float, default=37.5, help="text per train shard")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--spill-rows", type=int, default=None, help="the build's --spill-rows")
    parser.add_argument(
        "--tokenizer-given",
        action="store_true",
        help="pass a tokenizer (trained once, outside the timing) instead of training one",
    )
    parser.add_argument(
        "--dask-workers",
        type=int,
        default=0,
        help="build on a LocalCluster of this many worker processes (DaskRunner); 0: one worker",
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch (default: a temp dir)")
    parser.add_argument("beam_args", nargs="*", help="after --: runner options for every build")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    docs = cleaned_documents(args.data)
    tokenizer = None
    if args.tokenizer_given:
        from shatter.pipeline import cleaning, tokenizer as tok

        lines = [line for d in docs for line in cleaning.sample_lines(d)]
        tokenizer = work / "tokenizer.model"
        tokenizer.write_bytes(tok.train([x for _, x in tok.smallest_lines(lines, 200_000)], 8000))
    client = None
    if args.dask_workers:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(
            n_workers=args.dask_workers,
            processes=True,
            threads_per_worker=1,
            dashboard_address=None,
        )
        client = Client(cluster)
        args.beam_args = [
            *("--runner", "DaskRunner", "--dask_client_address", cluster.scheduler_address),
            *args.beam_args,
        ]
    print(
        (f"Dask, {args.dask_workers} worker processes" if client else "one worker")
        + f", seq_len {args.seq_len}, "
        + ("tokenizer given" if tokenizer else f"tokenizer trained (vocab {args.vocab_size})")
        + f", {args.mb_per_shard:g} MB of text per shard, runner options {args.beam_args or 'none'}; "
        f"load {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores",
        flush=True,
    )
    rows = []
    for mb in args.mb:
        corpus = work / f"corpus-{mb:g}mb.jsonl"
        size = write_corpus(docs, corpus, mb)
        shards = max(1, round(mb / args.mb_per_shard))
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        if client:
            client.restart()  # fresh worker processes: their VmHWM starts again
        load = os.getloadavg()[0]
        seconds, peak, _ = measure(build_command(corpus, out, args, shards, tokenizer))
        workers = sorted(client.run(worker_peak_gb).values()) if client else []
        if workers:  # the largest process: the driver or a worker
            peak = max(peak, workers[-1])
        rows.append((mb, size, shards, seconds, peak))
        print(
            f"  {size / 1e6:7.1f} MB, {shards:3d} shards: {seconds:7.1f} s, peak RSS {peak:6.2f} GB"
            + (f" (workers {', '.join(f'{w:.2f}' for w in workers)} GB)" if workers else "")
            + f" (load {load:.2f} before, {os.getloadavg()[0]:.2f} after)",
            flush=True,
        )
        corpus.unlink()
    shutil.rmtree(work / "out", ignore_errors=True)
    if client:
        client.close()
        cluster.close()
    _, size0, _, seconds0, peak0 = rows[0]
    print(
        f"\n{'text MB':>8} {'shards':>6} {'seconds':>8} {'peak GB':>8} {'x text':>7} "
        f"{'x time':>7} {'x peak':>7} {'B RSS/B text':>13}"
    )
    for _, size, shards, seconds, peak in rows:
        print(
            f"{size / 1e6:8.1f} {shards:6d} {seconds:8.1f} {peak:8.2f} {size / size0:7.2f} "
            f"{seconds / seconds0:7.2f} {peak / peak0:7.2f} {peak * 1e9 / size:13.1f}"
        )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
