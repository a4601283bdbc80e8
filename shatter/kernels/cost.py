"""FLOPs and HBM bytes of the `shatter::` custom ops: the one registry a step-cost model reads.

`OP_COSTS[name](args, kwargs, outputs) -> (flops, bytes)` for each op's qualified name, from the
shapes, dtypes and strides of its arguments and outputs alone (real, fake or meta tensors):

- flops: what the op executes in matrix products, 2 per multiply-add: its cuBLAS GEMMs and the
  kernels' `tl.dot`s. A part f_h(j − i) is zero on one side of the diagonal, so the mixing dots
  of a key tile cover only the n/2 parts of its side: about half of the dense A V that model
  FLOPs count (train/cost.py, l·d per token). `model_flops` gives that convention.
  Elementwise work (sigmoid, exp, the table gathers) is not counted, as in train/cost.py.
- bytes: reads and writes of global memory, each tensor counted once per kernel that streams it,
  and once per program group that re-reads it (Z in the mixing forward and dV kernels, one read
  per group of parts, as on sm_90: `_z_reads`), the copies the op makes included; tensors
  of B·L·n elements and smaller (c, A_part, the mask, the row statistics) are left out.

`register_costs(names)` hands the FLOP half to torch.utils.flop_counter, so `FlopCounterMode`
counts the ops; shatter/attention/triton_kernel.py calls it where it defines them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def mixing_fwd_cost(args, kwargs, outputs) -> tuple[float, float]:
    a = _bind("shatter::mixing_fwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x = B * L * Lp * e, B * L * d * e  # one Z, one [B, L, d]
    flops = 2.0 * B * L * Lp * d + mixing_dot_flops(B, L, d)
    copies = 2 * x if L % 16 else 0  # the keys padded to Lp
    gemm = 2 * x + z  # Z = Q Xᵀ/√d
    stats = z
    fwd = _z_reads(n, d, "fwd") * z + x + x  # Z per group, V, X̄
    return flops, float(copies + gemm + stats + fwd)


def mixing_bwd_cost(args, kwargs, outputs) -> tuple[float, float]:
    a = _bind("shatter::mixing_bwd", args, kwargs)
    B, L, Lp, d, n, e = _dims(a)
    z, x = B * L * Lp * e, B * L * d * e
    flops = 2 * mixing_dot_flops(B, L, d) + 2 * 2.0 * B * L * Lp * d  # dV, dA; dQ, dX
    copies = 0 if a["g_out"].stride(-1) == 1 else 2 * x
    dv = _z_reads(n, d, "dv") * z + x + x  # Z per group, dX̄, dV
    delta = 2 * x  # X̄ and dX̄
    dz = z + x + x + z  # Z, V, dX̄ in, dZ out
    gemms = 2 * (z + x + x)  # dQ = dZ X, dX = dZᵀ Q
    return flops, float(copies + dv + delta + dz + gemms)


OP_COSTS: dict[str, Callable[..., tuple[float, float]]] = {
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
            return int(_cost(args, kwargs, out_val)[0])

        register_flop_formula(getattr(getattr(torch.ops, namespace), op), get_raw=True)(flops)
