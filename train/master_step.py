"""bf16 ZeRO-1/2's optimizer step in one pass over each partition (`optim.impl: master`).

DeepSpeed 0.19.8's step, after the gradients' norm (train/engine.py: `streamline_zero`), takes
three passes over the rank's partition of each parameter group: the bf16 gradients flattened into
one fp32 buffer, torch's fused AdamW on the fp32 master (which also writes the unscaled gradient
back), and the master cast into the bf16 parameters: about 44 bytes a parameter. Here the step
runs `shatter::master_adamw_` (shatter/kernels/master_adamw.py) on the partition's gradients
where they lie (the kernel is given their addresses): the master, its moments and the bf16
parameters updated in one kernel, 28 bytes a parameter. bert-base on one GPU: about 1.8 GB a
step less read and written. The scalars between the gradients' sum of squares
(train/engine.py's `fuse_grad_norm`) and the AdamW kernels, which DeepSpeed's step with the
trainer's `clip_without_host_reads` and `skip_on_the_device` makes in 15 one-element kernels
(the norm, the skip of a non-finite step, the clip factor) and the client AdamW in 4 more (its
step counts up and back), are one kernel here (`shatter::norm_verdict`). The rest is DeepSpeed's
step as it runs for this case: the parameters all-gathered over the data-parallel group, the
gradients released.

The moments and the step count are the client optimizer's own state (torch.optim.AdamW's
`exp_avg`, `exp_avg_sq`, `step`, made as it makes them): checkpoints are the same either way, and
a run resumes across `optim.impl` values. Equal to DeepSpeed's step to fp32 rounding
(tests/train/test_master_step.py).
"""

from __future__ import annotations

import torch

# train/config.py's optim.impl values this module serves
MASTER_IMPLS = ("auto", "master")


