"""The kernels of the `shatter::` custom ops, each with its FLOPs and HBM bytes: the one registry a
step-cost model reads (tools/step_cost.py prices it; tools/step_trace.py records it).

The form. `OP_COSTS[name](args, kwargs, outputs) -> list[Kernel]` gives, for one call of the op
`name` (its qualified name, e.g. "shatter::mixing_fwd"), every kernel the call launches, in order,
from the shapes, dtypes and strides of its arguments and outputs alone (real, fake or meta
tensors). Each kernel is `Kernel(name, kind, flops, bytes)`:

- kind: how a model prices its products. "gemm": a cuBLAS product; "custom": a Triton (or other
  hand-written) kernel whose products run on `tl.dot`; "memory": a kernel without products
  (elementwise, reductions, copies, fills), flops 0.
- flops: the matrix products the kernel executes, 2 per multiply-add (elementwise work such as
  sigmoid, exp and the table gathers is not counted, as in train/cost.py).
- bytes: its reads and writes of global memory, each tensor once per kernel that streams it and
  once per program group that re-reads it.

A model prices each kernel on its own, then adds them up:

    time(kernel) = max(flops / (efficiency[kind] x peak), bytes / (efficiency["memory"] x HBM))
    time(op)     = sum of time(kernel) + one launch per kernel

so a kernel small enough to be bound by neither still costs its launch: list every kernel the op
runs, small ones included (a mask cast, a fill). To price a new op: write
`def my_op_cost(args, kwargs, outputs) -> list[Kernel]`, give its argument names in OP_SCHEMA
(so `_bind` reads args and kwargs alike), its function in OP_COSTS and its dense count in
`model_flops`; `op_totals(kernels)` is its (FLOPs, bytes), and `register_costs((name,))`, called
where the op is defined, hands the FLOPs to torch.utils.flop_counter.

The `triton` impl's two ops (shatter/attention/triton_kernel.py): from sm_80 the row statistics
make Z = Q Xᵀ/√d on chip and write z + b (a Triton GEMM with the statistics inside: Q and X read,
Z written); below sm_80 Z is a cuBLAS GEMM and the statistics a memory-bound Triton kernel that
reads it (with the partition bias also writing z + b back). dQ = dZ X and dX = dZᵀ Q are cuBLAS
GEMMs, δ a memory-bound kernel; the mixing forward, dV and dZ kernels run the mixing dots. A part
f_h(j − i) is zero on one side of the diagonal, so the mixing dots of a key tile cover only the n/2 parts of its side: about half of the
dense A V that model FLOPs count (train/cost.py, l·d per token); `model_flops` gives that
convention. Z is read once per group of parts by the forward and dV kernels (`_z_reads`, the
GROUP of sm_90's configurations); tensors of B·L·n elements and smaller (c, A_part, the mask, the
row statistics) move too few bytes to count, but their kernels count their launches.

The `rows` impl's two ops (shatter/attention/rows.py) are one Triton row kernel each, with no
product inside ("memory"): the GEMMs around them are aten ops that a trace prices as GEMMs of
their own. `rows_kernels` lists a whole `rows` layer's kernels, GEMMs included, for the
per-kernel table of docs/model.md and tests/shatter/test_rows.py.

The `fused` impl's two ops (shatter/kernels/fused_attention.py) run the same Triton kernels with
Q Xᵀ/√d recomputed on chip wherever a score is needed: no Z GEMM and no Z; each kernel that makes
scores executes 2d FLOPs per score (the row statistics over every key, the forward and dV kernels
once per group of parts, the dS kernel once) and reads Q and X instead of Z. dS/√d is written for
the dQ and dX GEMMs as in the hybrid. `modelled_seconds` prices either impl's layer for `auto`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

from shatter.kernels.family import (
    delta_inside,
    family_of,  # noqa: F401 (the cost model's users read it here)
    z_inside,
)

KINDS = ("gemm", "custom", "memory")


class Kernel(NamedTuple):
    """One kernel of a custom op: `kind` in KINDS, its executed FLOPs and its HBM bytes."""

    name: str
    kind: str
    flops: float
    bytes: float


def op_totals(kernels: Iterable[Kernel]) -> tuple[float, float]:
    """(FLOPs, bytes) of an op's kernels together."""
    kernels = list(kernels)
    return float(sum(k.flops for k in kernels)), float(sum(k.bytes for k in kernels))


