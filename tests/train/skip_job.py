"""Two CPU ranks (gloo) of a bf16 ZeRO-1 or ZeRO-2 engine with a GPU's config (torch's fused AdamW as the
client, DeepSpeed's contiguous bucket and reduce-scatter; overlap_comm off: gloo has no side
streams): at one step the last rank's loss is NaN. Each rank writes OUT/rank<r>.json, which
tests/train/test_fused_step.py reads: whether each step left the fp32 masters unchanged and
finite, the host reads of each step, and the skipped steps counted.

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
    cfg = resolve(
        None, {"precision": "bf16", "zero_stage": stage, "micro_batch": 2, "max_steps": 10}
    )
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
    out = dict(rank=rank, unchanged=unchanged, finite=finite, reads=reads,
               skipped=skipped_steps(engine), device_skip=not opt.check_grad_overflow,
               contiguous=opt.contiguous_gradients)  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