def unsupported(optimizer) -> str | None:
    """Why `optim.impl: master` cannot step this DeepSpeed optimizer, or None when it can: bf16
    ZeRO-1/2 with torch's fused AdamW as the client, on a CUDA device with triton (or CPU
    tensors under TRITON_INTERPRET=1), and none of DeepSpeed's other step paths (CPU offload,
    MoE, Muon, ZenFlow, an autocast grad scaler)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from shatter.accelerator import triton_importable

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "it steps ZeRO stage 1 or 2 only"
    if optimizer.dtype != torch.bfloat16 or float(optimizer.loss_scale) != 1.0:
        return "it steps bf16 runs only (fp16 keeps DeepSpeed's loss-scaled step)"
    if not hasattr(optimizer, "skipped_on_device"):  # train/engine.py: skip_on_the_device
        return "it needs torch's fused AdamW as ZeRO's client, which skips on the device"
    if not hasattr(optimizer, "global_grad_squares"):  # train/engine.py: fuse_grad_norm
        return (
            "it needs the gradients' norm in one pass, which DeepSpeed's own norm serves under "
            "model parallelism and for parameters a pipeline replicates"
        )
    groups = optimizer.optimizer.param_groups
    if any(g.get("amsgrad") or g.get("maximize") or torch.is_tensor(g["lr"]) for g in groups):
        return "it runs AdamW without amsgrad or maximize, at a float learning rate"
    others = (
        optimizer.cpu_offload,
        optimizer.has_moe_layers,
        getattr(optimizer, "zenflow", False),
        getattr(optimizer, "torch_autocast_gradscaler", None),
        bool(getattr(optimizer, "groups_lacking_loss_scale", ())),
        "muon" in type(optimizer.optimizer).__name__.lower(),
        not optimizer.compute_grad_norm,
    )
    if any(others):
        return (
            "DeepSpeed's own step serves CPU offload, MoE, Muon, ZenFlow, an autocast grad "
            "scaler and a run without the gradient norm"
        )
    device = optimizer.single_partition_of_fp32_groups[0].device
    if not triton_importable():
        return "its kernel needs triton, which is not installed here"
    from shatter.kernels.launch import INTERPRET
    from shatter.kernels.norm_verdict import MAX_STEPS

    if len(optimizer.bit16_groups) > MAX_STEPS:
        return f"it steps at most {MAX_STEPS} parameter groups"
    if device.type == "cuda" or (device.type == "cpu" and INTERPRET):
        return None
    return f"its kernel runs on CUDA GPUs, not on {device.type}"


def install(optimizer) -> None:
    """Replace `optimizer.step` (a DeepSpeed ZeRO-1/2 optimizer that `unsupported` accepts)."""

    def step(closure=None) -> None:
        master_step(optimizer)

    optimizer.step = step


@torch.no_grad()
def master_step(opt) -> None:
    """DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer.step` for the case `unsupported` accepts, each
    group's flatten, AdamW and copy back made by one kernel."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt.micro_step_id = INITIAL_MICRO_STEP_ID
    opt.overflow = False  # a non-finite norm skips the step in the kernel (found_inf)
    opt._update_scale(False)
    scale, found_inf = _verdict(opt)
    for i in range(len(opt.bit16_groups)):
        rank = dist.get_rank(group=opt.real_dp_process_group[i])
        opt.free_grad_in_param_list(opt.params_not_in_partition[i])
        grads = partition_gradients(opt, i)
        weight = opt.parallel_partitioned_bit16_groups[i][rank]
        _adamw(opt, i, grads, weight, scale, found_inf)
        del grads
        opt.free_grad_in_param_list(opt.params_in_partition[i])
        opt._release_preflattened_grad_buffers(i)
        opt.averaged_gradients[i] = None
        opt.all_grad_tensors[i] = None
    all_gather_dp_groups(
        groups_flat=opt.bit16_groups_flat,
        partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
        dp_process_group=opt.real_dp_process_group,
        start_alignment_factor=opt.nccl_start_alignment_factor,
        allgather_bucket_size=opt.allgather_bucket_size,
    )
    for i in range(len(opt.bit16_groups)):
        opt._update_model_bit16_weights(i)
    opt._lazy_init_hp_params_optimizer_state()


def _verdict(opt) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The step's scalars in one kernel (module doc): the global norm (as DeepSpeed logs it),
    the skipped steps counted on the device, every group's step count; gives (grad_scale: the
    clip's divisor, None without clipping; found_inf)."""
    from shatter.kernels.norm_verdict import norm_verdict

    squares = opt.global_grad_squares()
    if squares is None:  # no gradient in any group: a norm of 0, as DeepSpeed's
        squares = torch.zeros((), dtype=torch.float32, device=opt.device)
    steps = [_state(opt, i)["step"] for i in range(len(opt.bit16_groups))]
    seen = opt.skipped_on_device
    fresh = seen is None
    if fresh:
        seen = torch.empty((), dtype=torch.float32, device=squares.device)
    norm, bad, factor = norm_verdict(squares, seen, steps, float(opt.clip_grad), fresh)
    opt.skipped_on_device = seen
    opt._global_grad_norm = norm  # bf16: a loss scale of 1
    return (factor if opt.clip_grad > 0.0 else None), bad


def _state(opt, i: int) -> dict:
    """Group i's client AdamW state, made as torch's fused AdamW makes it at its first step."""
    master = opt.single_partition_of_fp32_groups[i]
    state = opt.optimizer.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return state


def _adamw(opt, i: int, grads: list[torch.Tensor], weight: torch.Tensor, scale, found_inf) -> None:
    """Group i's AdamW step on its fp32 master, the master cast into `weight` (the rank's bf16
    partition), with the moments torch.optim.AdamW(fused=True) keeps (its step count already
    counted by `_verdict`); the gradients divided by `scale` (None: as they are)."""
    from shatter.kernels.master_adamw import master_adamw_

    master, group = opt.single_partition_of_fp32_groups[i], opt.optimizer.param_groups[i]
    state = _state(opt, i)
    beta1, beta2 = group["betas"]
    master_adamw_(
        grads, master, state["exp_avg"], state["exp_avg_sq"], state["step"], weight,
        float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
        float(group["weight_decay"]), grad_scale=scale, found_inf=found_inf, step_counted=True,
    )  # fmt: skip


def partition_gradients(opt, i: int) -> list[torch.Tensor]:
    """The rank's gradients of group i, contiguous, in the master's order: DeepSpeed's own flat
    partition where it made one, else the tensors it holds for the step (on one rank the
    parameters' own gradients; on more, views of the partition's buffer)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    flat = DeepSpeedZeroOptimizer._get_preflattened_grad_partition(opt, i)
    grads = [flat] if flat is not None else opt.averaged_gradients[i]
    return [g if g.is_contiguous() else g.contiguous() for g in grads]
