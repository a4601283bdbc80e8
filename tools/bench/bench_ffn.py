"""Side-by-side GPU time of the block's FFN alone, in each `ffn_impl` (shatter/ffn.py):

    torch    nn.Linear, F.gelu, nn.Linear (cuBLAS GEMMs, GELU a kernel of its own each way)
    triton   GELU in the epilogues of the GEMMs around it (shatter/kernels/gelu_linear.py)

At the paper's base or large width (d = 768 or 1024, an inner width of 4d), --tokens rows, random
inputs, it times the forward and the forward + backward with `triton.testing.do_bench` (median
ms), eager (and with --compiled under torch.compile too), and prints each one's ratio to `torch`
eager from the same run, then the autotuner's configuration for the run's shapes. Needs a CUDA
device of compute capability 8.0 or more.

    python tools/bench/bench_ffn.py --tokens 16384 --dtype bf16 --shape base --compiled
"""

from __future__ import annotations

import click
import torch

SHAPES = {"base": 768, "large": 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _timings(impl: str, compiled: bool, d: int, tokens: int, dtype) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of the FFN in `impl`."""
    from triton.testing import do_bench

    from shatter.ffn import feed_forward

    ffn_in = torch.nn.Linear(d, 4 * d, device="cuda", dtype=dtype)
    ffn_out = torch.nn.Linear(4 * d, d, device="cuda", dtype=dtype)
    x = torch.randn(tokens, d, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, d, device="cuda", dtype=dtype)

    def forward():
        return feed_forward(x, ffn_in, ffn_out, impl)

    fn = torch.compile(forward) if compiled else forward

    def both():
        fn().backward(dy)

    return do_bench(fn), do_bench(
        both, grad_to_none=[x, *ffn_in.parameters(), *ffn_out.parameters()]
    )


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--tokens", default=16384, show_default=True, help="rows a call (batch x length)")
@click.option("--shape", type=click.Choice(list(SHAPES)), default="base", show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bf16", show_default=True)
@click.option("--compiled", is_flag=True, help="also under torch.compile (inductor)")
def main(tokens: int, shape: str, dtype: str, compiled: bool) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        raise SystemExit("bench_ffn: needs a CUDA device of compute capability >= 8.0")
    d, low = SHAPES[shape], DTYPES[dtype]
    print(
        f"{torch.cuda.get_device_name()}, {shape} (d = {d}, 4d = {4 * d}), {tokens} tokens, {dtype}"
    )
    print(
        "| impl | mode | forward ms | fwd+bwd ms | forward / torch eager | fwd+bwd / torch eager |"
    )
    print("|---|---|---|---|---|---|")
    base = None
    for mode in ("eager", "compiled")[: 1 + compiled]:
        for impl in ("torch", "triton"):
            fwd, both = _timings(impl, mode == "compiled", d, tokens, low)
            base = base or (fwd, both)
            print(f"| {impl} | {mode} | {fwd:.3f} | {both:.3f} | {fwd / base[0]:.2f} | {both / base[1]:.2f} |")  # fmt: skip
    from shatter.kernels.gelu_linear import linear_gelu_bwd_kernel, linear_gelu_kernel

    for name, kernel in (("forward", linear_gelu_kernel), ("backward", linear_gelu_bwd_kernel)):
        print(f"autotuned {name}: {kernel.best_config}")


if __name__ == "__main__":
    main()
