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

The `triton` impl's two ops (shatter/attention/triton_kernel.py): Z = Q Xᵀ/√d, dQ = dZ X and
dX = dZᵀ Q are cuBLAS GEMMs; the row statistics and δ are memory-bound Triton kernels; the mixing
forward, dV and dZ kernels run the mixing dots. A part f_h(j − i) is zero on one side of the
diagonal, so the mixing dots of a key tile cover only the n/2 parts of its side: about half of the
dense A V that model FLOPs count (train/cost.py, l·d per token); `model_flops` gives that
convention. Z is read once per group of parts by the forward and dV kernels (`_z_reads`, the
GROUP of sm_90's configurations); tensors of B·L·n elements and smaller (c, A_part, the mask, the
row statistics) move too few bytes to count, but their kernels count their launches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

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
}  # fmt: skip


def _bind(name: str, args, kwargs) -> dict:
    return {**dict(zip(OP_SCHEMA[name], args)), **kwargs}


def _dims(a: dict) -> tuple[int, int, int, int, int, int]:
    """(B, L, Lp, d, n, element bytes): Lp is Z's row length (L rounded up to 16)."""
    B, L, d = a["X"].shape
    return B, L, -(-L // 16) * 16, d, a["table"].shape[0], a["X"].element_size()


def _z_reads(n: int, d: int, kernel: str) -> int:
    """Reads of Z by the mixing forward or dV kernel: each side's keys once per group of parts,
    the two sides together once per group, with the GROUP of the kernel's sm_90 configurations
    for n (partition_mixing.usable)."""
    from shatter.kernels import partition_mixing as pm

    configs = {"fwd": pm.FWD_CONFIGS, "dv": pm.DV_CONFIGS}[kernel]
    block_k = max(16, 1 << (d // n - 1).bit_length())
    return n // 2 // pm.usable(configs, n, block_k, family=90)[0].kwargs["GROUP"]


def mixing_dot_flops(B: int, L: int, d: int) -> float:
    """The mixing dots of one sweep (forward X̄, dV, or dA of the dZ pass): every pair (i, j)
    of a side, j >= i or j <= i, against the side's n/2 parts of d/n: d/2 multiply-adds."""
    return 1.0 * B * L * (L + 1) * d


def _mask_cast(a: dict) -> Kernel:
    """mask.to(float32): B·L elements, each op casts it once."""
    m = a["mask"]
    return Kernel("mask to fp32", "memory", 0.0, float(m.numel() * (m.element_size() + 4)))


def mixing_fwd_cost(args, kwargs, outputs) -> list[Kernel]:
    a = _bind("shatter::mixing_fwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x, xp = B * L * Lp * e, B * L * d * e, B * Lp * d * e  # Z, a [B, L, d], the padded keys
    kernels = [Kernel("pad the keys to Lp", "memory", 0.0, float(x + xp))] if L % 16 else []
    return kernels + [
        Kernel("Z = Q Xᵀ/√d", "gemm", 2.0 * B * L * Lp * d, float(x + xp + z)),
        _mask_cast(a),
        Kernel("row statistics", "memory", 0.0, float(z)),
        Kernel(  # Z per group of parts, V, X̄ written
            "mixing forward", "custom", mixing_dot_flops(B, L, d),
            float(_z_reads(n, d, "fwd") * z + 2 * x),
        ),
    ]  # fmt: skip


def mixing_bwd_cost(args, kwargs, outputs) -> list[Kernel]:
    a = _bind("shatter::mixing_bwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x, s = B * L * Lp * e, B * L * d * e, B * L * L * e  # Z, a [B, L, d], dS = dZ[:, :, :L]
    P = a["P"]
    kernels = []
    if a["g_out"].stride(-1) != 1:  # dX̄ made contiguous in its last dimension
        kernels.append(Kernel("dX̄ contiguous", "memory", 0.0, float(2 * x)))
    if P.shape[-1] > 2 * d + n:  # c's alignment columns of dP zeroed (n of them, or none: 2d)
        kernels.append(Kernel("dP's alignment columns", "memory", 0.0, 0.0))
    sweep = mixing_dot_flops(B, L, d)
    return kernels + [
        _mask_cast(a),
        Kernel("dV", "custom", sweep, float(_z_reads(n, d, "dv") * z + 2 * x)),  # Z/group, dX̄, dV
        Kernel("δ", "memory", 0.0, float(2 * x)),  # X̄ and dX̄
        Kernel("dZ", "custom", sweep, float(2 * z + 2 * x)),  # Z, V, dX̄ in, dZ out
        Kernel("dQ = dZ X", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
        Kernel("dX = dZᵀ Q", "gemm", 2.0 * B * L * L * d, float(s + 2 * x)),
    ]


OP_COSTS: dict[str, Callable[..., list[Kernel]]] = {
    "shatter::mixing_fwd": mixing_fwd_cost,
    "shatter::mixing_bwd": mixing_bwd_cost,
}


def model_flops(name: str, args, kwargs) -> float:
    """The op's FLOPs in train/cost.py's convention (dense over the n parts: Q Xᵀ and A V, each
    l·d multiply-adds per token; the backward two products per forward one), for comparing a
    trace's total with the model count."""
    a = _bind(name, args, kwargs)
    B, L, _, d, _, _ = _dims(a)
    forward = 2 * 2.0 * B * L * L * d
    return forward if name == "shatter::mixing_fwd" else 2 * forward


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
