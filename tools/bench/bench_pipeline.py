"""Benchmark of `shatter-data build`: tokens/s of the pipeline against its baselines.

On the same cleaned text (`--data`: a folder with a wiki sample and book texts, cleaned once and repeated to
about --mb MB, written as JSON lines), in one run, interleaving the contenders over --rounds
rounds and keeping each one's best:
  (a) raw sentencepiece batch encoding in a tight loop, one thread (its default lists of ints;
      (a') the same to the int32 arrays that the build asks sentencepiece for);
  (b) `shatter-data build` end to end (tokenize, pack, mask, shard, write; --tokenizer given), with
      one worker (in-process) and two workers (multi_processing, and in_memory threads);
  (c) the same tokenize-and-pack with `datasets.map(batched=True, num_proc=2)`.
Targets: (b, 1 worker) >= 0.5 x (a); (b, 2 workers) >= 1.6 x (b, 1 worker); (b, 2 workers) > (c). With --marginal-mb, the same on a larger corpus, and the ratios of the
marginal times (the larger run minus the smaller), from which fixed start-up costs cancel. Last, a
breakdown of where the time goes: the build's pure functions timed stage by stage on one core, and
the fixed cost (the same 1-worker build of one document).

    .venv/bin/python tools/bench/bench_pipeline.py --mb 50 --marginal-mb 150

With --runners, only `shatter-data build` on the same corpus, runner against runner: the in-process
FnApiRunner, `multi_processing` with 2 workers, and `--runner DaskRunner` on a LocalCluster of 2
worker processes (1 thread each; started before the clock, as a running cluster would be), with
the check that all three write the same bytes:

    .venv/bin/python tools/bench/bench_pipeline.py --data DATA --mb 150 --runners --rounds 1
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

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from shatter.pipeline import cleaning, packing, tokenizer
from shatter.pipeline.wikitext import clean_wikitext

REPO = Path(__file__).resolve().parents[2]


def wiki_articles(data: Path) -> list[str]:
    """The wikitext of the wiki sample's articles (namespace 0, no redirects)."""
    raw = bz2.open(data / "wiki" / "enwiki-sample-pages-articles.xml.bz2").read().decode()
    texts = []
    for page in re.findall(r"<page>.*?</page>", raw, re.S):
        if "<ns>0</ns>" in page and "<redirect" not in page:
            text = re.search(r"<text[^>]*>(.*?)</text>", page, re.S)
            if text:
                texts.append(html.unescape(text.group(1)))
    return texts


def cleaned_documents(data: Path) -> list[str]:
    docs = [clean_wikitext(text) for text in wiki_articles(data)]
    docs += [
        cleaning.clean_book(p.read_text(encoding="utf-8", errors="replace"))
        for p in sorted((data / "books").glob("*.txt"))
    ]
    return [d for d in docs if d]


def write_corpus(docs: list[str], path: Path, megabytes: float) -> int:
    """Whole passes over `docs` as JSON lines until at least `megabytes` of text; the text bytes.
    Written pass by pass: this process never holds more than one pass (its memory would count
    in the peak RSS of the builds it starts, `shatter.tools.bench.bench_pipeline_memory.measure`)."""
    lines = [json.dumps({"text": doc}) + "\n" for doc in docs]
    sizes = [len(doc.encode()) for doc in docs]
    size = 0
    with open(path, "w") as f:
        while size < megabytes * 1e6:
            f.write("".join(lines))
            size += sum(sizes)
    return size


def bench_sentencepiece(
    model: bytes, docs: list[str], batch_chars: int, arrays: bool = False
) -> tuple[float, int]:
    """Batches of `batch_chars` encoded to lists of ints (or, with `arrays`, to the int32 arrays
    that the build asks for: `tokenizer.encode`)."""
    sp = tokenizer.load(model)
    encode = (
        (lambda b: tokenizer.encode(sp, b)) if arrays else (lambda b: sp.encode(b, num_threads=1))
    )
    start, tokens, batch, chars = time.perf_counter(), 0, [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= batch_chars:
            tokens += sum(map(len, encode(batch)))
            batch, chars = [], 0
    if batch:
        tokens += sum(map(len, encode(batch)))
    return time.perf_counter() - start, tokens


def bench_build(
    corpus: Path, model: Path, out: Path, seq_len: int, beam_args: list[str]
) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "shatter.pipeline.cli",
        "build",
        "--corpus",
        "text",
        "--input",
        str(corpus),
        "--output",
        str(out),
        "--tokenizer",
        str(model),
        "--seq-len",
        str(seq_len),
        "--num-shards",
        "8",
        "--text-mode",
        "line",
        *beam_args,
    ]
    start = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed, json.loads((out / "index.json").read_text())["counters"]


