"""A roofline cost model of one attention layer's forward + backward, per impl and shape.

For each impl it lists the kernels one fwd+bwd launches, each with its tensor-core FLOPs and its
ideal HBM bytes (every operand read once per pass that needs it, as the kernel's grid reads it;
the re-reads of a tile between programs that hit L2 are not counted), and prices each kernel at
max(FLOPs / peak tensor FLOP/s, bytes / HBM bandwidth) on H100, A100 and V100, summed over the
kernels. It is the best case each design can reach, to read a GPU measurement against
(tools/bench/bench_kernel.py): a real kernel reaches 40-75% of it.

    fused-old   the former fused Triton kernel: four kernels (fwd, dv, dq, dx) that each recompute
                Q Xᵀ over d, its fp32 output normalised and cast by PyTorch glue, δ from .float()
                copies
    hybrid      `triton`: Z = Q Xᵀ/√d on cuBLAS (saved), Triton row statistics + mixing (the side's
                Z tiles read once per group of 2 parts), δ, dV, dZ (with dc), dQ = dZ X and
                dX = dZᵀ Q on cuBLAS
    fused       `fused`: the hybrid's Triton kernels recomputing Q Xᵀ on chip (Z never stored): row
                statistics and mixing forward each sweep Q Xᵀ, dV and dS (with dc) again, dS/√d
                to the cuBLAS dQ and dX (shatter/kernels/cost.py's per-kernel list, sm_90 groups)
    chunked     row blocks through cuBLAS, A ⊙ N materialised per block as [B, n, r, l] (fwd, and
                twice in the recomputing backward), dZ into one [B, l, l] buffer
    rows        `rows`: every product a cuBLAS GEMM (Z, the n parts' X̄[h] = W_h V[h], dV, dW_h, dQ,
                dX), W = A ⊙ N written in the input dtype by a Triton row kernel (again in the
                backward: `rows-keep` keeps it), dA, δ, dZ, dc by a second
                (shatter.kernels.cost.rows_kernels); runs on V100s
    sdpa-flash  BERT's n heads of d/n through FlashAttention-2 (no mask); the memory-efficient
                kernel with a padding mask has the same FLOPs and reads the [B, 1, 1, l] mask
                broadcast per tile

Peaks (dense bf16/fp16 tensor FLOP/s, HBM bytes/s) are the vendors' datasheet figures for the SXM
parts: H100 989 TFLOP/s and 3.35 TB/s, A100-80GB 312 TFLOP/s and 2.04 TB/s, V100 125 TFLOP/s and
0.90 TB/s. Triton emits no tensor-core code below sm_80: fused-old, hybrid and fused have no V100 column.

    python tools/bench/attention_cost.py                       # base width, l = 128..1024, 16k tokens
    python tools/bench/attention_cost.py --lengths 512 --batch-tokens 32768 --markdown
"""

from __future__ import annotations

import click

GPUS = {"H100": (989e12, 3.35e12), "A100": (312e12, 2.039e12), "V100": (125e12, 0.9e12)}
TRITON_GPUS = ("H100", "A100")  # sm_80+
IMPLS = ("fused-old", "hybrid", "fused", "chunked", "rows", "rows-keep", "sdpa-flash")
E = 2  # bytes per bf16/fp16 element
F32 = 4


