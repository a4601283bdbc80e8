"""The optimizer step's scalars in one kernel: the global gradient norm, the verdict that skips a
non-finite step, the clip's divisor and the AdamW step counts (train/master_step.py).

From the gradients' sum of squares (all-reduced over the data-parallel ranks), DeepSpeed's bf16
ZeRO step as the trainer runs it (train/engine.py: `fuse_grad_norm`, `skip_on_the_device`,
`clip_without_host_reads`) makes, in a dozen and a half one-element kernels:

    norm    = √squares, a NaN taken as inf                 (the logged global norm)
    bad     = 1 where norm is not finite, else 0           (the AdamW kernel's `found_inf`)
    skipped = skipped + bad                                (steps skipped on the device)
    factor  = max(1, (norm + 1e-6) / clip)                 (its `grad_scale`; inf when bad)
    step    = step + 1 − bad, for each parameter group     (torch AdamW's count, kept when bad)

`norm_verdict` makes them in one launch, in fp32 with IEEE rounding (`sqrt_rn`, `div_rn`): the
values torch's ops give, to the bit. Any CUDA GPU Triton supports runs it; CPU tensors under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_STEPS = 4  # parameter groups whose step counts one launch counts up


@triton.jit
def _count(STEP, keep):
    tl.store(STEP, tl.load(STEP) + keep)


@triton.jit
def norm_verdict_kernel(
    SQUARES, NORM, BAD, FACTOR, SKIPPED, S0, S1, S2, S3, clip, CLIP: tl.constexpr,
    FRESH: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    squares = tl.load(SQUARES)
    inf = float("inf")
    norm = tl.sqrt_rn(squares)
    norm = tl.where(norm != norm, inf, norm)  # NaN: the step is skipped as for inf
    bad = tl.where((norm >= 0.0) & (norm < inf), 0.0, 1.0)
    tl.store(NORM, norm)
    tl.store(BAD, bad)
    if CLIP:
        tl.store(FACTOR, tl.maximum(tl.div_rn(norm + 1e-6, clip), 1.0))
    else:
        tl.store(FACTOR, 1.0)
    if FRESH:
        tl.store(SKIPPED, bad)
    else:
        tl.store(SKIPPED, tl.load(SKIPPED) + bad)
    keep = 1.0 - bad
    if STEPS > 0:
        _count(S0, keep)
    if STEPS > 1:
        _count(S1, keep)
    if STEPS > 2:
        _count(S2, keep)
    if STEPS > 3:
        _count(S3, keep)


@torch.library.custom_op("shatter::norm_verdict", mutates_args=("skipped", "steps"))
def norm_verdict(
    squares: torch.Tensor, skipped: torch.Tensor, steps: list[torch.Tensor], clip: float,
    fresh: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(norm, bad, factor), 0-d fp32 tensors, from `squares` (0-d fp32), as the module doc
    writes them; `skipped` (0-d fp32) counts the skip (`fresh`: it is overwritten, a count that
    starts at this step), each of `steps` (0-d fp32, at most MAX_STEPS) counts the step unless
    it is skipped; `factor` is 1 where `clip` is 0 (no clipping)."""
    if len(steps) > MAX_STEPS:
        raise ValueError(f"norm_verdict counts at most {MAX_STEPS} step counts, not {len(steps)}")
    norm, bad, factor = (torch.empty((), device=squares.device) for _ in range(3))
    held = [*steps, *[squares] * (MAX_STEPS - len(steps))]  # unused pointers
    norm_verdict_kernel[(1,)](
        squares, norm, bad, factor, skipped, *held, float(clip), CLIP=clip > 0.0, FRESH=fresh,
        STEPS=len(steps), num_warps=1,
    )  # fmt: skip
    return norm, bad, factor


@norm_verdict.register_fake
def _(squares, skipped, steps, clip, fresh):
    return tuple(squares.new_empty(()) for _ in range(3))


def norm_verdict_reference(squares, skipped, steps, clip: float, fresh: bool):
    """`norm_verdict` in torch's one-element ops, as DeepSpeed's step made them: the equality
    tests' reference."""
    inf = float("inf")
    norm = squares.sqrt().nan_to_num(nan=inf, posinf=inf)
    bad = ((norm >= 0) & (norm < inf)).logical_not().float()
    factor = torch.clamp((norm + 1e-6) / clip, min=1.0) if clip > 0 else torch.ones_like(norm)
    skipped.copy_(bad if fresh else skipped + bad)
    for step in steps:
        step.add_(1 - bad)
    return norm, bad, factor