OP_SCHEMA = {  # the ops' argument names, to read args and kwargs alike
    "shatter::mixing_fwd": ("P", "X", "mask", "table", "sigmoid"),
    "shatter::mixing_bwd": (
        "P", "X", "mask", "table", "Z", "stat", "out", "part", "g_out", "g_part", "sigmoid",
    ),
    "shatter::rows_fwd": ("Z", "c", "mask", "table", "sigmoid"),
    "shatter::rows_bwd": ("Z", "c", "mask", "table", "dW", "g_part", "sigmoid", "scale"),
    "shatter::fused_fwd": ("P", "X", "mask", "table", "sigmoid"),
    "shatter::fused_bwd": (
        "P", "X", "mask", "table", "stat", "out", "part", "g_out", "g_part", "sigmoid",
    ),
    "shatter::linear_gelu": ("x", "weight", "bias", "keep_h"),
    "shatter::linear_gelu_bwd": ("g_out", "weight_out", "h"),
    "shatter::master_adamw_": (
        "grads", "master", "exp_avg", "exp_avg_sq", "step", "weight", "lr", "beta1", "beta2",
        "eps", "weight_decay", "grad_scale", "found_inf", "step_counted",
    ),
    "shatter::norm_verdict": ("squares", "skipped", "steps", "clip", "fresh"),
    "shatter::partial_sums": ("ws", "parts", "rows", "width", "dtype"),
}  # fmt: skip


def _bind(name: str, args, kwargs) -> dict:
    return {**dict(zip(OP_SCHEMA[name], args)), **kwargs}


