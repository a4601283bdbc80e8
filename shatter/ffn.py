"""The block's feed-forward network, y = GELU(x W_inᵀ + b_in) W_outᵀ + b_out, in an FFN_IMPLS.

    torch    nn.Linear, F.gelu, nn.Linear: cuBLAS GEMMs and GELU a kernel of its own each way
             (fused by inductor with nothing else: the GEMMs sit on either side)
    triton   GELU in the epilogues of the GEMMs around it (shatter/kernels/gelu_linear.py): the
             forward's first GEMM writes h and GELU(h); the backward's dy W_out GEMM writes
             dh = dg GELU'(h) and both biases' gradients; the other three GEMMs stay cuBLAS's.
             sm_80+ (tensor-core dots) or Triton's interpreter
    auto     `triton` on a CUDA GPU of compute capability >= 8.0 in bf16 or fp16 when triton
             imports, else `torch`; decided per call from the input, without a host sync

Both compute the same values and gradients up to rounding (tests/shatter/test_ffn.py); the
parameters are the block's two nn.Linear, whatever the impl.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shatter.accelerator import capability, device_index, triton_importable


def feed_forward(x: torch.Tensor, ffn_in: nn.Linear, ffn_out: nn.Linear, impl: str):
    """GELU(x W_inᵀ + b_in) W_outᵀ + b_out, x [..., d], in `impl` (FFN_IMPLS)."""
    if _resolve(impl, x) == "torch":
        return ffn_out(F.gelu(ffn_in(x)))
    _require_tensor_cores(x.device)
    params = (ffn_in.weight, ffn_in.bias, ffn_out.weight, ffn_out.bias)
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))
    return _GeluInEpilogues.apply(x, *params, backward)


def _require_tensor_cores(device: torch.device) -> None:
    """Refuse `triton` forced where its GEMMs cannot run as GEMMs: on the CPU (but under Triton's
    interpreter) and below sm_80, where Triton's dots run on FMAs. Meta tensors (the step
    model's trace) run the ops' fake impls."""
    kernels = _kernels()
    if device.type != "cuda":
        if device.type == "cpu" and not kernels.INTERPRET:
            raise ValueError(
                f"ffn_impl: triton runs on a CUDA GPU of compute capability >= 8.0, not on "
                f"{device.type}; fix: set ffn_impl to auto or torch in the model config"
            )
        return
    major, minor = capability(device_index(device))
    if (major, minor) < (8, 0):
        raise ValueError(
            f"ffn_impl: triton needs a GPU of compute capability >= 8.0 (tensor-core dots), this "
            f"one is sm_{major}{minor}; fix: set ffn_impl to auto or torch in the model config"
        )


def ffn_choice(capability: tuple[int, int], dtype: torch.dtype) -> str:
    """`auto`'s impl on a CUDA GPU of `capability` for inputs in `dtype`, triton importable (the
    step model, tools/bench/step_cost.py, prices the same choice)."""
    tensor_cores = capability >= (8, 0) and dtype in (torch.bfloat16, torch.float16)
    return "triton" if tensor_cores else "torch"


def _resolve(impl: str, x: torch.Tensor) -> str:
    if impl != "auto":
        return impl
    if x.device.type != "cuda" or not triton_importable():
        return "torch"
    return ffn_choice(capability(device_index(x.device)), x.dtype)


def _kernels():
    """shatter/kernels/gelu_linear.py, or one line naming the fix."""
    try:
        from shatter.kernels import gelu_linear
    except ImportError as e:
        raise RuntimeError(
            f"ffn_impl: triton is unavailable ({e}); fix: set ffn_impl to auto or torch in the "
            "model config"
        ) from None
    return gelu_linear


class _GeluInEpilogues(torch.autograd.Function):
    """The FFN with GELU and its derivative in the GEMMs' epilogues (module doc); only the
    gradients asked for are made (a frozen encoder: dx alone)."""

    @staticmethod
    def forward(ctx, x, w_in, b_in, w_out, b_out, backward: bool):
        """`backward`: one will run (grad mode, an input that needs a gradient), so h is kept."""
        kernels = _kernels()
        x2 = x.reshape(-1, x.shape[-1])
        h, g = kernels.linear_gelu(x2, w_in, b_in, backward)
        y = torch.addmm(b_out, g, w_out.t())
        ctx.save_for_backward(x2, w_in, w_out, h, g)
        return y.view(*x.shape[:-1], w_out.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_in, w_out, h, g = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw_in = db_in = dw_out = db_out = None
        if need[3]:
            dw_out = dy2.t() @ g
        if need[0] or need[1] or need[2]:
            dh, sums = _kernels().linear_gelu_bwd(dy2, w_out, h)
            dx = (dh @ w_in).view(*dy.shape[:-1], w_in.shape[1]) if need[0] else None
            dw_in = dh.t() @ x2 if need[1] else None
            db_in, db_out = sums.split([h.shape[1], dy2.shape[1]])
            db_in = db_in if need[2] else None
        elif need[4]:
            db_out = dy2.sum(0)
        return dx, dw_in, db_in, dw_out, db_out if need[4] else None, None
