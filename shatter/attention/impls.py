"""The registry of attention implementations for the single-head partition archs.

Every impl has one signature and gives the same values and gradients (up to rounding):

    fn(Q_BLD, X_BLD, V_BnLk, c_BLn_or_None, mask_BL, table, sigmoid, out=None)
        -> (x_bar_BnLk, a_part_BLn)

Q = X W^Q, the keys are X itself (§3.2), V = X W^V split into n parts, c = Q R^T (None without
the partition bias), `table` the layer's (n, 2m - 1) partition table, `sigmoid` eq. 5's
L2-normalised sigmoid (False: softmax). The impls take Q and X: no caller ever materialises the
l x l score matrix. `out`, an empty [B, L, context_width] context (projection.new_context): when given,
X̄ goes into its first d columns and A_part into its last n, the results are views of it, and
`out` carries their gradients (the layer hands it to the block's folded W^O, layer_weights.py).

    triton   hybrid: cuBLAS GEMMs for Q X^T, dQ, dX around Triton mixing kernels
             (shatter/attention/triton_kernel.py), sm_70+ GPUs (below sm_80 the mixing dots
             run on FMAs); refused below sm_70
    rows     every product a cuBLAS GEMM (Q X^T, the n parts' W_h V[h], dV, dW_h, dQ, dX)
             around two Triton row kernels without dots (shatter/attention/rows.py): for GPUs
             below sm_80 in fp16; W = A ⊙ N recomputed in the backward
    rows-keep  rows with W kept from the forward: faster, n l² more saved elements a layer
    fused    the same Triton kernels recomputing Q X^T on chip: Z never reaches HBM, only
             dS does, for the dQ and dX GEMMs (shatter/kernels/fused_attention.py); sm_80+
    chunked  row blocks through cuBLAS matmuls, recomputing backward (shatter/attention/chunked.py)
    lean     saves the l x l pre-activation Z0 and recomputes the rest (shatter/attention/lean.py)
    naive    the reference: autograd through A ⊙ N as [B, n, l, l]

`auto` decides per call from the input's device, dtype and shape, without a host sync: on CUDA
devices of compute capability >= 8.0 for bf16/fp16 when triton imports, `triton` or `fused`,
whichever the step model's roofline prices faster for the call's (B, l, d, n) on that GPU family
(`kernel_choice`: recomputing Q X^T costs 2d FLOPs a score where reading the saved Z costs 2
bytes, so `fused` wins at small d and `triton` at the paper's d = 768 and 1024); below sm_80
(V100, T4: Triton has no tensor-core code there, cuBLAS has) for fp16 when triton imports, `rows`
(every product on cuBLAS, W through HBM) or `triton` (the part products as FMA dots on chip),
whichever the same roofline prices faster with the dots at the FMA peak (`triton` at the
paper's shapes; `rows` without a shape); `chunked` on CUDA otherwise (fp32: the kernels' IEEE
fp32 dots are slow; no triton); `lean` on the CPU. A training run resolves `auto` further before
its first step, for its batch: `rows-keep` below sm_80 where `keeps_rows` prices it faster and
its kept W fits a tenth of the GPU's memory (the paper's 8 V100s at l = 1024;
single_head.keep_rows_where_they_fit).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from functools import cache, lru_cache

import torch

from shatter.accelerator import (
    capability as _capability,
    device_index,
    triton_importable as _rows_available,
)
from shatter.attention.chunked import partition_attention_chunked
from shatter.attention.lean import partition_mix_lean, partition_mix_naive
from shatter.attention.projection import new_context, projection_views, write_context
from shatter.eager import constant_under_compile

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


def fused(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    """The fused Triton impl (Z recomputed on chip), imported on first use only."""
    require_triton_capability(Q.device, "fused")
    _triton_kernel()  # the hybrid's module first: one line naming the fix without triton
    from shatter.kernels.fused_attention import partition_attention_fused

    x_bar, a_part = partition_attention_fused(Q, X, V, c, mask_BL, table, sigmoid)
    return (x_bar, a_part) if out is None else write_context(out, x_bar, a_part)


def require_triton_capability(device: torch.device, impl: str = "triton") -> None:
    """Refuse `fused` forced on a GPU below sm_80 (its Q Xᵀ recomputed on chip would run on
    FMAs: Triton emits no tensor-core code there) and `triton` below sm_70."""
    if device.type != "cuda":
        return
    major, minor = _capability(device_index(device))
    least = (7, 0) if impl == "triton" else (8, 0)
    if (major, minor) < least:
        raise ValueError(
            f"attention_impl: {impl} needs a GPU of compute capability >= {least[0]}.0, this one "
            f"is sm_{major}{minor}; fix: set attention_impl to auto or chunked in the model config"
        )


def _triton_kernel() -> Impl:
    """The hybrid's entry point (imported once: Python keeps the module; no functools cache,
    which torch.compile's tracing warns of and steps around), or one line naming the fix."""
    try:
        from shatter.attention.triton_kernel import partition_attention_triton
    except ImportError as e:
        raise RuntimeError(
            f"attention_impl: triton is unavailable ({e}); shatter/attention/triton_kernel.py "
            "needs triton and a CUDA GPU of compute capability >= 8.0; fix: set "
            "attention_impl to auto, chunked or lean in the model config"
        ) from None
    return partition_attention_triton


