"""The registry of attention implementations for the single-head partition archs.

Every impl has one signature and gives the same values and gradients (up to rounding):

    fn(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid, out=None)
        -> (x_bar_BnLk, a_part_BLn)

Q = X W^Q, the keys are X itself (§3.2), V = X W^V split into n parts, c = Q R^T (None without
the partition bias), `table` the layer's (n, 2m - 1) partition table, `sigmoid` eq. 5's
L2-normalised sigmoid (False: softmax). The impls take Q and X: no caller ever materialises the
l x l score matrix. `out`, an empty [B, L, d + n] context (projection.new_context): when given,
X̄ goes into its first d columns and A_part into its last n, the results are views of it, and
`out` carries their gradients (the layer hands it to the block's folded W^O, layer_weights.py).

    triton   hybrid: cuBLAS GEMMs for Q X^T, dQ, dX around Triton mixing kernels
             (shatter/attention/triton_kernel.py), sm_80+ GPUs; refused below sm_80
    chunked  row blocks through cuBLAS matmuls, recomputing backward (shatter/attention/chunked.py)
    lean     saves the l x l pre-activation Z0 and recomputes the rest (shatter/attention/lean.py)
    naive    the reference: autograd through A ⊙ N as [B, n, l, l]

`auto` decides per call from the input's device and dtype, without a host sync: `triton` on CUDA
devices of compute capability >= 8.0 for bf16/fp16 when triton imports; `chunked` on CUDA for fp32
(the kernels' IEEE fp32 dots are slow) and below sm_80 (V100, T4: Triton has no tensor-core code
there); `lean` on the CPU.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import cache, lru_cache

import torch

from shatter.attention.chunked import partition_attention_chunked
from shatter.attention.lean import partition_mix_lean, partition_mix_naive
from shatter.attention.projection import new_context, projection_views, write_context

Impl = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _scores(Q: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return (Q / math.sqrt(Q.shape[-1])) @ X.transpose(-1, -2)  # Z0 = Q X^T / sqrt(d), eq. 5


def lean(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    return partition_mix_lean(_scores(Q, X), c, V, mask_BL, table, sigmoid, out)


def naive(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    x_bar, a_part = partition_mix_naive(_scores(Q, X), c, V, mask_BL, table, sigmoid)
    return (x_bar, a_part) if out is None else write_context(out, x_bar, a_part)


def triton(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    """The hybrid Triton impl, imported on first use only (CPU installs need no triton)."""
    require_triton_capability(Q.device)
    return _triton_kernel()(Q, X, V, c, mask_BL, table, sigmoid, out)


def require_triton_capability(device: torch.device) -> None:
    """Refuse `triton` forced on a GPU below sm_80 (Triton emits no tensor-core code there)."""
    if device.type != "cuda":
        return
    major, minor = _capability(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    if (major, minor) < (8, 0):
        raise ValueError(
            f"attention_impl: triton needs a GPU of compute capability >= 8.0, this one is "
            f"sm_{major}{minor}; fix: set attention_impl to auto or chunked in the model config"
        )


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


Layer = Callable[..., torch.Tensor]


def _through(impl: Impl) -> Layer:
    """A layer-level form of an impl: (P, X, mask, table, sigmoid) -> the context [X̄ | A_part]."""

    def layer(P, X, mask_BL, table, sigmoid: bool):
        n = table.shape[0]
        Q, V, c = projection_views(P, X.shape[-1], n)
        out = new_context(X, n)
        impl(Q, X, V, c, mask_BL, table, sigmoid, out)
        return out

    return layer


def _triton_layer(P, X, mask_BL, table, sigmoid: bool):
    """The Triton impl on the layer's P itself: dP comes back whole (no copy of its columns)."""
    require_triton_capability(P.device)
    from shatter.attention.triton_kernel import partition_attention_layer

    return partition_attention_layer(P, X, mask_BL, table, sigmoid)


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


def auto_impl(device: torch.device, dtype: torch.dtype) -> str:
    """`auto`'s choice for `dtype` inputs on `device` (see the module docstring)."""
    if device.type != "cuda":
        return "lean"
    index = device.index if device.index is not None else torch.cuda.current_device()
    low = dtype in (torch.bfloat16, torch.float16)
    if low and _capability(index) >= (8, 0) and _triton_available():
        return "triton"
    return "chunked"


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> Impl:
    """The impl function for config.attention_impl `name` on `dtype` inputs on `device`."""
    return IMPLS[auto_impl(device, dtype) if name == "auto" else name]


def resolve_layer(name: str, device: torch.device, dtype: torch.dtype) -> Layer:
    """The layer-level function (P, X, mask, table, sigmoid) -> context [X̄ | A_part]
    ([B, L, d + n]) for config.attention_impl `name` (single_head.py)."""
    chosen = auto_impl(device, dtype) if name == "auto" else name
    return _triton_layer if chosen == "triton" else _through(IMPLS[chosen])
