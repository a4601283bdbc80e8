"""Side-by-side train-step time, attention time and attention activation memory per contender.

A contender is an arch with the settings that change its speed but not its weights: Shatter (and
the other single-head partition archs) once per `attention_impl` (`--impls`, default every impl
that runs on the device), BERT three ways (SDPA with its default attention dropout, the
reference; SDPA without dropout, which may use a fused flash kernel; SDPA restricted to the
memory-efficient backend with `torch.nn.attention.sdpa_kernel`, which is what V100s run; CUDA
only), and every other arch as is (xlnet: its permutation-LM step, two streams). For each sequence length every contender is built at base
width (hidden 768, 12 heads or parts, FFN 3072) with a few layers, and in one run

- timed on full MLM train steps (forward, backward, fused AdamW step) on the same batch, also
  given as train tokens/s (the batch's tokens over the median step),
- timed on block 0's attention module alone (forward and backward of its context on random
  hidden states [batch, l, hidden]): the kernel comparison without the dense layers,
- measured: the bytes autograd saves for the backward in one untimed forward (deduplicated by
  storage, parameters excluded), in total and inside the attention modules; on CUDA also the
  peak allocated memory of a train step, as if the model were alone on the device.

Contenders are interleaved round by round so that load from other processes hits them alike; the
median of `--repeats` rounds after `--warmup` is reported with its ratio to `bert` from the same
run. On CUDA the steps run under bf16 autocast and are timed between synchronisations.

    python tools/bench/bench_model.py                                      # CPU, see docs/benchmarks.md
    python tools/bench/bench_model.py --device cuda --lengths 512,1024,2048 --markdown
    python tools/bench/bench_model.py --lengths 256 --archs bert,shatter --impls chunked,lean --repeats 9
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import click
import torch

import shatter
from shatter.attention import impls
from shatter.config import ARCHS, ATTENTION_IMPLS

SINGLE_HEAD = ("1h-softmax", "1h-sigmoid", "part-bias", "shatter")
COLUMNS = (
    ("tokens_s", "train tokens/s"),  # tokens of the batch / the median step: the README's figure
    ("step_s", "train step s"),
    ("attn_s", "attention fwd+bwd s"),
    ("attn_mb", "attention saved MB"),
    ("act_mb", "all saved MB"),
    ("peak_mb", "peak MB"),
)


@dataclass(frozen=True)
class Contender:
    label: str  # the row's name, e.g. "shatter[chunked]" or "bert-memeff"
    arch: str
    overrides: tuple = ()  # (field, value) pairs of config overrides (attention_impl, dropout)
    sdpa_backend: str | None = None  # restrict SDPA to this torch.nn.attention.SDPBackend

    def context(self):
        if self.sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.sdpa_backend))


@dataclass(frozen=True)
class BenchConfig:
    contenders: tuple[Contender, ...]  # the first is the reference, `bert`
    lengths: tuple[int, ...]  # sequence lengths l
    layers: int  # encoder blocks (base width, few layers)
    size: str  # preset size whose width is used (base: 768 / 12 / 3072)
    batch_tokens: int  # tokens per batch: batch size = max(1, batch_tokens // l)
    vocab_size: int  # vocabulary of the MLM head
    repeats: int  # timed rounds (median reported)
    warmup: int  # untimed rounds first
    threads: int  # torch intra-op threads
    mask_rate: float  # fraction of positions predicted by the MLM head
    attention_dropout: float  # config.attention_dropout of the softmax archs (BERT's: 0.1)
    device: str = "cpu"
    load_before: float = float("nan")  # the 1-minute load average when the run started


def impls_for(device: torch.device) -> tuple[str, ...]:
    """The impls that run on `device` (auto is one of them, so it is not listed)."""
    # on the CPU only under Triton's interpreter
    gpu_only = ("triton", "fused", "rows", "rows-keep")
    names = [name for name in ATTENTION_IMPLS if name not in ("auto", *gpu_only)]
    if device.type == "cuda":
        names[:0] = ["rows", "rows-keep"]  # cuBLAS and Triton row kernels: any CUDA GPU
    if device.type == "cuda" and impls.auto_impl(device, torch.bfloat16) in ("triton", "fused"):
        names[:0] = ["triton", "fused"]  # tensor-core Triton dots: sm_80 and later
    return tuple(names)


def contenders(archs, impl_names, device: torch.device, attention_dropout: float):
    out = [Contender("bert", "bert")]
    for arch in archs:
        if arch == "bert":
            out.append(Contender("bert-nodrop", "bert", (("attention_dropout", 0.0),)))
            if device.type == "cuda":
                out.append(Contender("bert-memeff", "bert", sdpa_backend="EFFICIENT_ATTENTION"))
        elif arch in SINGLE_HEAD:
            for impl in impl_names:
                if impl == "triton" and arch == "1h-softmax":
                    continue  # the Triton kernel is for the sigmoid archs
                out.append(Contender(f"{arch}[{impl}]", arch, (("attention_impl", impl),)))
        else:
            out.append(Contender(arch, arch))
    return tuple(out)


def make_batch(cfg: BenchConfig, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = max(1, cfg.batch_tokens // length)
    input_ids = torch.randint(5, cfg.vocab_size, (batch, length), generator=g)
    labels = torch.where(torch.rand(batch, length, generator=g) < cfg.mask_rate, input_ids, -100)
    out = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    return {k: v.to(cfg.device) for k, v in out.items()}


def arch_batch(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """xlnet trains with the permutation LM: its step is the two-stream one, the predicted
    positions last in a random factorisation order (shatter/xlnet.py, train/plm.py)."""
    if not hasattr(model.encoder.layers[0].attention, "two_stream"):
        return batch
    labels = batch["labels"]
    g = torch.Generator().manual_seed(2)
    rank = torch.rand(labels.shape, generator=g).argsort(-1).argsort(-1)
    return {**batch, "perm_rank": torch.where(labels != -100, rank, -1)}


def build(cfg: BenchConfig, contender: Contender, length: int):
    torch.manual_seed(0)
    fields = dict(
        layers=cfg.layers,
        vocab_size=cfg.vocab_size,
        max_len=max(length, 512),
        attention_dropout=cfg.attention_dropout,
    )
    model = shatter.build_model(
        f"{contender.arch}-{cfg.size}", **{**fields, **dict(contender.overrides)}
    ).to(cfg.device)
    # fused: one kernel, CPU too
    return model.train(), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _autocast(device: str):
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _timed(device: str, fn: Callable[..., None], *args) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, device)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def train_step(model, optimizer, batch, device: str = "cpu") -> None:
    with _autocast(device):
        loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def attention_step(model, batch, device: str = "cpu") -> None:
    """Forward and backward of block 0's attention module alone on random hidden states."""
    attention = model.encoder.layers[0].attention
    inputs = model.encoder.attention_inputs(batch["input_ids"])
    with _autocast(device):
        out = attention(batch["hidden"], batch["attention_mask"].bool(), **inputs)
    out.float().sum().backward()
    batch["hidden"].grad = None


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
        def run(*args, **kwargs):
            inside[0] = 1
            try:
                return method(*args, **kwargs)
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