def rows(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    """The `rows` impl (W recomputed in the backward), imported on first use only."""
    x_bar, a_part = _rows_module().partition_attention_rows(Q, X, V, c, mask_BL, table, sigmoid)
    return (x_bar, a_part) if out is None else write_context(out, x_bar, a_part)


def rows_keep(Q, X, V, c, mask_BL, table, sigmoid: bool, out=None):
    """The `rows` impl keeping W = A ⊙ N from the forward for the backward."""
    rows_ = _rows_module().partition_attention_rows
    x_bar, a_part = rows_(Q, X, V, c, mask_BL, table, sigmoid, keep=True)
    return (x_bar, a_part) if out is None else write_context(out, x_bar, a_part)


def _rows_module():
    """The rows impl's module, or one line naming the fix (as `_triton_kernel`)."""
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


def _rows_layer(P, X, mask_BL, table, sigmoid: bool):
    """The rows impl on the layer's P itself: dV, dQ and dc written into dP's columns."""
    return _rows_module().rows_layer(P, X, mask_BL, table, sigmoid)


def _rows_keep_layer(P, X, mask_BL, table, sigmoid: bool):
    return _rows_module().rows_layer(P, X, mask_BL, table, sigmoid, keep=True)


def _fused_layer(P, X, mask_BL, table, sigmoid: bool):
    """The fused impl on the layer's P itself, as `_triton_layer`."""
    require_triton_capability(P.device, "fused")
    _triton_kernel()
    from shatter.kernels.fused_attention import fused_attention_layer

    return fused_attention_layer(P, X, mask_BL, table, sigmoid)


IMPLS: dict[str, Impl] = {
    "triton": triton,
    "rows": rows,
    "rows-keep": rows_keep,
    "fused": fused,
    "chunked": partition_attention_chunked,
    "lean": lean,
    "naive": naive,
}
LAYERS: dict[str, Layer] = {  # impls with a layer-level form of their own (dP back whole)
    "triton": _triton_layer,
    "rows": _rows_layer,
    "rows-keep": _rows_keep_layer,
    "fused": _fused_layer,
}


@cache
def _triton_available() -> bool:
    find = importlib.util.find_spec
    return _rows_available() and find("shatter.attention.triton_kernel") is not None


KERNEL_CHOICES = {90: ("triton", "fused"), 80: ("triton", "fused"), 70: ("rows", "triton")}


@lru_cache(maxsize=256)
def kernel_choice(capability: tuple[int, int], shape: tuple, dtype: torch.dtype) -> str:
    """Of the family's KERNEL_CHOICES, the one shatter/kernels/cost.py prices fastest (the step
    model's per-kernel roofline, the first on a tie) for one layer's forward and backward of
    `shape` = (B, l, d, n) in `dtype` on a GPU of `capability` (sm_90: the H100's peaks,
    sm_80: the A100's; below sm_80 the V100's, the `triton` impl's dots on FMAs)."""
    from shatter.kernels.cost import family_of, modelled_seconds

    family = family_of(capability)
    return min(
        KERNEL_CHOICES[family],
        key=lambda impl: modelled_seconds(impl, shape, dtype.itemsize, family),
    )


# The share of a GPU's memory `keeps_rows` lets rows-keep's kept W take
KEEP_SHARE = 0.1


def kept_rows_bytes(shape: tuple, dtype: torch.dtype, layers: int) -> int:
    """The W = A ⊙ N that `rows-keep` keeps for the backward over `layers` layers of `shape` =
    (B, l, d, n) in `dtype`: n l² elements a sequence a layer."""
    B, L, _, n = shape
    return layers * n * B * L * L * dtype.itemsize


def keeps_rows(
    capability: tuple[int, int], shape: tuple, dtype: torch.dtype, layers: int, memory: float
) -> bool:
    """Whether a training run should resolve `auto` to `rows-keep` for `layers` partition layers
    of `shape` = (B, l, d, n) on a GPU of `capability` with `memory` bytes: where `rows` is one of
    the family's choices (below sm_80, fp16, triton importable), the roofline prices `rows-keep`
    faster than `kernel_choice`'s pick, and the W it keeps (n l² elements a sequence a layer)
    takes at most KEEP_SHARE of the memory. The paper's 8 V100s (16 GB, 4 x 1024 tokens each):
    1.2 GB, yes."""
    from shatter.kernels.cost import family_of, modelled_seconds

    family = family_of(capability)
    if "rows" not in KERNEL_CHOICES[family] or dtype != torch.float16 or not _rows_available():
        return False
    if kept_rows_bytes(shape, dtype, layers) > KEEP_SHARE * memory:
        return False
    chosen = kernel_choice(capability, tuple(shape), dtype)
    keep, pick = (
        modelled_seconds(impl, tuple(shape), dtype.itemsize, family)
        for impl in ("rows-keep", chosen)
    )
    return keep < pick


def auto_impl(device: torch.device, dtype: torch.dtype, shape: tuple | None = None) -> str:
    """`auto`'s choice for `dtype` inputs on `device` (see the module docstring); `shape` =
    (B, l, d, n) of the call, when known, chooses between the two Triton impls."""
    if device.type != "cuda":
        return "lean"
    index = device_index(device)
    low = dtype in (torch.bfloat16, torch.float16)
    if low and _capability(index) >= (8, 0) and _triton_available():
        if shape is None:
            return "triton"
        return kernel_choice(_capability(index), tuple(shape), dtype)
    if dtype == torch.float16 and _rows_available():
        if shape is None or not _triton_available():
            return "rows"
        return kernel_choice(_capability(index), tuple(shape), dtype)
    return "chunked"


@constant_under_compile
def _auto(device: torch.device, dtype: torch.dtype, shape: tuple | None) -> str:
    """`auto_impl`'s choice, which torch.compile takes as a constant: it runs as Python when a
    forward is traced (its caches and the cost model are not traced, nor warned of)."""
    return auto_impl(device, dtype, shape)


def resolve(name: str, device: torch.device, dtype: torch.dtype, shape=None) -> Impl:
    """The impl function for config.attention_impl `name` on `dtype` inputs on `device`."""
    return IMPLS[_auto(device, dtype, shape and tuple(shape)) if name == "auto" else name]


def resolve_layer(name: str, device: torch.device, dtype: torch.dtype, shape=None) -> Layer:
    """The layer-level function (P, X, mask, table, sigmoid) -> context [X̄ | A_part]
    ([B, L, context_width]) for config.attention_impl `name` (single_head.py); `shape` = (B, l, d, n)
    for `auto`."""
    chosen = _auto(device, dtype, shape and tuple(shape)) if name == "auto" else name
    return LAYERS.get(chosen) or _through(IMPLS[chosen])
