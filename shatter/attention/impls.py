"""The registry of attention implementations for the single-head partition archs.

Every impl has one signature and gives the same values and gradients (up to rounding):

    fn(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid) -> (x_bar_BnLk, a_part_BLn)

Q = X W^Q, the keys are X itself (§3.2), V = X W^V split into n parts, c = Q R^T (None without
the partition bias), `table` the layer's (n, 2m - 1) partition table, `sigmoid` eq. 5's
L2-normalised sigmoid (False: softmax). The impls take Q and X: no caller ever materialises the
l x l score matrix.

    triton   hybrid: cuBLAS GEMMs for Q X^T, dQ, dX around Triton mixing kernels
             (shatter/attention/triton_kernel.py), sm_80+ GPUs; refused below sm_80
    rows     every product a cuBLAS GEMM (Q X^T, the n parts' W_h V[h], dV, dW_h, dQ, dX)
             around two Triton row kernels without dots (shatter/attention/rows.py): for GPUs
             below sm_80 in fp16; W = A ⊙ N recomputed in the backward
    rows-keep  rows with W kept from the forward: faster, n l² more saved elements a layer
    chunked  row blocks through cuBLAS matmuls, recomputing backward (shatter/attention/chunked.py)
    lean     saves the l x l pre-activation Z0 and recomputes the rest (shatter/attention/lean.py)
    naive    the reference: autograd through A ⊙ N as [B, n, l, l]

`auto` decides per call from the input's device and dtype, without a host sync: `triton` on CUDA
devices of compute capability >= 8.0 for bf16/fp16 when triton imports; `rows` below sm_80 (V100,
T4: Triton has no tensor-core code there, cuBLAS has) for fp16 when triton imports (about 40
launches a layer where `chunked` has about 290, and no fp32 copies of l x l tensors:
docs/model.md); `chunked` on CUDA otherwise (fp32: the kernels' IEEE fp32 dots are slow; no
triton); `lean` on the CPU.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import cache, lru_cache

import torch

from shatter.attention.chunked import partition_attention_chunked
from shatter.attention.lean import partition_mix_lean, partition_mix_naive
from shatter.attention.projection import context, projection_views

Impl = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _scores(Q: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    return (Q / math.sqrt(Q.shape[-1])) @ X.transpose(-1, -2)  # Z0 = Q X^T / sqrt(d), eq. 5


def lean(Q, X, V, c, mask_BL, table, sigmoid: bool):
    return partition_mix_lean(_scores(Q, X), c, V, mask_BL, table, sigmoid)


def naive(Q, X, V, c, mask_BL, table, sigmoid: bool):
    return partition_mix_naive(_scores(Q, X), c, V, mask_BL, table, sigmoid)


def triton(Q, X, V, c, mask_BL, table, sigmoid: bool):
    """The hybrid Triton impl, imported on first use only (CPU installs need no triton)."""
    require_triton_capability(Q.device)
    return _triton_kernel()(Q, X, V, c, mask_BL, table, sigmoid)


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


def rows(Q, X, V, c, mask_BL, table, sigmoid: bool):
    """The `rows` impl (W recomputed in the backward), imported on first use only."""
    return _rows_module().partition_attention_rows(Q, X, V, c, mask_BL, table, sigmoid)


def rows_keep(Q, X, V, c, mask_BL, table, sigmoid: bool):
    """The `rows` impl keeping W = A ⊙ N from the forward for the backward."""
    return _rows_module().partition_attention_rows(Q, X, V, c, mask_BL, table, sigmoid, keep=True)


@lru_cache(maxsize=1)
def _rows_module():
    try:
        from shatter.attention import rows as module
    except ImportError as e:
        raise RuntimeError(
            f"attention_impl: rows is unavailable ({e}); shatter/attention/rows.py needs triton; "
            "fix: set attention_impl to auto or chunked in the model config"
        ) from None
    return module


Layer = Callable[..., torch.Tensor]


def _through(impl: Impl) -> Layer:
    """A layer-level form of an impl: (P, X, mask, table, v_part, sigmoid) -> context."""

    def layer(P, X, mask_BL, table, v_part, sigmoid: bool):
        Q, V, c = projection_views(P, X.shape[-1], table.shape[0])
        x_bar, a_part = impl(Q, X, V, c, mask_BL, table, sigmoid)
        return context(x_bar, a_part, v_part)

    return layer


def _triton_layer(P, X, mask_BL, table, v_part, sigmoid: bool):
    """The Triton impl on the layer's P itself: dP comes back whole (no copy of its columns)."""
    require_triton_capability(P.device)
    from shatter.attention.triton_kernel import partition_attention_layer

    return partition_attention_layer(P, X, mask_BL, table, v_part, sigmoid)


def _rows_layer(P, X, mask_BL, table, v_part, sigmoid: bool):
    """The rows impl on the layer's P itself: dV, dQ and dc written into dP's columns."""
    return _rows_module().rows_layer(P, X, mask_BL, table, v_part, sigmoid)


def _rows_keep_layer(P, X, mask_BL, table, v_part, sigmoid: bool):
    return _rows_module().rows_layer(P, X, mask_BL, table, v_part, sigmoid, keep=True)


IMPLS: dict[str, Impl] = {
    "triton": triton,
    "rows": rows,
    "rows-keep": rows_keep,
    "chunked": partition_attention_chunked,
    "lean": lean,
    "naive": naive,
}
LAYERS: dict[str, Layer] = {  # impls with a layer-level form of their own (dP back whole)
    "triton": _triton_layer,
    "rows": _rows_layer,
    "rows-keep": _rows_keep_layer,
}


@cache
def _triton_available() -> bool:
    find = importlib.util.find_spec
    return find("triton") is not None and find("shatter.attention.triton_kernel") is not None


@cache
def _rows_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    if dtype == torch.float16 and _rows_available():
        return "rows"
    return "chunked"


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> Impl:
    """The impl function for config.attention_impl `name` on `dtype` inputs on `device`."""
    return IMPLS[auto_impl(device, dtype) if name == "auto" else name]


def resolve_layer(name: str, device: torch.device, dtype: torch.dtype) -> Layer:
    """The layer-level function (P, X, mask, table, v_part, sigmoid) -> context for
    config.attention_impl `name` (single_head.py)."""
    chosen = auto_impl(device, dtype) if name == "auto" else name
    return LAYERS[chosen] if chosen in LAYERS else _through(IMPLS[chosen])
