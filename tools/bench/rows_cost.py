"""The `rows` attention impl's kernels, one layer's forward and backward, each priced as the step
model prices a kernel (tools/bench/step_cost.py: its frozen efficiency table, `kernel_seconds`
plus one launch): the per-kernel table of docs/model.md, modelled.

    python tools/bench/rows_cost.py --gpu V100 --lengths 256,1024

The kernels and their FLOPs and bytes are shatter.kernels.cost.rows_kernels (the part GEMMs of
one product on one line); a row `rows-keep` gives the layer without the backward's recomputation
of W.
"""

from __future__ import annotations

import re

import click

from shatter.kernels.cost import rows_kernels
from shatter.tools.bench.step_cost import EFFICIENCY, gpus, kernel_seconds

E = 2  # bytes per fp16 element


def rows_table(gpu_name: str, lengths, batch_tokens: int, d: int, n: int) -> list[str]:
    """The kernels of one `rows` layer's fwd+bwd (shatter.kernels.cost.rows_kernels; the n part
    GEMMs of a product on one line), each priced on `gpu_name` as tools/bench/step_cost.py prices
    a kernel, with its frozen efficiency table: kernel_seconds + one launch each."""
    gpu = gpus()[gpu_name]
    head = f"| l | kernel | launches | GFLOP | MB | {gpu_name} µs (modelled) |"
    lines = [head, "|---|---|---|---|---|---|"]
    for L in lengths:
        B = max(1, batch_tokens // L)
        for keep in (False, True):
            groups: dict[str, list] = {}
            for k in rows_kernels(B, L, d, n, E, keep=keep):
                key = re.sub(r"\d+", "h", k.name)  # the n part GEMMs of a product together
                seconds = (
                    kernel_seconds(k.kind, k.flops, k.bytes, gpu) + EFFICIENCY["launch_us"] * 1e-6
                )
                g = groups.setdefault(key, [0, 0.0, 0.0, 0.0])
                g[0], g[1], g[2], g[3] = g[0] + 1, g[1] + k.flops, g[2] + k.bytes, g[3] + seconds
            total = sum(g[3] for g in groups.values())
            name = "rows-keep" if keep else "rows"
            if not keep:
                for key, (count, f, b, t) in groups.items():
                    lines.append(f"| {L} | {key} | {count} | {f / 1e9:.1f} | {b / 1e6:.0f} | {1e6 * t:.0f} |")  # fmt: skip
            launches = sum(g[0] for g in groups.values())
            lines.append(
                f"| {L} | **{name}, one layer** | {launches} | | | **{1e6 * total:.0f}** |"
            )
    return lines


@click.command()
@click.option("--gpu", "gpu_name", default="V100", show_default=True, help="a GPU of step_cost.py")
@click.option("--lengths", default="256,1024", show_default=True)
@click.option("--batch-tokens", default=16384, show_default=True, help="tokens per batch")
@click.option("--hidden", default=768, show_default=True, help="d (base: 768)")
@click.option("--heads", default=12, show_default=True, help="n parts")
def main(gpu_name, lengths, batch_tokens, hidden, heads):
    """Print the rows impl's per-kernel table (see module doc)."""
    if gpu_name not in gpus():
        raise SystemExit(f"rows_cost: --gpu {gpu_name!r} unknown; choose from {list(gpus())}")
    try:
        ls = [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"rows_cost: --lengths takes integers like 256,1024, got {lengths!r}"
        ) from None
    print(f"rows: one layer's fwd+bwd, d = {hidden}, n = {heads}, {batch_tokens} tokens")
    print("\n".join(rows_table(gpu_name, ls, batch_tokens, hidden, heads)))


if __name__ == "__main__":
    main()
