"""Side-by-side train-step time and attention activation memory of every arch.

For each sequence length, every arch is built at base width (hidden 768, 12 heads or parts,
FFN 3072) with a few layers, and timed on full MLM train steps (forward, backward, AdamW step)
on the same batch (xlnet: its permutation-LM step, two streams), the archs interleaved round by round so that load from other processes hits
them alike; the median of `--repeats` rounds after `--warmup` rounds is reported, with its ratio
to `bert` from the same run. Memory is measured in a separate, untimed forward: the bytes of
the tensors that autograd saves for the backward pass (deduplicated by storage, parameters
excluded), in total and inside the attention modules only ("attention activation memory").
With `--attention-only` the timed step is one attention module alone (block 0's, forward and
backward of its context on random hidden states [batch, l, hidden]), the kernel comparison
without the arch-independent dense layers, embeddings, MLM head and optimizer.

    python tools/bench_model.py                      # the default run in docs/benchmarks.md
    python tools/bench_model.py --lengths 256 --archs bert,shatter --layers 4 --repeats 9
    python tools/bench_model.py --attention-only --lengths 256 --batch-tokens 2048 --archs bert,shatter
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass

import click
import torch

import shatter
from shatter.config import ARCHS


@dataclass(frozen=True)
class BenchConfig:
    archs: tuple[str, ...]  # contenders; bert is added as the reference if missing
    lengths: tuple[int, ...]  # sequence lengths l
    layers: int  # encoder blocks (base width, few layers)
    size: str  # preset size whose width is used (base: 768 / 12 / 3072)
    batch_tokens: int  # tokens per batch: batch size = max(1, batch_tokens // l)
    vocab_size: int  # vocabulary of the MLM head
    repeats: int  # timed rounds (median reported)
    warmup: int  # untimed rounds first
    threads: int  # torch intra-op threads
    mask_rate: float  # fraction of positions predicted by the MLM head
    attention_dropout: float  # config.attention_dropout (softmax archs; BERT's default is 0.1)
    attention_only: bool = False  # time block 0's attention module alone instead of a train step


def make_batch(cfg: BenchConfig, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = max(1, cfg.batch_tokens // length)
    input_ids = torch.randint(5, cfg.vocab_size, (batch, length), generator=g)
    labels = torch.where(torch.rand(batch, length, generator=g) < cfg.mask_rate, input_ids, -100)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def arch_batch(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """xlnet trains with the permutation LM: its step is the two-stream one, the predicted
    positions last in a random factorisation order (shatter/xlnet.py, train/plm.py)."""
    if not hasattr(model.encoder.layers[0].attention, "two_stream"):
        return batch
    labels = batch["labels"]
    g = torch.Generator().manual_seed(2)
    rank = torch.rand(labels.shape, generator=g).argsort(-1).argsort(-1)
    return {**batch, "perm_rank": torch.where(labels != -100, rank, -1)}


def build(cfg: BenchConfig, arch: str, length: int):
    torch.manual_seed(0)
    model = shatter.build_model(
        f"{arch}-{cfg.size}",
        layers=cfg.layers,
        vocab_size=cfg.vocab_size,
        max_len=max(length, 512),
        attention_dropout=cfg.attention_dropout,
    ).train()
    return model, torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True
    )  # fused: one kernel, CPU too


def train_step(model, optimizer, batch) -> float:
    start = time.perf_counter()
    loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def attention_step(model, batch) -> float:
    """Forward and backward of block 0's attention module alone on random hidden states."""
    attention = model.encoder.layers[0].attention
    start = time.perf_counter()
    attention(batch["hidden"], batch["attention_mask"].bool()).sum().backward()
    return time.perf_counter() - start


