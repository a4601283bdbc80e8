"""Side-by-side GPU time of the attention alone: the hybrid `triton` impl, `rows`, `chunked`, and
BERT's multi-head SDPA on the backends a GPU run of BERT actually takes.

For each length l at the paper's base or large width (d = 768, n = 12 or d = 1024, n = 16),
batch = max(1, batch_tokens // l), random inputs, it times forward and forward + backward with
`triton.testing.do_bench` (median ms) and prints each contender's ratio to SDPA on
FlashAttention-2 from the same run:

    sdpa-flash      BERT's n heads of d/n, `sdpa_kernel(FLASH_ATTENTION)`, no mask (FA2 takes no
                    attn_mask: a mask silently sends SDPA to another backend)
    sdpa-efficient  the same with a [B, 1, 1, l] padding mask, `sdpa_kernel(EFFICIENT_ATTENTION)`
                    (what BERT with padding and V100s run)
    sdpa-cudnn      no mask, `sdpa_kernel(CUDNN_ATTENTION)`: cuDNN's fused attention
    sdpa-default    no mask, SDPA's own choice among its backends: what BERT's layer runs (on
                    an H200 under torch 2.11, cuDNN's kernels: docs/benchmarks.md)
    triton          the hybrid impl (shatter/attention/triton_kernel.py), with the padding mask
    rows            cuBLAS GEMMs around Triton row kernels (shatter/attention/rows.py, auto's
                    choice on V100s in fp16), on the projections as the layer runs it
    rows-keep       the same, W = A ⊙ N kept from the forward
    chunked         the cuBLAS row-block impl, with the padding mask

The padding mask pads the last 10% of the last sequence. Then, for `triton` at each length, a
torch.profiler split of one fwd+bwd into cuBLAS GEMMs, the mixing forward kernels, the mixing
backward kernels and the PyTorch glue between them (CUDA time per group). Needs a CUDA device.

    python tools/bench/bench_kernel.py --lengths 256,512,1024 --dtype bf16 --arch shatter
    python tools/bench/bench_kernel.py --lengths 256,1024 --dtype fp16   # a V100 (triton: refused)
"""

from __future__ import annotations

import contextlib
import math

import click
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shatter.attention.chunked import partition_attention_chunked
from shatter.partition import partition_table