def bench_datasets(corpus: Path, model: Path, seq_len: int, cache: Path) -> float:
    import datasets

    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))

    def tokenize_and_pack(batch):
        sp = tokenizer.load(model.read_bytes())
        docs = tokenizer.encode(sp, batch["text"])
        return {"input_ids": packing.pack_documents(docs, seq_len)}

    ds.map(tokenize_and_pack, batched=True, batch_size=256, num_proc=2, remove_columns=["text"])
    return time.perf_counter() - start


def stage_breakdown(
    model: bytes, docs: list[str], seq_len: int, dupe_factor: int = 5
) -> dict[str, float]:
    """Seconds per stage of the build's own pure functions on one core, without Beam: what limits (b)."""
    import numpy as np

    from shatter import shards
    from shatter.pipeline import packing, sharding
    from shatter.pipeline.transforms import MaskSpec, mask_table, row_keys
    from shatter.shards.writer import ROWS_PER_RECORD_BATCH

    sp = tokenizer.load(model)
    word_start, vocab = tokenizer.word_start_table(sp), sp.get_piece_size()
    spec = MaskSpec("", 0, dupe_factor, 0.15, False)
    times = dict.fromkeys(
        [
            "clean",
            "encode (int32 arrays)",
            "pack",
            "row keys",
            "sort",
            "mask",
            "Arrow + zstd write",
        ],
        0.0,
    )

    def timed(name, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        times[name] += time.perf_counter() - start
        return out

    packed, batch, chars = [], [], 0
    for doc in docs + [None]:
        if doc is not None:
            batch.append(doc)
            chars += len(doc)
        if batch and (doc is None or chars >= 1 << 20):
            text = timed("clean", lambda b: [cleaning.clean_plain(d) for d in b], batch)
            arrays = timed("encode (int32 arrays)", tokenizer.encode, sp, text)
            ids, lengths = timed("pack", packing.pack_documents_padded, arrays, seq_len)
            packed.append((timed("row keys", row_keys, ids, lengths), ids, lengths))
            batch, chars = [], 0
    keys, ids, lengths = (np.concatenate(x) for x in zip(*packed))
    order = timed("sort", sharding.sort_order, keys)
    keys, ids, lengths = timed("sort", lambda: (keys[order], ids[order], lengths[order]))
    with tempfile.TemporaryDirectory() as tmp:
        with shards.ShardWriter(tmp, "bench.arrow", shards.schema(vocab)) as writer:
            for lo in range(0, len(keys), ROWS_PER_RECORD_BATCH):
                part = slice(lo, lo + ROWS_PER_RECORD_BATCH)
                table = timed(
                    "mask",
                    mask_table,
                    keys[part],
                    ids[part],
                    lengths[part],
                    word_start,
                    vocab,
                    spec,
                )
                timed("Arrow + zstd write", writer.write, table)
    return times


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="a folder with wiki/*.xml.bz2 and books/*.txt (the demo's sample works)",
    )
    parser.add_argument("--mb", type=float, default=50, help="corpus size (cleaned text, repeated)")
    parser.add_argument(
        "--marginal-mb",
        type=float,
        default=0,
        help="also run on this larger corpus and report the marginal rates (fixed costs removed)",
    )
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--runners",
        action="store_true",
        help="only the build, FnApiRunner vs multi_processing vs Dask (2 workers each)",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    docs = cleaned_documents(args.data)
    lines = [line for d in docs for line in cleaning.sample_lines(d)]
    model_bytes = tokenizer.train(
        [x for _, x in tokenizer.smallest_lines(lines, 200_000)], args.vocab_size
    )
    model = work / "tokenizer.model"
    model.write_bytes(model_bytes)
    sizes = [args.mb] + ([args.marginal_mb] if args.marginal_mb else [])
    corpora = {}
    for mb in sizes:
        corpus = work / f"corpus-{mb:g}mb.jsonl"
        size = write_corpus(docs, corpus, mb)
        all_docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
        _, tokens = bench_sentencepiece(model_bytes, all_docs, 1 << 20)
        corpora[mb] = (corpus, size, all_docs, tokens)
        print(
            f"corpus {mb:g}: {size / 1e6:.1f} MB of cleaned text, {len(all_docs)} documents, {tokens / 1e6:.1f} M tokens"
        )
    print(
        f"vocab {args.vocab_size}, seq_len {args.seq_len}, dupe_factor 5, 8 shards; "
        f"load {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} cores"
    )

    if args.runners:
        compare_runners(corpora[sizes[0]], model, work, args)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        return

    def contenders(mb):
        corpus, _, all_docs, _ = corpora[mb]
        out = work / "out"
        return {
            A: lambda: bench_sentencepiece(model_bytes, all_docs, 1 << 20)[0],
            A2: lambda: bench_sentencepiece(model_bytes, all_docs, 1 << 20, arrays=True)[0],
            B1: lambda: bench_build(corpus, model, out, args.seq_len, [])[0],
            B2P: lambda: bench_build(
                corpus,
                model,
                out,
                args.seq_len,
                ["--direct_num_workers", "2", "--direct_running_mode", "multi_processing"],
            )[0],
            B2T: lambda: bench_build(
                corpus,
                model,
                out,
                args.seq_len,
                ["--direct_num_workers", "2", "--direct_running_mode", "in_memory"],
            )[0],
            C: lambda: bench_datasets(corpus, model, args.seq_len, work / "hf"),
        }

    best = {(mb, name): float("inf") for mb in sizes for name in NAMES}
    for r in range(args.rounds):
        for mb in sizes:
            for name, run in contenders(mb).items():
                elapsed = run()
                best[mb, name] = min(best[mb, name], elapsed)
                print(
                    f"  round {r + 1}, {mb:g} MB: {name:<44} {elapsed:7.1f} s  (load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    # what does not grow with the corpus: the same build of one document (nothing held out: a
    # held-out fraction would take each document's tail, which one document alone makes a
    # second build of with a given tokenizer)
    one_doc = work / "corpus-one-document.jsonl"
    one_doc.write_text(json.dumps({"text": corpora[sizes[0]][2][0]}) + "\n")
    nothing_held_out = ["--validation-fraction", "0"]
    fixed = min(
        bench_build(one_doc, model, work / "out", args.seq_len, nothing_held_out)[0]
        for _ in range(args.rounds)
    )
    for mb in sizes:
        _, size, _, tokens = corpora[mb]
        print(f"\n{mb:g} MB, end to end      {'seconds':>8} {'Mtok/s':>8} {'MB/s':>7}")
        for name in NAMES:
            seconds = best[mb, name]
            print(
                f"{name:<44} {seconds:8.1f} {tokens / seconds / 1e6:8.2f} {size / seconds / 1e6:7.2f}"
            )
        print_ratios({name: best[mb, name] for name in NAMES}, f"{mb:g} MB end to end")
    if len(sizes) == 2:  # the marginal time of the extra tokens: fixed start-up costs cancel
        small, big = sizes
        print_ratios(
            {name: best[big, name] - best[small, name] for name in NAMES},
            f"marginal, {small:g} -> {big:g} MB (fixed costs removed)",
        )
    print(
        "\nwhere the time goes: the build's pure functions on one core, no Beam "
        f"({sizes[0]:g} MB corpus)"
    )
    times = stage_breakdown(model_bytes, corpora[sizes[0]][2], args.seq_len)
    total = sum(times.values())
    for name, seconds in times.items():
        print(f"  {name:<22} {seconds:6.2f} s  {100 * seconds / total:5.1f} %")
    print(f"  {'total':<22} {total:6.2f} s")
    print(
        f"fixed cost: the 1-worker build of one document takes {fixed:.2f} s (Python, Beam's "
        "import, building and translating the pipeline, starting the runner); the "
        f"{sizes[0]:g} MB build less it: {best[sizes[0], B1] - fixed:.2f} s, of which the pure "
        f"functions above are {total:.2f} s (the rest: Beam's element handling, reading, spills)"
    )
    articles = wiki_articles(args.data)
    start = time.perf_counter()
    for text in articles:
        clean_wikitext(text)
    seconds = time.perf_counter() - start
    chars = sum(map(len, articles))
    print(
        f"wikitext cleaning (a wiki build's largest cost): {len(articles)} sample articles, {chars / 1e6:.1f} M chars "
        f"in {seconds:.2f} s = {chars / seconds / 1e6:.2f} M chars/s on one core"
    )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def compare_runners(corpus_info, model: Path, work: Path, args) -> None:
    """The build on three runners, 2 workers where parallel; best of --rounds; same bytes checked.
    The Dask cluster is started before its run's clock (as a running cluster would be) and closed
    after it, so that the other runners' builds never have its processes beside them."""
    from distributed import LocalCluster

    corpus, size, _, tokens = corpus_info
    dask = "DaskRunner, LocalCluster of 2 processes"
    runs = {
        "FnApiRunner, in-process (1 worker)": [],
        "FnApiRunner, multi_processing, 2 workers": [
            *("--direct_num_workers", "2", "--direct_running_mode", "multi_processing"),
        ],
        dask: ["--runner", "DaskRunner", "--dask_client_address"],  # + the cluster's address
    }
    best, files = dict.fromkeys(runs, float("inf")), {}
    for r in range(args.rounds):
        for name, beam_args in runs.items():
            out = work / f"out-{len(files)}"
            cluster = None
            if name == dask:
                cluster = LocalCluster(
                    n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
                )
                beam_args = [*beam_args, cluster.scheduler_address]
            try:
                load = os.getloadavg()[0]
                elapsed, _ = bench_build(corpus, model, out, args.seq_len, beam_args)
            finally:
                if cluster is not None:
                    cluster.close()
            best[name] = min(best[name], elapsed)
            files[name] = {p.name: p.read_bytes() for p in out.glob("*.arrow")}
            shutil.rmtree(out, ignore_errors=True)
            print(
                f"  round {r + 1}: {name:<42} {elapsed:7.1f} s  (load before "
                f"{load:.2f}, after {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    first = next(iter(files.values()))
    same = all(f == first for f in files.values())
    print(
        f"\n{size / 1e6:.0f} MB, build only      {'seconds':>8} {'Mtok/s':>8} {'MB/s':>7} {'x 1 worker':>10}"
    )
    base = best[next(iter(runs))]
    for name, seconds in best.items():
        print(
            f"{name:<42} {seconds:8.1f} {tokens / seconds / 1e6:8.2f} {size / seconds / 1e6:7.2f}"
            f" {base / seconds:10.2f}"
        )
    print(f"same shard bytes on every runner: {same}")


A, B1 = "(a) sentencepiece encode, 1 thread", "(b) build, 1 worker (in-process)"
A2 = "(a') the same to int32 arrays (as the build)"
B2P, B2T = "(b) build, 2 workers (multi_processing)", "(b) build, 2 workers (in_memory threads)"
C = "(c) datasets.map(batched, num_proc=2)"
NAMES = (A, A2, B1, B2P, B2T, C)


def print_ratios(seconds: dict, label: str) -> None:
    a, b1, c = seconds[A], seconds[B1], seconds[C]
    b2 = min(seconds[B2P], seconds[B2T])
    print(f"ratios, {label}:")
    print(f"  (b, 1 worker) / (a)        = {a / b1:.2f}   (target >= 0.5)")
    print(f"  (b, 1 worker) / (a')       = {seconds[A2] / b1:.2f}")
    print(f"  (b, 2 workers) / (b, 1)    = {b1 / b2:.2f}   (target >= 1.6)")
    print(f"  (b, 2 workers) / (c)       = {c / b2:.2f}   (target > 1)")


if __name__ == "__main__":
    main()
