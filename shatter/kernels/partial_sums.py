"""Column sums of stacked fp32 partial rows, cast to the gradients' dtype, in one kernel.

Inductor's mix-order reductions (a LayerNorm backward's weight and bias gradients folded into the
kernel that sums each token's row) leave each gradient as `rows` partial sums of `width` columns,
the gradients' blocks side by side in one fp32 workspace (train/mix_order.py). torch finishes
them with a sum and a cast, two kernels; `partial_sums` makes

    out[k, c] = Σ_r ws[k, r, c]   (fp32, rows in order),  written in `dtype`

in one: a program per block of columns of a gradient. Any CUDA GPU Triton supports runs it; CPU
tensors under TRITON_INTERPRET=1 (the tests); elsewhere on a CPU, `partial_sums_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shatter.kernels.launch import INTERPRET, fast

# A program sums BLOCK_W columns of one gradient over all its rows, BLOCK_R rows a step (16 KB of
# fp32 in flight): at an H100's 1,024 partial rows of a 768-wide LayerNorm, 48 programs of 128 KB
BLOCK_W = 32
BLOCK_R = 128


@triton.jit
def partial_sums_kernel(WS, OUT, ROWS, WIDTH, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    k = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    col_ok = cols < WIDTH
    base = WS + k * ROWS * WIDTH
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for r0 in range(0, ROWS, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < ROWS)[:, None] & col_ok[None, :]
        acc += tl.sum(tl.load(base + rows[:, None] * WIDTH + cols[None, :], mask=ok, other=0.0), 0)
    tl.store(OUT + k * WIDTH + cols, acc.to(OUT.dtype.element_ty), mask=col_ok)


@torch.library.custom_op("shatter::partial_sums", mutates_args=())
def partial_sums(
    ws: torch.Tensor, parts: int, rows: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """[parts, width] in `dtype`: the sums over `rows` of the fp32 [parts, rows, width] at the
    start of the contiguous 1-D `ws` (module doc)."""
    if ws.dtype != torch.float32 or ws.dim() != 1 or ws.numel() < parts * rows * width:
        raise ValueError(
            f"partial_sums takes a 1-D fp32 workspace of at least {parts * rows * width} "
            f"elements, not {ws.dtype} {tuple(ws.shape)}"
        )
    if ws.device.type == "cpu" and not INTERPRET:
        return partial_sums_reference(ws, parts, rows, width, dtype)
    out = torch.empty(parts, width, dtype=dtype, device=ws.device)
    grid = (triton.cdiv(width, BLOCK_W), parts)
    fast(partial_sums_kernel)[grid](
        ws, out, rows, width, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, num_warps=4
    )
    return out


@partial_sums.register_fake
def _(ws, parts, rows, width, dtype):
    return ws.new_empty(parts, width, dtype=dtype)


def partial_sums_reference(ws, parts: int, rows: int, width: int, dtype: torch.dtype):
    """`partial_sums` in torch's ops (the two kernels it replaces): the tests' reference."""
    return ws[: parts * rows * width].view(parts, rows, width).sum(dim=1).to(dtype)
