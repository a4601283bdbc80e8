"""Two CPU ranks (gloo) of a bf16 ZeRO-1 or ZeRO-2 engine with a GPU's config (torch's fused AdamW as the
client, DeepSpeed's contiguous bucket and reduce-scatter; overlap_comm off: gloo has no side
streams): at one step the last rank's loss is NaN. Twice: with `optim.impl` `auto` (the one-pass
step, train/master_step.py, where its kernel runs: here under Triton's interpreter) and `torch`.
Each rank writes OUT/rank<r>.json, which tests/train/test_fused_step.py reads: per impl whether
each step left the fp32 masters unchanged and finite, the host reads of each step, and the
skipped steps counted; and whether both impls' masters came out equal.

    deepspeed --num_gpus 2 tests/train/skip_job.py OUT [STAGE]    (STAGE 1 or 2; default 1)
"""

import json
import sys
from pathlib import Path

import torch

import shatter
from shatter.tools.bench.count_ops import OpCounter, mlm_batch
from shatter.train.config import resolve
from shatter.train.engine import build_engine, deepspeed_config, init_distributed, skipped_steps

STEPS, NAN_STEP = 6, 4  # the warm-up's first two steps have lr 0


def main() -> None:
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out_dir, *rest = [a for a in sys.argv[1:] if not a.startswith("--")]  # the launcher's own
    stage = int(rest[0]) if rest else 1
    out, masters = {"rank": rank}, {}
    for impl in ("auto", "torch"):
        out[impl], masters[impl] = run(impl, stage, rank, world)
    # equal but for fp32 rounding, which a bf16 weight rounded the other way at one step then
    # carries on (the runs' updates are about lr = 1e-4 an element)
    out["equal"] = all(
        torch.allclose(a, b, rtol=0, atol=1e-5)
        for a, b in zip(masters["auto"], masters["torch"], strict=True)
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def run(impl: str, stage: int, rank: int, world: int) -> tuple[dict, list[torch.Tensor]]:
    """STEPS steps of a fresh engine with `optim.impl` `impl`: what each did, and the masters."""
    cfg = resolve(
        None,
        {"precision": "bf16", "zero_stage": stage, "micro_batch": 2, "max_steps": 10,
         "optim_impl": impl},
    )  # fmt: skip
    torch.manual_seed(0)
    model = shatter.build_model("bert-tiny", vocab_size=300, max_len=64)
    ds = deepspeed_config(cfg, world, cpu=False)
    ds["zero_optimization"]["overlap_comm"] = False
    engine = build_engine(model, cfg, ds)
    opt = engine.optimizer
    unchanged, finite, reads = [], [], []
    for step in range(STEPS):
        loss = engine(**mlm_batch(2, 32, 300, 10 * step + rank))["loss"]
        if step == NAN_STEP and rank == world - 1:
            loss = loss * float("nan")
        engine.backward(loss)
        before = [m.detach().clone() for m in opt.single_partition_of_fp32_groups]
        counter = OpCounter()
        with counter, counter.counting("step"):
            engine.step()
        after = opt.single_partition_of_fp32_groups
        unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        finite.append(all(bool(torch.isfinite(m).all()) for m in after))
        reads.append(counter.tally.reads["step"])
    out = dict(unchanged=unchanged, finite=finite, reads=reads, skipped=skipped_steps(engine),
               device_skip=not opt.check_grad_overflow, contiguous=opt.contiguous_gradients,
               one_pass="step" in vars(opt))  # fmt: skip
    return out, [m.detach().clone() for m in opt.single_partition_of_fp32_groups]


if __name__ == "__main__":
    main()