def saved_bytes(model, batch) -> tuple[int, int]:
    """(all, attention-only) bytes autograd keeps for backward during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    totals = {"all": 0, "attention": 0}
    inside = [0]

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
            totals["all"] += nbytes
            if inside[0]:
                totals["attention"] += nbytes
        return t

    def counted(method):  # the two-stream attention is a method, not the module's forward
        def run(*args):
            inside[0] = 1
            try:
                return method(*args)
            finally:
                inside[0] = 0

        return run

    hooks = []
    for block in model.encoder.layers:
        if hasattr(block.attention, "two_stream"):
            block.attention.two_stream = counted(
                type(block.attention).two_stream.__get__(block.attention)
            )
        hooks.append(block.attention.register_forward_pre_hook(lambda *a: inside.__setitem__(0, 1)))
        hooks.append(block.attention.register_forward_hook(lambda *a: inside.__setitem__(0, 0)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch)["loss"]
        del loss
    finally:
        for h in hooks:
            h.remove()
        for block in model.encoder.layers:
            block.attention.__dict__.pop("two_stream", None)
    return totals["all"], totals["attention"]


def run(cfg: BenchConfig) -> list[dict]:
    torch.set_num_threads(cfg.threads)
    rows = []
    for length in cfg.lengths:
        batch = make_batch(cfg, length)
        if cfg.attention_only:
            hidden = shatter.SIZES[cfg.size]["hidden"]
            g = torch.Generator().manual_seed(1)
            attention_batch = {
                "hidden": torch.randn(
                    *batch["input_ids"].shape, hidden, generator=g
                ).requires_grad_(),
                "attention_mask": batch["attention_mask"],
            }
        models = {arch: build(cfg, arch, length) for arch in cfg.archs}
        batches = {arch: arch_batch(models[arch][0], batch) for arch in cfg.archs}
        memory = {arch: saved_bytes(models[arch][0], batches[arch]) for arch in cfg.archs}
        times: dict[str, list[float]] = {arch: [] for arch in cfg.archs}
        for round_ in range(cfg.warmup + cfg.repeats):
            for arch in cfg.archs:  # interleaved: every round times every arch once
                if cfg.attention_only:
                    t = attention_step(models[arch][0], attention_batch)
                else:
                    t = train_step(*models[arch], batches[arch])
                if round_ >= cfg.warmup:
                    times[arch].append(t)
        ref_t = statistics.median(times["bert"])
        ref_all, ref_attn = memory["bert"]
        for arch in cfg.archs:
            med = statistics.median(times[arch])
            rows.append(
                dict(
                    length=length,
                    batch=batch["input_ids"].shape[0],
                    arch=arch,
                    step_s=med,
                    time_ratio=med / ref_t,
                    act_mb=memory[arch][0] / 2**20,
                    attn_mb=memory[arch][1] / 2**20,
                    attn_ratio=memory[arch][1] / ref_attn if ref_attn else float("nan"),
                    all_ratio=memory[arch][0] / ref_all,
                )
            )
            click.echo(
                f"l={length:5d} b={rows[-1]['batch']:3d} {arch:12s} step {med:7.3f}s  x{med / ref_t:5.2f} bert  "
                f"activations {rows[-1]['act_mb']:8.1f} MB (x{rows[-1]['all_ratio']:4.2f})  "
                f"attention {rows[-1]['attn_mb']:8.1f} MB (x{rows[-1]['attn_ratio']:4.2f})",
                err=True,
            )
        del models
        gc.collect()
    return rows


def markdown(rows: list[dict], cfg: BenchConfig) -> str:
    lengths = sorted({r["length"] for r in rows})
    by = {(r["arch"], r["length"]): r for r in rows}
    head = "| arch | " + " | ".join(f"l={n}" for n in lengths) + " |"
    sep = "|---|" + "---:|" * len(lengths)
    timed = (
        "Attention forward+backward (block 0 alone)" if cfg.attention_only else "Train-step time"
    )
    out = [f"{timed}, median seconds (ratio to bert):", "", head, sep]
    for arch in cfg.archs:
        cells = [f"{by[arch, n]['step_s']:.3f} ({by[arch, n]['time_ratio']:.2f})" for n in lengths]
        out.append(f"| {arch} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Attention activation memory saved for backward, MB (ratio to bert):",
        "",
        head,
        sep,
    ]
    for arch in cfg.archs:
        cells = [f"{by[arch, n]['attn_mb']:.1f} ({by[arch, n]['attn_ratio']:.2f})" for n in lengths]
        out.append(f"| {arch} | " + " | ".join(cells) + " |")
    out += ["", "All activations saved for backward, MB (ratio to bert):", "", head, sep]
    for arch in cfg.archs:
        cells = [f"{by[arch, n]['act_mb']:.1f} ({by[arch, n]['all_ratio']:.2f})" for n in lengths]
        out.append(f"| {arch} | " + " | ".join(cells) + " |")
    batches = ", ".join(f"l={n}: {by[cfg.archs[0], n]['batch']}" for n in lengths)
    out += [
        "",
        f"batch sizes: {batches}; layers {cfg.layers}, size {cfg.size}, vocab {cfg.vocab_size}, "
        f"median of {cfg.repeats} after {cfg.warmup} warm-up, {cfg.threads} threads, "
        f"attention dropout {cfg.attention_dropout}, "
        f"torch {torch.__version__}, load before: {os.getloadavg()[0]:.2f}",
    ]
    return "\n".join(out)


@click.command()
@click.option("--archs", default=",".join(ARCHS), show_default=True, help="comma-separated archs")
@click.option("--lengths", default="128,256,512,1024", show_default=True)
@click.option("--layers", default=2, show_default=True, help="encoder blocks at base width")
@click.option("--size", default="base", show_default=True, type=click.Choice(list(shatter.SIZES)))
@click.option(
    "--batch-tokens", default=1024, show_default=True, help="tokens per batch (batch = this // l)"
)
@click.option(
    "--vocab-size",
    default=8000,
    show_default=True,
    help="MLM vocabulary; the embedding/head cost is the same for every arch, and nine "
    "models with AdamW state at 32000 need ~6 GB",
)
@click.option("--repeats", default=5, show_default=True)
@click.option("--warmup", default=1, show_default=True)
@click.option("--threads", default=torch.get_num_threads(), show_default=True)
@click.option(
    "--attention-dropout",
    default=0.1,
    show_default=True,
    help="dropout on softmax attention probabilities (the sigmoid archs have none)",
)
@click.option(
    "--attention-only",
    is_flag=True,
    help="time one attention module's forward+backward instead of a full train step",
)
def main(
    archs,
    lengths,
    layers,
    size,
    batch_tokens,
    vocab_size,
    repeats,
    warmup,
    threads,
    attention_dropout,
    attention_only,
):
    """Print per-arch train-step time and attention memory, with ratios to bert."""
    names = tuple(a for a in archs.split(",") if a)
    bad = [a for a in names if a not in ARCHS]
    if bad:
        raise click.BadParameter(
            f"unknown archs {bad}; choose from {', '.join(ARCHS)}", param_hint="--archs"
        )
    if "bert" not in names:
        names = ("bert", *names)
    cfg = BenchConfig(
        archs=names,
        lengths=tuple(int(n) for n in lengths.split(",")),
        layers=layers,
        size=size,
        batch_tokens=batch_tokens,
        vocab_size=vocab_size,
        repeats=repeats,
        warmup=warmup,
        threads=threads,
        mask_rate=0.15,
        attention_dropout=attention_dropout,
        attention_only=attention_only,
    )
    click.echo(markdown(run(cfg), cfg))


if __name__ == "__main__":
    main()
