"""An exact ZeRO-3 resume from a universal checkpoint: two repairs after DeepSpeed's own load.

DeepSpeed's `DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`
(runtime/zero/stage3.py) loads the weights and Adam moments of every sub-group correctly, but

- it gives every sub-group's Adam state the same `step` tensor object; torch's AdamW advances
  `step` in place, so after the resume the shared count grows once per sub-group per optimizer
  step and the bias corrections of every later step are wrong (upstream: no deepspeedai/DeepSpeed
  issue as of 2026-11-27; closest: ZeRO-3 steps each sub-group on its own, hence one count per
  sub-group, https://github.com/deepspeedai/DeepSpeed/pull/1823, and the universal load's
  restoring of `step`, https://github.com/deepspeedai/DeepSpeed/pull/5289);
- it copies the saved hyper-parameters of param group 0 into every param group, so the group
  that §A.2 exempts from weight decay (biases, LayerNorm weights: `shatter.train.engine.param_groups`)
  gets group 0's 0.01 from then on (upstream: no issue as of 2026-11-27; closest: the ZeRO-3
  universal load with several param groups, https://github.com/deepspeedai/DeepSpeed/pull/7585).

`repair_universal_load` undoes both on the loaded optimizer: one `step` tensor per sub-group, and
each param group's hyper-parameters from its own saved group. It is written against the
DeepSpeed versions in `WRITTEN_FOR`, whose load has exactly these two faults; on any other
version a ZeRO-3 resume on another world size stops in one line rather than guess.
"""

from __future__ import annotations

from pathlib import Path

import torch

WRITTEN_FOR = ("0.19.8",)  # DeepSpeed versions whose ZeRO-3 universal load this repairs


def check_version() -> None:
    """Refuses (one line) a DeepSpeed this repair was not written for."""
    import deepspeed

    if deepspeed.__version__ not in WRITTEN_FOR:
        from shatter.train.config import ConfigError

        raise ConfigError(
            f"a ZeRO-3 resume on another world size needs train/zero3_fix.py's repair of "
            f"DeepSpeed's universal load, written for DeepSpeed {', '.join(WRITTEN_FOR)}, not "
            f"{deepspeed.__version__}: install deepspeed=={WRITTEN_FOR[-1]}, or resume on the "
            "checkpoint's own world size"
        )


def repair_universal_load(zero3, universal: Path) -> None:
    """After `engine.load_checkpoint` of the universal folder `universal` into the ZeRO-3
    optimizer `zero3`: a `step` per sub-group, each param group's own hyper-parameters."""
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    check_version()
    base = zero3.optimizer
    for flat in zero3.fp32_partitioned_groups_flat:
        state = base.state.get(flat)
        if state is not None and torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()  # its own count, advanced by its own step
    saved = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)
    groups = saved[OPTIMIZER_STATE_DICT]["param_groups"]
    if len(groups) != len(base.param_groups):
        raise RuntimeError(
            f"{universal}: {len(groups)} saved param groups, the optimizer has "
            f"{len(base.param_groups)}"
        )
    for group, own in zip(base.param_groups, groups):
        for key, value in own.items():
            if key != "params":
                group[key] = value
