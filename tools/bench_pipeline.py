"""Benchmark of `shatter-data build` (issue 4): tokens/s of the pipeline against its baselines.

On the same cleaned text (../shared/data's wiki sample and books, cleaned once and repeated to
about --mb MB, written as JSON lines), in one run, interleaving the contenders over --rounds
rounds and keeping each one's best:
  (a) raw sentencepiece batch encoding in a tight loop, one thread;
  (b) `shatter-data build` end to end (tokenize, pack, mask, shard, write; --tokenizer given), with
      one worker (in-process) and two workers (multi_processing and multi_threading);
  (c) the same tokenize-and-pack with `datasets.map(batched=True, num_proc=2)`.
Targets from the issue: (b, 1 worker) >= 0.5 x (a); (b, 2 workers) >= 1.6 x (b, 1 worker);
(b, 2 workers) > (c).

    .venv/bin/python tools/bench_pipeline.py --mb 50
"""
from __future__ import annotations

import argparse
import bz2
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pipeline import cleaning, packing, tokenizer  # noqa: E402
from pipeline.wikitext import clean_wikitext  # noqa: E402


def cleaned_documents(data: Path) -> list[str]:
    raw = bz2.open(data / "wiki" / "enwiki-sample-pages-articles.xml.bz2").read().decode()
    docs = []
    for page in re.findall(r"<page>.*?</page>", raw, re.S):
        if "<ns>0</ns>" in page and "<redirect" not in page:
            text = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
            if text:
                docs.append(clean_wikitext(html.unescape(text.group(1))))
    docs += [cleaning.clean_book(p.read_text(encoding="utf-8", errors="replace"))
             for p in sorted((data / "books").glob("*.txt"))]
    return [d for d in docs if d]


def write_corpus(docs: list[str], path: Path, megabytes: float) -> int:
    size, lines = 0, []
    while size < megabytes * 1e6:
        for doc in docs:
            lines.append(json.dumps({"text": doc}) + "\n")
            size += len(doc.encode())
    path.write_text("".join(lines))
    return size


def bench_sentencepiece(model: bytes, docs: list[str], batch_chars: int) -> tuple[float, int]:
    sp = tokenizer.load(model)
    start, tokens, batch, chars = time.perf_counter(), 0, [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= batch_chars:
            tokens += sum(map(len, sp.encode(batch, num_threads=1)))
            batch, chars = [], 0
    if batch:
        tokens += sum(map(len, sp.encode(batch, num_threads=1)))
    return time.perf_counter() - start, tokens


def bench_build(corpus: Path, model: Path, out: Path, seq_len: int, beam_args: list[str]) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(REPO / ".venv" / "bin" / "shatter-data"), "build", "--corpus", "text", "--input", str(corpus),
           "--output", str(out), "--tokenizer", str(model), "--seq-len", str(seq_len), "--num-shards", "8",
           "--text-mode", "line", *beam_args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed, json.loads((out / "index.json").read_text())["counters"]


def bench_datasets(corpus: Path, model: Path, seq_len: int, cache: Path) -> float:
    import datasets
    import numpy as np

    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))

    def tokenize_and_pack(batch):
        sp = tokenizer.load(model.read_bytes())
        docs = [np.asarray(ids, dtype=np.int32) for ids in sp.encode(batch["text"], num_threads=1)]
        return {"input_ids": packing.pack_documents(docs, seq_len)}

    ds.map(tokenize_and_pack, batched=True, batch_size=256, num_proc=2, remove_columns=["text"])
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--mb", type=float, default=50, help="corpus size (cleaned text, repeated)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    docs = cleaned_documents(args.data)
    corpus = work / "corpus.jsonl"
    size = write_corpus(docs, corpus, args.mb)
    lines = [line for d in docs for line in cleaning.sample_lines(d)]
    model_bytes = tokenizer.train([x for _, x in tokenizer.smallest_lines(lines, 200_000)], args.vocab_size)
    model = work / "tokenizer.model"
    model.write_bytes(model_bytes)
    all_docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    print(f"corpus: {size / 1e6:.1f} MB of cleaned text, {len(all_docs)} documents; vocab {args.vocab_size}, "
          f"seq_len {args.seq_len}; load: {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores")

    contenders = {
        "(a) sentencepiece encode, 1 thread": lambda: bench_sentencepiece(model_bytes, all_docs, 1 << 20)[0],
        "(b) build, 1 worker (in-process)": lambda: bench_build(corpus, model, work / "out1", args.seq_len, [])[0],
        "(b) build, 2 workers (multi_processing)": lambda: bench_build(
            corpus, model, work / "out2p", args.seq_len,
            ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"])[0],
        "(b) build, 2 workers (multi_threading)": lambda: bench_build(
            corpus, model, work / "out2t", args.seq_len,
            ["--direct_num_workers", "2", "--direct_running_mode", "multi_threading"])[0],
        "(c) datasets.map(batched, num_proc=2)": lambda: bench_datasets(corpus, model, args.seq_len, work / "hf"),
    }
    _, tokens = bench_sentencepiece(model_bytes, all_docs, 1 << 20)
    best = {name: float("inf") for name in contenders}
    for r in range(args.rounds):
        for name, run in contenders.items():
            elapsed = run()
            best[name] = min(best[name], elapsed)
            print(f"  round {r + 1}: {name:<42} {elapsed:7.1f} s  (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"\n{'contender':<44} {'seconds':>8} {'Mtok/s':>8} {'MB/s':>7}")
    for name, seconds in best.items():
        print(f"{name:<44} {seconds:8.1f} {tokens / seconds / 1e6:8.2f} {size / seconds / 1e6:7.2f}")
    a, b1 = best["(a) sentencepiece encode, 1 thread"], best["(b) build, 1 worker (in-process)"]
    b2 = min(best["(b) build, 2 workers (multi_processing)"], best["(b) build, 2 workers (multi_threading)"])
    c = best["(c) datasets.map(batched, num_proc=2)"]
    print(f"\n(b, 1 worker) / (a)        = {a / b1:.2f}   (target >= 0.5)")
    print(f"(b, 2 workers) / (b, 1)    = {b1 / b2:.2f}   (target >= 1.6)")
    print(f"(b, 2 workers) / (c)       = {c / b2:.2f}   (target > 1)")
    counters = json.loads((work / "out1" / "index.json").read_text())["counters"]
    print(f"build counters: {counters}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
