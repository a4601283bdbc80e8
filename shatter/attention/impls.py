"""The registry of attention implementations for the single-head partition archs.

Every impl has one signature and gives the same values and gradients (up to rounding):

    fn(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid) -> (x_bar_BnLk, a_part_BLn)

Q = X W^Q, the keys are X itself (§3.2), V = X W^V split into n parts, c = Q R^T (None without
the partition bias), `table` the layer's (n, 2m - 1) partition table, `sigmoid` eq. 5's
L2-normalised sigmoid (False: softmax). The impls take Q and X: no caller ever materialises the
l x l score matrix.

    triton   fused kernel (shatter/attention/triton_kernel.py), sm_80+ GPUs, sigmoid archs only
    chunked  row blocks through cuBLAS matmuls, recomputing backward (shatter/attention/chunked.py)
    lean     saves the l x l pre-activation Z0 and recomputes the rest (shatter/attention/lean.py)
    naive    the reference: autograd through A ⊙ N as [B, n, l, l]

`auto` decides per call from the input's device, without a host sync: `triton` on CUDA devices of
compute capability >= 8.0 when triton imports and the arch is sigmoid, `chunked` on other CUDA
devices (V100: Triton has no tensor-core code below sm_80), `lean` on the CPU.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import cache, lru_cache

import torch

from shatter.attention.chunked import partition_attention_chunked
from shatter.attention.lean import partition_mix_lean, partition_mix_naive

Impl = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _scores(Q: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return (Q / math.sqrt(Q.shape[-1])) @ X.transpose(-1, -2)  # Z0 = Q X^T / sqrt(d), eq. 5


def lean(Q, X, V, c, mask_BL, table, sigmoid: bool):
    return partition_mix_lean(_scores(Q, X), c, V, mask_BL, table, sigmoid)


def naive(Q, X, V, c, mask_BL, table, sigmoid: bool):
    return partition_mix_naive(_scores(Q, X), c, V, mask_BL, table, sigmoid)


def triton(Q, X, V, c, mask_BL, table, sigmoid: bool):
    """The fused Triton kernel, imported on first use only (CPU installs need no triton)."""
    return _triton_kernel()(Q, X, V, c, mask_BL, table, sigmoid)


@lru_cache(maxsize=1)
def _triton_kernel() -> Impl:
    try:
        from shatter.attention.triton_kernel import partition_attention_triton
    except ImportError as e:
        raise RuntimeError(
            f"attention_impl: triton is unavailable ({e}); shatter/attention/triton_kernel.py "
            "needs triton and a CUDA GPU of compute capability >= 8.0; fix: set "
            "attention_impl to auto, chunked or lean in the model config"
        ) from None
    return partition_attention_triton


IMPLS: dict[str, Impl] = {
    "triton": triton,
    "chunked": partition_attention_chunked,
    "lean": lean,
    "naive": naive,
}


@cache
def _triton_available() -> bool:
    find = importlib.util.find_spec
    return find("triton") is not None and find("shatter.attention.triton_kernel") is not None


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a driver query, cached: no sync per call


def auto_impl(device: torch.device, sigmoid: bool) -> str:
    """`auto`'s choice for an input on `device` (see the module docstring)."""
    if device.type != "cuda":
        return "lean"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if sigmoid and _capability(index) >= (8, 0) and _triton_available():
        return "triton"
    return "chunked"


def resolve(name: str, device: torch.device, sigmoid: bool) -> Impl:
    """The impl function for config.attention_impl `name` on inputs living on `device`."""
    return IMPLS[auto_impl(device, sigmoid) if name == "auto" else name]
