"""Side-by-side GPU time of the attention kernels alone: the fused Triton partition attention, the
lean PyTorch path (Z0 = Q Xᵀ/√d, then lean.partition_mix_lean) and BERT's multi-head SDPA.

For each length l at the paper's base or large width (d = 768, n = 12 or d = 1024, n = 16),
batch = max(1, batch_tokens // l), random inputs with 10% padded keys in the last sequence,
it times forward and forward + backward with `triton.testing.do_bench` (median ms) and prints
each contender's ratio to SDPA from the same run. Needs a CUDA device.

    python tools/bench_kernel.py --lengths 128,512,1024 --dtype bf16 --arch shatter
"""

from __future__ import annotations

import math

import click
import torch
import torch.nn.functional as F

from shatter.attention.lean import partition_mix_lean
from shatter.partition import partition_table

SHAPES = {"base": (768, 12), "large": (1024, 16)}
ARCHS = {"shatter": (True, True), "1h-sigmoid": (False, True), "1h-softmax": (False, False)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def contenders(B, L, d, n, dtype, bias: bool, sigmoid: bool, device: str = "cuda"):
    """name -> (forward function, its differentiable inputs); the same Q, X, V for all."""
    from shatter.attention.triton_kernel import partition_attention_triton

    g = torch.Generator(device=device).manual_seed(0)
    new = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype).requires_grad_()  # noqa: E731
    Q, X, V_BLD = new(B, L, d), new(B, L, d), new(B, L, d)
    c = new(B, L, n) if bias else None
    mask = torch.ones(B, L, device=device)
    mask[-1, L - L // 10 :] = 0
    table = partition_table(n, 0, 12, max_len=L, device=device)

    def V():
        return V_BLD.view(B, L, n, d // n).transpose(1, 2)

    def triton_fn():
        return partition_attention_triton(Q, X, V(), c, mask, table, sigmoid)

    def lean_fn():
        Z0 = Q @ X.transpose(-1, -2) / math.sqrt(d)
        return partition_mix_lean(Z0, c, V(), mask.bool(), table, sigmoid)

    heads = lambda t: t.view(B, L, n, d // n).transpose(1, 2)  # noqa: E731
    keep = mask.bool()[:, None, None, :]

    def sdpa_fn():  # BERT: n heads of d/n, the keys a projection of their own (here X)
        return (F.scaled_dot_product_attention(heads(Q), heads(X), heads(V_BLD), attn_mask=keep),)

    leaves = [t for t in (Q, X, V_BLD, c) if t is not None]
    return {"triton": (triton_fn, leaves), "lean": (lean_fn, leaves), "sdpa": (sdpa_fn, leaves[:3])}


def timings(fn, leaves) -> tuple[float, float]:
    from triton.testing import do_bench

    outs = fn()
    grads = [torch.randn_like(o) for o in outs]

    def fwd_bwd():
        torch.autograd.grad(fn(), leaves, grads)

    with torch.no_grad():
        forward = do_bench(fn)
    return forward, do_bench(fwd_bwd)


@click.command()
@click.option("--lengths", default="128,256,512,1024", show_default=True)
@click.option("--shape", default="base", show_default=True, type=click.Choice(list(SHAPES)))
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(list(DTYPES)))
@click.option("--batch-tokens", default=16384, show_default=True, help="tokens per batch")
@click.option("--arch", default="shatter", show_default=True, type=click.Choice(list(ARCHS)))
def main(lengths, shape, dtype, batch_tokens, arch):
    """Time the attention kernels on the GPU and print ratios to SDPA (see module doc)."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_kernel: needs a CUDA device (tools/bench_kernel.py times GPU kernels)"
        )
    try:
        ls = [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"bench_kernel: --lengths takes integers like 128,512, got {lengths!r}"
        ) from None
    d, n = SHAPES[shape]
    print(f"{torch.cuda.get_device_name()}, {arch}-{shape} (d={d}, n={n}), {dtype}")
    print("| l | batch | kernel | fwd ms | fwd+bwd ms | fwd / sdpa | fwd+bwd / sdpa |")
    print("|---|---|---|---|---|---|---|")
    for L in ls:
        B = max(1, batch_tokens // L)
        times = {
            name: timings(fn, leaves)
            for name, (fn, leaves) in contenders(B, L, d, n, DTYPES[dtype], *ARCHS[arch]).items()
        }
        ref = times["sdpa"]
        for name, (fwd, both) in times.items():
            print(f"| {L} | {B} | {name} | {fwd:.3f} | {both:.3f} | "
                  f"{fwd / ref[0]:.2f} | {both / ref[1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