def _dims(a: dict) -> tuple[int, int, int, int, int, int]:
    """(B, L, Lp, d, n, element bytes): Lp is Z's row length (L rounded up to 16)."""
    B, L, d = a["X"].shape
    return B, L, -(-L // 16) * 16, d, a["table"].shape[0], a["X"].element_size()


def _z_reads(n: int, d: int, kernel: str, recompute: bool = False, family: int | None = 90) -> int:
    """Sweeps of the scores by the mixing forward or dV kernel (reads of Z, or with `recompute`
    Q Xᵀ made again): each side's keys once per group of parts, the two sides together once per
    group, with the GROUP of the kernel's configurations for n on the arch family (sm_90 unless
    told; partition_mixing.usable)."""
    from shatter.kernels import partition_mixing as pm

    configs = {"fwd": pm.FWD_CONFIGS, "dv": pm.DV_CONFIGS}[kernel]
    best = pm.usable(configs, n, pm.block_k(d, n), family=family, recompute=recompute)[0]
    return n // 2 // best.kwargs["GROUP"]


def mixing_dot_flops(B: int, L: int, d: int) -> float:
    """The mixing dots of one sweep (forward X̄, dV, or dA of the dZ pass): every pair (i, j)
    of a side, j >= i or j <= i, against the side's n/2 parts of d/n: d/2 multiply-adds."""
    return 1.0 * B * L * (L + 1) * d


def mixing_fwd_cost(args, kwargs, outputs, family: int | None = 90) -> list[Kernel]:
    from shatter.attention.projection import projection_width

    a = _bind("shatter::mixing_fwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x, xp = B * L * Lp * e, B * L * d * e, B * Lp * d * e  # Z, a [B, L, d], the padded keys
    if z_inside(family):  # Q and X read, z + b written: the GEMM with the statistics inside
        qx = 2.0 * B * L * L * d
        kernels = [Kernel("Z = Q Xᵀ/√d and row statistics", "custom", qx, float(2 * x + z))]
    else:  # cuBLAS's Z, read by the statistics (and with the part bias z + b written back)
        has_c = a["P"].shape[-1] != projection_width(d, n, bias=False)  # [Q | V | c] or [Q | V]
        kernels = [Kernel("pad the keys to Lp", "memory", 0.0, float(x + xp))] if L % 16 else []
        kernels.append(Kernel("Z = Q Xᵀ/√d", "gemm", 2.0 * B * L * Lp * d, float(x + xp + z)))
        kernels.append(Kernel("row statistics", "memory", 0.0, float(z * (2 if has_c else 1))))
    reads = _z_reads(n, d, "fwd", False, family)  # Z per group of parts; V read, X̄ written
    flops = mixing_dot_flops(B, L, d)
    return kernels + [Kernel("mixing forward", "custom", flops, float(reads * z + 2 * x))]


def mixing_bwd_cost(args, kwargs, outputs, family: int | None = 90) -> list[Kernel]:
    a = _bind("shatter::mixing_bwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x, s = B * L * Lp * e, B * L * d * e, B * L * L * e  # Z, a [B, L, d], dS = dZ[:, :, :L]
    kernels = []
    if a["g_out"].stride(-1) != 1:  # dX̄ made contiguous in its last dimension
        kernels.append(Kernel("dX̄ contiguous", "memory", 0.0, float(2 * x)))
    sweep = mixing_dot_flops(B, L, d)
    if delta_inside(family):  # δ in the dZ kernel's prologue: X̄ read there, no launch of its own
        delta = [Kernel("dZ and δ", "custom", sweep, float(2 * z + 3 * x))]
    else:
        delta = [
            Kernel("δ", "memory", 0.0, float(2 * x)),  # X̄ and dX̄
            Kernel("dZ", "custom", sweep, float(2 * z + 2 * x)),  # Z, V, dX̄ in, dZ out
        ]
    return kernels + [
        Kernel("dV", "custom", sweep, float(_z_reads(n, d, "dv", False, family) * z + 2 * x)),
        *delta,
        Kernel("dQ = dZ X", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
        Kernel("dX = dZᵀ Q", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
    ]


def _row_dims(a: dict) -> tuple[int, int, int, int]:
    """(B, L, n, element bytes) of a row op: Z is [B, L, Lp]."""
    B, L, _ = a["Z"].shape
    return B, L, a["table"].shape[0], a["Z"].element_size()


def rows_fwd_kernel(B: int, L: int, n: int, e: int) -> Kernel:
    """The forward row kernel: Z's rows read once, W's n rows written (A_part, c, the mask and
    the table are B·L·n and smaller: left out)."""
    return Kernel("rows_fwd: W, A_part", "memory", 0.0, float((1 + n) * B * L * L * e))


def rows_bwd_kernel(B: int, L: int, n: int, e: int) -> Kernel:
    """The backward row kernel: Z's rows and dW's n rows read, dZ's rows written."""
    return Kernel("rows_bwd: dA, δ, dZ, dc", "memory", 0.0, float((n + 2) * B * L * L * e))


def rows_fwd_cost(args, kwargs, outputs) -> list[Kernel]:
    return [rows_fwd_kernel(*_row_dims(_bind("shatter::rows_fwd", args, kwargs)))]


def rows_bwd_cost(args, kwargs, outputs) -> list[Kernel]:
    return [rows_bwd_kernel(*_row_dims(_bind("shatter::rows_bwd", args, kwargs)))]


def rows_kernels(B: int, L: int, d: int, n: int, e: int = 2, keep: bool = False) -> list[Kernel]:
    """Every kernel of one `rows` layer's forward and backward, in order: the cuBLAS GEMMs (2 FLOPs
    a multiply-add over their dense shapes, the parts' zero halves included; a product over the
    parts in min(B, n) strided-batched GEMMs, as rows.batches) and the row ops; bytes as each
    kernel reads its operands and writes its result once (tensors of B·L·n elements and smaller
    left out, but dc's copy into dP and dP's zeroed alignment columns counted as launches).
    `keep`: W kept from the forward (`rows-keep`)."""
    T = B * L
    z, x, pair = T * L * e, T * d * e, 2.0 * T * L * d  # an l x l matrix; a [B, L, d]; a GEMM
    g = min(B, n)  # GEMMs a product over the parts takes
    part = (pair / g, float(n * z + 2 * x) / g)  # W with V or dX̄, X̄ or dV or dW: 1/g each
    out = [Kernel("Z = Q Xᵀ/√d", "gemm", pair, float(2 * x + z)), rows_fwd_kernel(B, L, n, e)]
    out += [Kernel(f"X̄ = W V, batch {i}", "gemm", *part) for i in range(g)]
    if not keep:
        out.append(rows_fwd_kernel(B, L, n, e)._replace(name="rows_fwd: W again"))
    for i in range(g):
        out.append(Kernel(f"dV = Wᵀ dX̄, batch {i}", "gemm", *part))
        out.append(Kernel(f"dW = dX̄ Vᵀ, batch {i}", "gemm", *part))
    return out + [
        rows_bwd_kernel(B, L, n, e),
        Kernel("dc into dP", "memory", 0.0, 0.0),
        Kernel("dP's alignment columns", "memory", 0.0, 0.0),
        Kernel("dQ = dZ X", "gemm", pair, float(z + 2 * x)),
        Kernel("dX = dZᵀ Q", "gemm", pair, float(z + 2 * x)),
    ]


def fused_fwd_cost(args, kwargs, outputs, family: int | None = 90) -> list[Kernel]:
    """The fused forward: the row statistics sweep Q Xᵀ once (made on chip from Q and X), the
    mixing forward again per group of parts (each side its own keys: one l x l per group)."""
    a = _bind("shatter::fused_fwd", args, kwargs)
    B, L, _, d, n, e = _dims(a)
    x, sweep = B * L * d * e, mixing_dot_flops(B, L, d)
    groups = _z_reads(n, d, "fwd", True, family)
    return [
        Kernel("row statistics (Q Xᵀ on chip)", "custom", 2.0 * B * L * L * d, float(2 * x)),
        Kernel(  # Q and X per group of parts, V, X̄ written
            "mixing forward (Q Xᵀ on chip)", "custom", (2 * groups + 1) * sweep,
            float((2 * groups + 2) * x),
        ),
    ]  # fmt: skip


def fused_bwd_cost(args, kwargs, outputs, family: int | None = 90) -> list[Kernel]:
    """The fused backward: dV and dS (with dc) recompute Q Xᵀ; dS/√d [B, L, Lp] is written for
    the two cuBLAS GEMMs, as in the hybrid."""
    a = _bind("shatter::fused_bwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x, s = B * L * Lp * e, B * L * d * e, B * L * L * e
    sweep, groups = mixing_dot_flops(B, L, d), _z_reads(n, d, "dv", True, family)
    kernels = []
    if a["g_out"].stride(-1) != 1:  # dX̄ made contiguous in its last dimension
        kernels.append(Kernel("dX̄ contiguous", "memory", 0.0, float(2 * x)))
    return kernels + [  # Q and X per group, dX̄ in, dV out
        Kernel("dV (Q Xᵀ on chip)", "custom", (2 * groups + 1) * sweep, float((2 * groups + 2) * x)),
        Kernel("δ", "memory", 0.0, float(2 * x)),  # X̄ and dX̄
        Kernel("dS (Q Xᵀ on chip)", "custom", 2.0 * B * L * L * d + sweep, float(4 * x + z)),
        Kernel("dQ = dS X", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
        Kernel("dX = dSᵀ Q", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
    ]  # fmt: skip


# the FFN's GEMMs with GELU in their epilogues: GEMMs in a step's split (tools/bench/step_cost.py,
# step_measure.py), not attention
FFN_OPS = ("shatter::linear_gelu", "shatter::linear_gelu_bwd")
# the row tile of every GPU configuration of shatter/kernels/gelu_linear.py (its ROW_TILE): the
# backward writes one fp32 row of column sums per tile of rows
FFN_ROW_TILE = 128


def linear_gelu_cost(args, kwargs, outputs) -> list[Kernel]:
    """x Wᵀ + b with GELU in the epilogue: x, W and b read once, GELU(h) written, and h too
    unless `keep_h` is False."""
    a = _bind("shatter::linear_gelu", args, kwargs)
    (M, K), N, e = a["x"].shape, a["weight"].shape[0], a["x"].element_size()
    nbytes = (M * K + N * K + N + (1 + a.get("keep_h", True)) * M * N) * e
    return [Kernel("h = x Wᵀ + b, GELU(h)", "custom", 2.0 * M * N * K, float(nbytes))]


def linear_gelu_bwd_cost(args, kwargs, outputs) -> list[Kernel]:
    """dy W_out with GELU' and the column sums of dh and dy in the kernel (dy, W_out and h read,
    dh and a row of fp32 sums per row tile written), then the sums added up: both biases'
    gradients."""
    a = _bind("shatter::linear_gelu_bwd", args, kwargs)
    (M, K), N, e = a["g_out"].shape, a["weight_out"].shape[1], a["h"].element_size()
    sums = -(-M // FFN_ROW_TILE) * (N + K) * 4
    nbytes = (M * K + K * N + 2 * M * N) * e + sums
    return [
        Kernel("dh = (dy W) GELU'(h), column sums", "custom", 2.0 * M * N * K, float(nbytes)),
        Kernel("the biases' gradients: the sums added", "memory", 0.0, float(sums + (N + K) * e)),
    ]


def master_adamw_cost(args, kwargs, outputs) -> list[Kernel]:
    """The one-pass AdamW step (shatter/kernels/master_adamw.py): the gradients' addresses copied
    to the device, the step count counted up; the low-precision gradient, the fp32 master and
    moments read, those three and the low-precision weights written; with `found_inf`, the
    count counted down again."""
    a = _bind("shatter::master_adamw_", args, kwargs)
    n, low = a["master"].numel(), a["weight"].element_size()
    counted = a.get("step_counted", False)  # by norm_verdict, before
    table = Kernel("the gradients' addresses to the device", "memory", 0.0, 8.0 * len(a["grads"]))
    step = [table] + ([] if counted else [Kernel("step count + 1", "memory", 0.0, 0.0)])
    main = Kernel("AdamW: master, moments, weights", "memory", 0.0, float(n * (2 * low + 24)))
    undo = (
        [Kernel("step count - found_inf", "memory", 0.0, 0.0)]
        if a.get("found_inf") is not None and not counted
        else []
    )
    return [*step, main, *undo]


def norm_verdict_cost(args, kwargs, outputs) -> list[Kernel]:
    """The step's scalars (shatter/kernels/norm_verdict.py): one kernel of a few fp32 words."""
    a = _bind("shatter::norm_verdict", args, kwargs)
    words = 5 + 2 * len(a["steps"])  # squares, skipped read; norm, bad, factor, skipped written
    return [Kernel("norm, skip, clip factor, step counts", "memory", 0.0, 4.0 * words)]


def partial_sums_cost(args, kwargs, outputs) -> list[Kernel]:
    """A mix-order reduction's gradients finished (shatter/kernels/partial_sums.py): one kernel
    reading the fp32 partial rows, writing each gradient in its dtype."""
    a = _bind("shatter::partial_sums", args, kwargs)
    cols = a["parts"] * a["width"]
    return [Kernel("partial sums", "memory", 0.0, (4.0 * a["rows"] + a["dtype"].itemsize) * cols)]


OP_COSTS: dict[str, Callable[..., list[Kernel]]] = {
    "shatter::mixing_fwd": mixing_fwd_cost,
    "shatter::mixing_bwd": mixing_bwd_cost,
    "shatter::rows_fwd": rows_fwd_cost,
    "shatter::rows_bwd": rows_bwd_cost,
    "shatter::fused_fwd": fused_fwd_cost,
    "shatter::fused_bwd": fused_bwd_cost,
    "shatter::linear_gelu": linear_gelu_cost,
    "shatter::linear_gelu_bwd": linear_gelu_bwd_cost,
    "shatter::master_adamw_": master_adamw_cost,
    "shatter::norm_verdict": norm_verdict_cost,
    "shatter::partial_sums": partial_sums_cost,
}


# The one efficiency table of the step model (tools/bench/step_cost.py) and of `auto`'s choice
# between the Triton impls, every arch and GPU alike (docs/benchmarks.md states it). gemm, memory,
# efficient and launch_us were set once from the H100 measurement that `step_cost.py --calibrate`
# replays (the best of its PLAUSIBLE grid, `--fit`), then frozen; flash and custom are stated, not
# fitted (the replayed commit ran neither kernel).
EFFICIENCY = {
    "gemm": 0.70,  # cuBLAS bf16/fp16 GEMMs, fraction of the dense tensor peak
    "flash": 0.35,  # FlashAttention-2, forward and backward (its paper: 30-40% on an H100)
    "efficient": 0.25,  # the memory-efficient (cutlass) attention kernel
    "custom": 0.50,  # a Triton kernel's products (tl.dot), between cuBLAS and flash
    "memory": 0.60,  # fraction of HBM bandwidth for memory-bound kernels
    "launch_us": 6.0,  # per kernel launch: the gap it leaves between kernels
}
LAUNCH_S = EFFICIENCY["launch_us"] * 1e-6
# the datasheet peaks (dense bf16/fp16 tensor FLOP/s, HBM bytes/s) of the parts `auto` prices:
# sm_90 the H100 SXM, sm_80 the A100, sm_70 the V100 SXM2
PEAKS = {90: (989e12, 3.35e12), 80: (312e12, 2.039e12), 70: (125e12, 0.9e12)}
SMS = {90: 132, 80: 108, 70: 80}  # their streaming multiprocessors (the H200's: 132 too)
# Below sm_80 Triton's tl.dot runs on FMAs in fp32, not on tensor cores: a "custom" kernel's
# products run at the CUDA cores' fp32 FMA peak (datasheet: the V100 SXM2's 15.7 TFLOP/s)
FMA_PEAKS = {70: 15.7e12}
IMPL_OPS = {"triton": (mixing_fwd_cost, mixing_bwd_cost), "fused": (fused_fwd_cost, fused_bwd_cost)}


def kind_peak(kind: str, family: int, peak: float) -> float:
    """The FLOP/s a kernel of `kind` runs its products at, at `efficiency[kind]` of it: the
    tensor peak `peak`, except a Triton dot ("custom") below sm_80, which is FMAs."""
    return FMA_PEAKS.get(family, peak) if kind == "custom" else peak


class _Spec(NamedTuple):
    """A tensor's shape, element size and last stride: all the cost formulas read of it."""

    shape: tuple[int, ...]
    element: int
    last_stride: int = 1

    def element_size(self) -> int:
        return self.element

    def numel(self) -> int:
        return math.prod(self.shape)

    def stride(self, dim: int) -> int:
        assert dim == -1, dim
        return self.last_stride


def layer_kernels(impl: str, shape: tuple[int, int, int, int], element: int, family: int = 90) -> list[Kernel]:  # fmt: skip
    """The kernels of one layer's forward and backward under `impl` ("triton", "fused", "rows"
    or "rows-keep") for `element`-byte inputs of `shape` = (B, l, d, n) with the partition bias
    and sigmoid scores (Shatter's): plain arithmetic on the shapes (no tensor is made, so `auto`
    can call it inside a compiled forward)."""
    from shatter.attention.projection import projection_width

    B, L, d, n = shape
    if impl in ("rows", "rows-keep"):
        return rows_kernels(B, L, d, n, element, keep=impl == "rows-keep")
    a = dict(
        P=_Spec((B, L, projection_width(d, n)), element), X=_Spec((B, L, d), element),
        mask=_Spec((B, L), 1), table=_Spec((n, 1), 4), sigmoid=True,
        g_out=_Spec((B, n, L, d // n), element),  # dX̄ row-major, as autograd hands it
    )  # fmt: skip
    forward, backward = IMPL_OPS[impl]
    return forward((), a, None, family) + backward((), a, None, family)


def modelled_seconds(impl: str, shape, element: int, family: int = 90) -> float:
    """One layer's forward and backward under `impl` on the family's GPU, as the step model
    prices it: each kernel the slower of its FLOPs at its kind's rate (`kind_peak`) and its
    bytes at the memory rate, plus its launch."""
    peak, bandwidth = PEAKS[family]
    total = 0.0
    for k in layer_kernels(impl, shape, element, family):
        memory = k.bytes / (EFFICIENCY["memory"] * bandwidth)
        rate = EFFICIENCY[k.kind] * kind_peak(k.kind, family, peak) if k.kind != "memory" else 0
        compute = k.flops / rate if rate else 0.0
        total += max(compute, memory) + LAUNCH_S
    return total


def model_flops(name: str, args, kwargs) -> float:
    """The op's FLOPs in train/cost.py's convention (dense over the n parts: Q Xᵀ and A V, each
    l·d multiply-adds per token; the backward two products per forward one), for comparing a
    trace's total with the model count."""
    if name.startswith("shatter::rows_") or name in (
        "shatter::master_adamw_",
        "shatter::norm_verdict",
        "shatter::partial_sums",
    ):
        return 0.0  # no product inside (the row kernels: the GEMMs around them carry the FLOPs)
    if name.startswith("shatter::linear_gelu"):  # one GEMM, as train/cost.py counts it
        return op_totals(OP_COSTS[name](args, kwargs, None))[0]
    a = _bind(name, args, kwargs)
    B, L, _, d, _, _ = _dims(a)
    forward = 2 * 2.0 * B * L * L * d
    return forward if name.endswith("_fwd") else 2 * forward


def register_costs(names: Iterable[str]) -> None:
    """Register each op's FLOP formula with torch.utils.flop_counter (FlopCounterMode)."""
    import torch
    from torch.utils.flop_counter import register_flop_formula

    for name in names:
        namespace, op = name.split("::")
        cost = OP_COSTS[name]

        def flops(*args, out_val=None, _cost=cost, **kwargs):
            return int(op_totals(_cost(args, kwargs, out_val))[0])

        register_flop_formula(getattr(getattr(torch.ops, namespace), op), get_raw=True)(flops)
