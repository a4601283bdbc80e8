"""AdamW on fp32 master weights in one pass: the low-precision gradient in, the low-precision
weights out (train/master_step.py runs it as ZeRO-1/2's bf16 step).

DeepSpeed's bf16 ZeRO step with torch's fused AdamW makes three passes over the rank's share of
the parameters, about 44 bytes a parameter:

    flatten  the bf16 gradients copied into one fp32 buffer          2 B read, 4 written
    AdamW    torch's fused kernel: master, gradient, moments read;   16 read, 16 written
             master, moments and the unscaled gradient written
    copy     the fp32 master cast into the bf16 weights               4 read, 2 written

`master_adamw_` is one elementwise kernel over the flat partition: each bf16 gradient read where
it lies (a list of tensors: the kernel gets their addresses, each program a chunk of one tensor,
`chunk_map`), the fp32 master and both moments read (14 B), master and moments written and the
master's bf16 cast (14 B): 28 bytes a parameter. The math is torch's fused AdamW's (decoupled weight
decay; the gradient divided by `grad_scale`; nothing written when `found_inf` is non-zero, the
step count then kept), in fp32: equal to it to fp32 rounding (tests/shatter/test_master_adamw.py).
No products: any CUDA GPU Triton supports runs it, the V100 too; on CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shatter.kernels.launch import INTERPRET

BLOCK = 8192 if INTERPRET else 2048  # elements a program: few programs for the interpreter
WARPS = 8


@triton.jit
def _expm1(y):
    """e^y - 1 in fp32 without the cancellation of 1 - β^t near 1 (β2 = 0.999: 1 - β2 is 1e-3,
    which exp(y) - 1 would give to 1e-4 only): Kahan's (u - 1) y / ln u, u = e^y; -1 once u
    underflows (β1^t at t of a thousand or more)."""
    u = tl.exp(y)
    near = u == 1.0
    ratio = (u - 1.0) * y / tl.where(near | (u == 0.0), 1.0, tl.log(u))
    return tl.where(near, y, tl.where(u == 0.0, -1.0, ratio))


@triton.jit
def _low(x, dtype: tl.constexpr):
    """x cast to `dtype` rounding to nearest, ties to even, as torch casts (and a GPU's cvt.rn);
    to bf16 by the bits, as Triton's interpreter truncates that cast. x is finite (a master)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def master_adamw_kernel(
    GRADS, CHUNKS, NUMELS, P, M, V, W, STEP, SCALE, FOUND, lr, beta1, beta2, ln_beta1, ln_beta2,
    eps, decay, HAS_SCALE: tl.constexpr, HAS_FOUND: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One chunk of BLOCK elements of one gradient tensor (CHUNKS: its tensor, its offset in
    the tensor, its offset in the flat master; GRADS: the tensors' addresses)."""
    if HAS_FOUND:
        if tl.load(FOUND) != 0:  # a skipped step: nothing read or written
            return
    chunk = CHUNKS + 3 * tl.program_id(0)
    t, at, flat = tl.load(chunk), tl.load(chunk + 1), tl.load(chunk + 2)
    G = tl.load(GRADS + t).to(tl.pointer_type(W.dtype.element_ty))
    left = tl.load(NUMELS + t) - at  # the tensor's elements from the chunk's first on
    if ALIGNED:  # every address 16-byte aligned, every tensor's size a multiple of 8: vectors
        G = tl.multiple_of(G, 16)
        at, flat, left = tl.multiple_of(at, 8), tl.multiple_of(flat, 8), tl.multiple_of(left, 8)
    idx = tl.arange(0, BLOCK)
    keep = idx < left
    g = tl.load(G + at + idx, mask=keep, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(SCALE)
    offs = flat + idx
    p = tl.load(P + offs, mask=keep, other=0.0)
    m = tl.load(M + offs, mask=keep, other=0.0)
    v = tl.load(V + offs, mask=keep, other=0.0)
    step = tl.load(STEP).to(tl.float32)
    step_size = -lr / _expm1(step * ln_beta1)  # lr / (1 - β1^t)
    root = tl.sqrt(-_expm1(step * ln_beta2))  # √(1 - β2^t)
    p = p - lr * decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / root + eps)
    tl.store(P + offs, p, mask=keep)
    tl.store(M + offs, m, mask=keep)
    tl.store(V + offs, v, mask=keep)
    tl.store(W + offs, _low(p, W.dtype.element_ty), mask=keep)


_CHUNKS: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}


def chunk_map(
    numels: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernel's programs for tensors of `numels` laid end to end in the master: (chunks
    [programs, 3] int64: tensor, offset in it, offset in the master; the numels; whether every
    numel is a multiple of 8). Made once per layout (a run's groups keep theirs) and kept on the
    device."""
    key = (numels, str(device))
    if key not in _CHUNKS:
        rows, flat = [], 0
        for t, numel in enumerate(numels):
            rows += [(t, at, flat + at) for at in range(0, numel, BLOCK)]
            flat += numel
        chunks = torch.tensor(rows, dtype=torch.int64).to(device)
        sizes = torch.tensor(numels, dtype=torch.int64).to(device)
        _CHUNKS[key] = (chunks, sizes, all(numel % 8 == 0 for numel in numels))
    return _CHUNKS[key]


@torch.library.custom_op(
    "shatter::master_adamw_", mutates_args=("master", "exp_avg", "exp_avg_sq", "step", "weight")
)
def master_adamw_(
    grads: list[torch.Tensor],
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    weight: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    step_counted: bool = False,
) -> None:
    """One AdamW step of the flat fp32 `master` (and its moments) from the low-precision `grads`
    (contiguous; divided by `grad_scale` where given), which are the master's first elements
    laid end to end (any past them, a partition's padding, are left as they are); `master` cast
    into `weight` (flat, the low-precision parameters' partition); `step` (a 0-d fp32 tensor)
    counted up as torch's fused AdamW counts it: kept where `found_inf` is non-zero, when
    nothing is written (`step_counted`: it already holds this step's count, made by
    shatter.kernels.norm_verdict). The gradients are read where they lie: the kernel is given
    their addresses (a few hundred bytes copied to the device each call)."""
    chunks, numels, sizes_aligned = chunk_map(tuple(g.numel() for g in grads), master.device)
    addresses = [g.data_ptr() for g in grads]
    table = torch.tensor(addresses, dtype=torch.int64)
    if master.is_cuda:  # from pinned memory: a copy from pageable memory may wait for the stream
        table = table.pin_memory().to(master.device, non_blocking=True)
    if not step_counted:
        step.add_(1)
    # Triton's own launch, not shatter.kernels.launch's: the learning rate changes every step, and
    # a signature per value would be cached for ever (two launches a step: its host time is small)
    master_adamw_kernel[(chunks.shape[0],)](
        table, chunks, numels, master, exp_avg, exp_avg_sq, weight, step,
        master if grad_scale is None else grad_scale, master if found_inf is None else found_inf,
        lr, beta1, beta2, math.log(beta1), math.log(beta2), eps, weight_decay,
        HAS_SCALE=grad_scale is not None, HAS_FOUND=found_inf is not None,
        ALIGNED=sizes_aligned and all(a % 16 == 0 for a in addresses), BLOCK=BLOCK,
        num_warps=WARPS,
    )  # fmt: skip
    if found_inf is not None and not step_counted:
        step.sub_(found_inf)


@master_adamw_.register_fake
def _(grads, master, exp_avg, exp_avg_sq, step, weight, lr, beta1, beta2, eps, weight_decay,
      grad_scale=None, found_inf=None, step_counted=False):  # fmt: skip
    return None


def master_adamw_reference(
    grads, master, exp_avg, exp_avg_sq, step, weight, lr, beta1, beta2, eps, weight_decay,
    grad_scale=None, found_inf=None, step_counted=False,
) -> None:  # fmt: skip
    """`master_adamw_` in eager torch ops (torch's fused AdamW's formulas) over the whole master,
    `grads` zero-padded to it: the equality tests' reference."""
    if not step_counted:
        step.add_(1)
    if found_inf is not None and bool(found_inf != 0):
        if not step_counted:
            step.sub_(found_inf)
        return
    grad = torch.cat([g.reshape(-1).float() for g in grads])
    grad = torch.cat([grad, grad.new_zeros(master.numel() - grad.numel())])
    g = grad if grad_scale is None else grad / grad_scale
    t = float(step)
    master.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t) + eps
    master.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))
    weight.copy_(master)