def _peak_mb(cfg: BenchConfig, model, optimizer, batch) -> float:
    """The peak memory of a train step of this model as if it were alone on the device: the
    step's rise over what was allocated before it (the other contenders' weights and states
    included there) plus this model's own weights, gradients and optimizer states."""
    if cfg.device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    own = _resident_bytes(model, optimizer)
    train_step(model, optimizer, batch, cfg.device)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + own) / 2**20


def _resident_bytes(model, optimizer) -> int:
    """The bytes of a model's parameters, their gradients and its optimizer's state tensors."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params]
    tensors += [v for state in optimizer.state.values() for v in state.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def run(cfg: BenchConfig) -> list[dict]:
    torch.set_num_threads(cfg.threads)
    rows = []
    for length in cfg.lengths:
        batch = make_batch(cfg, length)
        hidden = shatter.SIZES[cfg.size]["hidden"]
        g = torch.Generator().manual_seed(1)
        attention_batch = {
            "hidden": torch.randn(*batch["input_ids"].shape, hidden, generator=g)
            .to(cfg.device)
            .requires_grad_(),
            "attention_mask": batch["attention_mask"],
            "input_ids": batch["input_ids"],  # for per-forward inputs such as xlnet's segments
        }
        models = {c: build(cfg, c, length) for c in cfg.contenders}
        batches = {c: arch_batch(model, batch) for c, (model, _) in models.items()}
        memory, peak = {}, {}
        for c, (model, optimizer) in models.items():
            with c.context(), _autocast(cfg.device):
                memory[c] = saved_bytes(model, batches[c])
            with c.context():
                peak[c] = _peak_mb(cfg, model, optimizer, batches[c])
        times = {c: ([], []) for c in cfg.contenders}
        for round_ in range(cfg.warmup + cfg.repeats):
            for c, (model, optimizer) in models.items():  # interleaved: each round times all
                with c.context():
                    t_step = _timed(cfg.device, train_step, model, optimizer, batches[c])
                    t_attn = _timed(cfg.device, attention_step, model, attention_batch)
                if round_ >= cfg.warmup:
                    times[c][0].append(t_step)
                    times[c][1].append(t_attn)
        for c in cfg.contenders:
            rows.append(
                dict(
                    length=length,
                    batch=batch["input_ids"].shape[0],
                    label=c.label,
                    step_s=statistics.median(times[c][0]),
                    tokens_s=batch["input_ids"].numel() / statistics.median(times[c][0]),
                    attn_s=statistics.median(times[c][1]),
                    act_mb=memory[c][0] / 2**20,
                    attn_mb=memory[c][1] / 2**20,
                    peak_mb=peak[c],
                )
            )
        ref = rows[-len(cfg.contenders)]
        for row in rows[-len(cfg.contenders) :]:
            for key, _ in COLUMNS:
                row[key + "_ratio"] = row[key] / ref[key] if ref[key] else float("nan")
            click.echo(
                f"l={length:5d} b={row['batch']:3d} {row['label']:20s} "
                + "  ".join(
                    f"{name} {row[k]:8.3f} (x{row[k + '_ratio']:4.2f})" for k, name in COLUMNS
                ),
                err=True,
            )
        del models
        gc.collect()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def device_name(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), bf16 autocast"
    return f"CPU, {torch.get_num_threads()} threads, fp32"


def footer(rows: list[dict], cfg: BenchConfig) -> str:
    lengths = sorted({r["length"] for r in rows})
    batches = ", ".join(
        f"l={n}: {next(r['batch'] for r in rows if r['length'] == n)}" for n in lengths
    )
    return (
        f"device {device_name(cfg.device)}; batch sizes {batches}; layers {cfg.layers}, size {cfg.size}, "
        f"vocab {cfg.vocab_size}, median of {cfg.repeats} after {cfg.warmup} warm-up, "
        f"attention dropout {cfg.attention_dropout} (bert-nodrop: 0), torch {torch.__version__}, "
        f"load average before: {cfg.load_before:.2f}, after: {os.getloadavg()[0]:.2f}"
    )


def _columns(cfg: BenchConfig):
    return [(k, name) for k, name in COLUMNS if k != "peak_mb" or cfg.device == "cuda"]


def table(rows: list[dict], cfg: BenchConfig) -> str:
    """Plain text: one line per (length, contender), every column with its ratio to bert."""
    cols = _columns(cfg)
    head = f"{'l':>5} {'contender':20s} " + " ".join(f"{name:>28s}" for _, name in cols)
    out = [head]
    for r in rows:
        cells = " ".join(f"{r[k]:>19.3f} (x{r[k + '_ratio']:5.2f})" for k, _ in cols)
        out.append(f"{r['length']:>5} {r['label']:20s} {cells}")
    return "\n".join([*out, footer(rows, cfg)])


def _value(key: str, value: float) -> str:
    return f"{value:,.0f}" if key == "tokens_s" else f"{value:.3f}"


def markdown(rows: list[dict], cfg: BenchConfig) -> str:
    """One markdown table per measured column: contenders x lengths, ratio to bert in brackets."""
    lengths = sorted({r["length"] for r in rows})
    by = {(r["label"], r["length"]): r for r in rows}
    head = "| contender | " + " | ".join(f"l={n}" for n in lengths) + " |"
    sep = "|---|" + "---:|" * len(lengths)
    out = []
    for key, name in _columns(cfg):
        out += [f"{name} (ratio to bert):", "", head, sep]
        for c in cfg.contenders:
            cells = [
                f"{_value(key, by[c.label, n][key])} ({by[c.label, n][key + '_ratio']:.2f})"
                for n in lengths
            ]
            out.append(f"| {c.label} | " + " | ".join(cells) + " |")
        out.append("")
    out.append(footer(rows, cfg))
    return "\n".join(out)


@click.command()
@click.option(
    "--archs",
    default="bert,shatter,bert-rpe,bert-rab",
    show_default=True,
    help="comma-separated archs; bert is always the reference",
)
@click.option(
    "--impls",
    "impl_names",
    default=None,
    help="attention_impl values for the single-head partition archs [default: all that run on the device]",
)
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
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
    help="MLM vocabulary; the embedding/head cost is the same for every arch",
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
    "--markdown", "as_markdown", is_flag=True, help="print markdown tables for docs/benchmarks.md"
)
def main(
    archs,
    impl_names,
    device,
    lengths,
    layers,
    size,
    batch_tokens,
    vocab_size,
    repeats,
    warmup,
    threads,
    attention_dropout,
    as_markdown,
):
    """Print per-contender train-step and attention time and memory, with ratios to bert."""
    names = tuple(a for a in archs.split(",") if a)
    bad = [a for a in names if a not in ARCHS]
    if bad:
        raise click.BadParameter(
            f"unknown archs {bad}; choose from {', '.join(ARCHS)}", param_hint="--archs"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(
            "no CUDA device is visible; run with --device cpu", param_hint="--device"
        )
    dev = torch.device(device)
    runnable = impls_for(dev)
    chosen = runnable if impl_names is None else tuple(i for i in impl_names.split(",") if i)
    bad = [i for i in chosen if i not in runnable]
    if bad:
        raise click.BadParameter(
            f"impls {bad} do not run on {device}; choose from {', '.join(runnable)}",
            param_hint="--impls",
        )
    cfg = BenchConfig(
        contenders=contenders(names, chosen, dev, attention_dropout),
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
        device=device,
        load_before=os.getloadavg()[0],
    )
    torch.set_num_threads(threads)
    click.echo(f"device: {device_name(device)}", err=True)
    rows = run(cfg)
    click.echo(markdown(rows, cfg) if as_markdown else table(rows, cfg))


if __name__ == "__main__":
    main()