def kernels(impl: str, B: int, L: int, d: int, n: int) -> list[tuple[str, float, float]]:
    """(kernel, tensor-core FLOPs, HBM bytes) of one attention fwd+bwd: see the module doc."""
    T, P = B * L, B * L * L  # tokens, score pairs
    Td = T * d
    pair_dot = P * d  # every (i, j) pair through a d-wide product once: 2 P d FLOPs is a GEMM
    if impl == "sdpa-flash":
        return [
            ("fwd: QKᵀ, PV", 4 * pair_dot, (4 * Td) * E + T * n * F32),
            ("bwd: QKᵀ again, dV, dP, dQ, dK", 10 * pair_dot, 8 * Td * E + 2 * Td * F32),
        ]
    if impl in ("rows", "rows-keep"):
        from shatter.kernels.cost import rows_kernels

        return [
            (k.name, k.flops, k.bytes) for k in rows_kernels(B, L, d, n, E, impl == "rows-keep")
        ]
    if impl == "fused":
        from shatter.kernels.cost import layer_kernels

        return [(k.name, k.flops, k.bytes) for k in layer_kernels("fused", (B, L, d, n), E)]
    if impl == "hybrid":
        groups = n // 2 // (2 if (n // 2) % 2 == 0 else n // 2)  # Z read once per group and side
        return [
            ("fwd GEMM Z = Q Xᵀ", 2 * pair_dot, 2 * Td * E + P * E),
            ("fwd row stats", 0, P * E + T * F32),
            ("fwd mixing", pair_dot, groups * P * E + 2 * Td * E + T * n * E),
            ("bwd delta", 0, 2 * Td * E + 2 * T * n * E + T * F32),
            ("bwd dV", pair_dot, groups * P * E + 2 * Td * E),
            ("bwd dZ, dc", pair_dot, 2 * P * E + 2 * Td * E + 2 * T * n * E),
            ("bwd GEMMs dQ = dZ X, dX = dZᵀ Q", 4 * pair_dot, 2 * P * E + 4 * Td * E),
        ]
    if impl == "fused-old":
        return [
            ("fwd (Q Xᵀ, mixing)", 3 * pair_dot, 3 * Td * E + Td * F32),
            ("fwd glue: mul_, .to", 0, 3 * Td * F32 + Td * E),
            ("bwd glue: δ from .float() copies", 0, 2 * Td * E + 3 * Td * F32),
            ("bwd dv (Q Xᵀ again)", 3 * pair_dot, 3 * Td * E),
            ("bwd dq (Q Xᵀ again, dA, dQ)", 5 * pair_dot, 4 * Td * E),
            ("bwd dx (Q Xᵀ again, dA, dX)", 5 * pair_dot, 4 * Td * E),
        ]
    if impl == "chunked":
        nP = n * P  # A ⊙ N and dL/d(A ⊙ N): [B, n, l, l] over the row blocks
        return [
            ("fwd GEMM Z block", 2 * pair_dot, 2 * Td * E + P * F32),
            ("fwd sigmoid, norm, A (fp32)", 0, 4 * P * F32),
            ("fwd A ⊙ N, then (A ⊙ N) V", 2 * pair_dot, 2 * nP * E + 2 * Td * E),
            ("bwd GEMM Z block again, A", 2 * pair_dot, 2 * Td * E + 4 * P * F32),
            ("bwd A ⊙ N, dV", 2 * pair_dot, 2 * nP * E + 2 * Td * E),
            ("bwd dX̄ Vᵀ, ⊙ N, Σ_h (fp32)", 2 * pair_dot, nP * (E + 2 * F32 + 2 * F32) + Td * E),
            ("bwd dS (fp32), dZ buffer", 0, 6 * P * F32 + P * E),
            ("bwd GEMMs dQ, dX", 4 * pair_dot, 2 * P * E + 4 * Td * E),
        ]
    raise ValueError(f"attention_cost: unknown impl {impl!r}; choose from {IMPLS}")


def seconds(parts, gpu: str) -> float:
    flops, bw = GPUS[gpu]
    return sum(max(f / flops, b / bw) for _, f, b in parts)


def table(lengths, batch_tokens: int, d: int, n: int) -> list[str]:
    head = "| l | batch | impl | GFLOP | HBM MB | " + " | ".join(f"{g} ms" for g in GPUS)
    head += " | H100 / sdpa-flash |"
    lines = [head, "|" + "---|" * (6 + len(GPUS))]
    for L in lengths:
        B = max(1, batch_tokens // L)
        ref = seconds(kernels("sdpa-flash", B, L, d, n), "H100")
        for impl in IMPLS:
            parts = kernels(impl, B, L, d, n)
            flops = sum(f for _, f, _ in parts)
            hbm = sum(b for _, _, b in parts)
            times = []
            for gpu in GPUS:
                triton_only = impl in ("fused-old", "hybrid", "fused") and gpu not in TRITON_GPUS
                times.append("n/a" if triton_only else f"{1e3 * seconds(parts, gpu):.3f}")
            ratio = seconds(parts, "H100") / ref
            lines.append(
                f"| {L} | {B} | {impl} | {flops / 1e9:.1f} | {hbm / 1e6:.0f} | "
                + " | ".join(times)
                + f" | {ratio:.2f} |"
            )
    return lines


@click.command()
@click.option("--lengths", default="128,256,512,1024", show_default=True)
@click.option("--batch-tokens", default=16384, show_default=True, help="tokens per batch")
@click.option("--hidden", default=768, show_default=True, help="d (BERT-base: 768)")
@click.option("--heads", default=12, show_default=True, help="n heads or parts")
@click.option(
    "--kernels", "show_kernels", is_flag=True, help="also each impl's kernels at the first length"
)
def main(lengths, batch_tokens, hidden, heads, show_kernels):
    """Print the cost model's table (see module doc)."""
    try:
        ls = [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"attention_cost: --lengths takes integers like 256,512, got {lengths!r}"
        ) from None
    if hidden % heads or heads % 2:
        raise SystemExit(
            f"attention_cost: --hidden {hidden} must split into an even --heads {heads}"
        )
    print(f"attention fwd+bwd, d = {hidden}, n = {heads}, bf16, {batch_tokens} tokens per batch")
    print("\n".join(table(ls, batch_tokens, hidden, heads)))
    if show_kernels:
        L = ls[0]
        B = max(1, batch_tokens // L)
        for impl in IMPLS:
            print(f"\n{impl}, l = {L}, batch {B}: kernel, GFLOP, HBM MB, H100 ms")
            for name, f, b in kernels(impl, B, L, hidden, heads):
                print(
                    f"  {name}: {f / 1e9:.1f}, {b / 1e6:.0f}, {1e3 * seconds([(name, f, b)], 'H100'):.3f}"
                )


if __name__ == "__main__":
    main()