SHAPES = {"base": (768, 12), "large": (1024, 16)}
ARCHS = {"shatter": (True, True), "1h-sigmoid": (False, True), "1h-softmax": (False, False)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIXING_FWD = ("row_stats_kernel", "mix_fwd_kernel")
MIXING_BWD = ("delta_kernel", "mix_bwd_dv_kernel", "mix_bwd_dz_kernel")
GEMM_NAMES = ("gemm", "cutlass", "xmma", "cublas", "nvjet", "ampere_", "sm80_", "sm90_")


def contenders(B, L, d, n, dtype, bias: bool, sigmoid: bool, device: str = "cuda"):
    """name -> (forward function, its differentiable inputs); the same Q, X, V for all."""
    from shatter.attention.rows import rows_layer
    from shatter.attention.triton_kernel import partition_attention_layer

    g = torch.Generator(device=device).manual_seed(0)
    new = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    Q, X, V_BLD = new(B, L, d), new(B, L, d), new(B, L, d)
    c = new(B, L, n) if bias else None
    mask = torch.ones(B, L, device=device, dtype=torch.bool)
    mask[-1, L - L // 10 :] = False
    table = partition_table(n, 0, 12, max_len=L, device=device)
    heads = lambda t: t.view(B, L, n, d // n).transpose(1, 2)  # noqa: E731
    keep = mask[:, None, None, :]
    leaves = [t for t in (Q, X, V_BLD, c) if t is not None]

    def sdpa(backend, attn_mask):
        def fn():  # BERT: n heads of d/n, the keys a projection of their own (here X)
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                o = F.scaled_dot_product_attention(
                    heads(Q), heads(X), heads(V_BLD), attn_mask=attn_mask
                )
            return (o,)

        return fn

    def partition(impl):
        return lambda: impl(Q, X, heads(V_BLD), c, mask, table, sigmoid)

    # triton as the layer runs it: on the projections P = [Q | V | c] (the same values), dP whole
    P = torch.cat([t.detach() for t in (Q, V_BLD, c) if t is not None], -1).requires_grad_()

    return {
        "sdpa-flash": (sdpa(SDPBackend.FLASH_ATTENTION, None), leaves[:3]),
        "sdpa-efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION, keep), leaves[:3]),
        "sdpa-cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION, None), leaves[:3]),
        "sdpa-default": (sdpa(None, None), leaves[:3]),
        "triton": (lambda: (partition_attention_layer(P, X, mask, table, sigmoid),), [P, X]),
        "rows": (lambda: (rows_layer(P, X, mask, table, sigmoid),), [P, X]),
        "rows-keep": (lambda: (rows_layer(P, X, mask, table, sigmoid, keep=True),), [P, X]),
        "chunked": (partition(partition_attention_chunked), leaves),
    }


def _fwd_bwd(fn, leaves):
    outs = fn()
    grads = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.grad(fn(), leaves, grads)


def timings(fn, leaves) -> tuple[float, float]:
    from triton.testing import do_bench

    with torch.no_grad():
        forward = do_bench(fn)
    return forward, do_bench(_fwd_bwd(fn, leaves))


def group(name: str) -> str:
    if any(k in name for k in MIXING_FWD):
        return "mixing fwd"
    if any(k in name for k in MIXING_BWD):
        return "mixing bwd"
    if any(k in name.lower() for k in GEMM_NAMES):
        return "GEMMs"
    return "glue"


def profile_split(fn, leaves, repeats: int = 5) -> dict[str, float]:
    """CUDA ms per group (GEMMs, mixing fwd, mixing bwd, glue) of one fwd+bwd (mean of repeats)."""
    from torch.profiler import ProfilerActivity, profile

    step = _fwd_bwd(fn, leaves)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    split = dict.fromkeys(("GEMMs", "mixing fwd", "mixing bwd", "glue"), 0.0)
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            split[group(event.key)] += us / 1e3 / repeats
    return split


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0][:100]


def timed(name: str, fn, leaves, L: int, B: int) -> tuple[float, float]:
    """(fwd ms, fwd+bwd ms), or NaNs after a row naming the failure: any contender's error (no
    flash kernel for this dtype, a Triton compile or out-of-resources error, out of memory)
    leaves the other contenders and lengths to run."""
    try:
        return timings(fn, leaves)
    except Exception as e:  # noqa: BLE001
        print(f"| {L} | {B} | {name} | failed: {type(e).__name__}: {first_line(e)} | | | |")
        torch.cuda.empty_cache()
        return float("nan"), float("nan")


@click.command()
@click.option("--lengths", default="128,256,512,1024", show_default=True)
@click.option("--shape", default="base", show_default=True, type=click.Choice(list(SHAPES)))
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(list(DTYPES)))
@click.option("--batch-tokens", default=16384, show_default=True, help="tokens per batch")
@click.option("--arch", default="shatter", show_default=True, type=click.Choice(list(ARCHS)))
def main(lengths, shape, dtype, batch_tokens, arch):
    """Time the attention impls on the GPU and print ratios to SDPA-flash (see module doc)."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_kernel: needs a CUDA device (tools/bench/bench_kernel.py times GPU kernels)"
        )
    try:
        ls = [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"bench_kernel: --lengths takes integers like 128,512, got {lengths!r}"
        ) from None
    d, n = SHAPES[shape]
    print(f"{torch.cuda.get_device_name()}, {arch}-{shape} (d={d}, n={n}), {dtype}")
    print("| l | batch | impl | fwd ms | fwd+bwd ms | fwd / sdpa-flash | fwd+bwd / sdpa-flash |")
    print("|---|---|---|---|---|---|---|")
    splits = {}
    for L in ls:
        B = max(1, batch_tokens // L)
        runs = contenders(B, L, d, n, DTYPES[dtype], *ARCHS[arch])
        ref = (float("nan"), float("nan"))  # sdpa-flash's, timed first
        for name, (fn, leaves) in runs.items():
            fwd, both = timed(name, fn, leaves, L, B)
            ref = (fwd, both) if name == "sdpa-flash" else ref
            if not math.isnan(fwd):  # one line per contender as it is timed: a cut run keeps them
                print(f"| {L} | {B} | {name} | {fwd:.3f} | {both:.3f} | "
                      f"{fwd / ref[0]:.2f} | {both / ref[1]:.2f} |", flush=True)  # fmt: skip
        try:
            splits[L] = profile_split(*runs["triton"])
        except Exception as e:  # noqa: BLE001 (the table above stands without the split)
            print(f"| {L} | profile of triton failed: {type(e).__name__}: {first_line(e)} |")
    print("\ntriton fwd+bwd, torch.profiler CUDA time per group (ms)")
    print("| l | GEMMs | mixing fwd | mixing bwd | glue | total |")
    print("|---|---|---|---|---|---|")
    for L, split in splits.items():
        cells = " | ".join(f"{v:.3f}" for v in split.values())
        print(f"| {L} | {cells} | {sum(split.values()):.3f} |")


if __name__ == "__main__":
    main()
