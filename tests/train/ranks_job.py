"""One job under the deepspeed launcher (two CPU ranks, gloo) that checks, engine by engine,
what a multi-rank run must not get wrong; tests/train/test_ranks.py runs it and reads its JSON.

- The export at bf16 × ZeRO-0..3 (and fp32 × ZeRO-0..3): the engine is trained a few steps,
  checkpointed and exported; rank 0 reloads the export with `shatter.from_pretrained` and
  compares its logits with the engine's, its weights with the engine's fp32 masters rounded to
  the module's dtype, and (ZeRO-1..3) with DeepSpeed's zero_to_fp32 of the checkpoint files.
- A non-finite step: at one step a forward hook makes one layer's output NaN on the last rank only;
  the step must be skipped on both ranks (the fp32 masters unchanged and finite) and counted.
- Uneven validation under fp32 ZeRO-3: several validation sizes, one per remainder of rows mod
  (ranks × micro-batch), each evaluated on both ranks and, as the reference, by one process with
  the gathered weights over the same rows.
- Then, for each `--pretrain ARGS...`, train/pretrain.py's command with ARGS on the job's ranks
  (its process group already up), so that the tests of 2-rank runs share this launch; the last
  as the process's program (`run_cli`): a failure of it ends the job in one line a rank.

    deepspeed --num_gpus 2 tests/train/ranks_job.py DATA RUN OUT.json [--pretrain ARGS...]...

PRECISIONS `none` leaves the checks out: only the --pretrain runs.
"""

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import shatter  # noqa: E402
from shatter import safe_load  # noqa: E402
from shatter.shards import read_index  # noqa: E402
from shatter.train import checkpoint  # noqa: E402
from shatter.train.config import model_overrides, resolve  # noqa: E402
from shatter.train.engine import (  # noqa: E402
    build_engine,
    init_distributed,
    loss_scale,
    resolved_deepspeed_config,
    skipped_steps,
)
from shatter.train.evaluate import evaluate  # noqa: E402
from shatter.train.loader import ShardStream, masking_spec, validation_stream  # noqa: E402
from shatter.train.loop import MODEL_INPUTS  # noqa: E402

MICRO = 2
STEPS, NAN_STEP = 4, 2


def inputs(batch: dict, device: torch.device | str = "cpu") -> dict:
    return {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}


def make_engine(index, precision: str, stage: int, run: Path):
    flags = {"precision": precision, "zero_stage": stage, "micro_batch": MICRO}
    if stage == 3:  # every weight partitioned, as a base-size model's: each forward gathers
        expert = run / "zero3.json"
        expert.parent.mkdir(parents=True, exist_ok=True)
        zero = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
        expert.write_text(json.dumps({"zero_optimization": zero}))
        flags["deepspeed_config"] = str(expert)
    cfg = resolve(None, {**flags, "max_steps": 100, "warmup_steps": 1, "lr": 1e-3})
    if precision == "fp16":  # 2**8: the first STEPS steps update (2**16 overflows them all,
        # with DeepSpeed's hysteresis of 2, and the export would hold the initial weights)
        cfg = replace(cfg, optim=replace(cfg.optim, initial_scale_power=8))
    torch.manual_seed(0)
    model = shatter.build_model("shatter-tiny", **model_overrides(cfg, index, index.seq_len))
    _, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return cfg, build_engine(model, cfg, resolved_deepspeed_config(cfg, world))


def train_with_a_nan(engine, index, cfg, rank: int, world: int) -> dict:
    """STEPS optimizer steps; at NAN_STEP the last rank's first encoder layer outputs NaN."""
    stream = iter(
        ShardStream(
            index,
            "train",
            batch_size=MICRO,
            seq_len=index.seq_len,
            masking=masking_spec(cfg.data),
            seed=0,
            rank=rank,
            world_size=world,
        )
    )
    layer = next(m for n, m in engine.module.named_modules() if n.endswith("layers.0"))
    engine.train()
    before = after = None
    for step in range(STEPS):
        hook = None
        if step == NAN_STEP:
            before, skipped = checkpoint.fp32_masters(engine), skipped_steps(engine)
            if rank == world - 1:
                hook = layer.register_forward_hook(lambda m, i, o: o * float("nan"))
        loss = engine(**inputs(next(stream), engine.device))["loss"]
        engine.backward(loss)
        engine.step()
        if hook is not None:
            hook.remove()
        if step == NAN_STEP:
            after, skipped = checkpoint.fp32_masters(engine), skipped_steps(engine) - skipped
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(torch.isfinite(v).all() for v in after.values())
    module_finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    return {
        "skipped_at_the_nan_step": skipped,  # fp16 may skip others too (loss-scale overflows)
        "skipped_steps": skipped_steps(engine),
        "loss_scale": loss_scale(engine),
        "nan_step_unchanged": unchanged,
        "masters_finite": bool(finite),
        "module_finite": bool(module_finite),
        "final": after,
    }


def refused_files(step_dir: Path) -> list[str]:
    """The files of checkpoint `step_dir` that `shatter.safe_load` refuses (none may be)."""
    refused = []
    for path in sorted(step_dir.glob("*.pt")):
        try:
            safe_load.load(path)
        except safe_load.UnsafeCheckpointError as err:
            refused.append(str(err))
    return refused


def check_export(engine, index, run: Path, rank: int, stage: int, batch: dict) -> dict:
    name = checkpoint.save(engine, run, checkpoint.TrainState(step=STEPS), {}, {}, keep=1)
    checkpoint.export(engine, run, name, index.tokenizer)
    masters = checkpoint.fp32_masters(engine)
    engine.eval()
    with torch.no_grad():
        engine_logits = engine(**inputs(batch, engine.device))["logits"].float().cpu()
    result = {}
    if rank == 0:
        reloaded = shatter.from_pretrained(run / "export").eval()
        exported = reloaded.state_dict()
        with torch.no_grad():
            logits = reloaded(**inputs(batch))["logits"]
        result["max_logit_diff"] = float((logits - engine_logits).abs().max())
        result["masters_equal"] = all(torch.equal(exported[k], v) for k, v in masters.items())
        dtype = next(engine.module.parameters()).dtype
        below = sum(
            not torch.equal(v, v.to(dtype).float())
            for v in exported.values()
            if v.is_floating_point()
        )
        result["tensors_finer_than_module_dtype"] = below
        result["refused_weights_only"] = refused_files(run / "checkpoints" / name)
        if stage > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with safe_load.only_weights():  # DeepSpeed's own loads, restricted as the trainer's
                files = get_fp32_state_dict_from_zero_checkpoint(str(run / "checkpoints"), tag=name)
            result["zero_to_fp32_equal"] = all(
                torch.equal(files[k].float(), masters[k]) for k in files
            )
    torch.distributed.barrier()
    return result


def uneven_validation(engine, index, cfg, rank: int, world: int) -> list[dict]:
    """Validation sizes with every remainder of rows mod (world × MICRO), 2 full batches a rank
    before it: 2 ranks vs 1 process (rank 0's, the rank that writes the report)."""
    single = shatter.build_model("shatter-tiny", **model_overrides(cfg, index, index.seq_len))
    single.load_state_dict(checkpoint.fp32_masters(engine), strict=False)
    per = world * MICRO
    results = []
    forwards = [0]
    engine.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    for rows in [2 * per + r for r in range(per)]:
        data = cfg.data.__class__(eval_samples=rows)
        forwards[0] = 0
        started = time.perf_counter()
        both = evaluate(
            engine,
            (
                inputs(b, engine.device)
                for b in validation_stream(
                    index,
                    data,
                    batch_size=MICRO,
                    seq_len=index.seq_len,
                    rank=rank,
                    world_size=world,
                )
            ),
            engine.device,
            distributed=True,
        )
        seconds = time.perf_counter() - started
        every = [None] * world  # each rank's forwards and result: all the same
        torch.distributed.all_gather_object(every, (forwards[0], both))
        alone = None  # only rank 0's result is reported
        if rank == 0:
            rows_alone = validation_stream(
                index, data, batch_size=MICRO, seq_len=index.seq_len, rank=0, world_size=1
            )
            batches = (inputs(b, engine.device) for b in rows_alone)
            alone = evaluate(single, batches, torch.device("cpu"), distributed=False)
        results.append(
            {
                "rows": rows,
                "remainder": rows % per,
                "ranks": both,
                "one": alone,
                "forwards_per_rank": [n for n, _ in every],
                "results_agree": all(r == both for _, r in every),
                "s": seconds,
            }
        )
    return results


def main() -> None:
    """DATA RUN OUT [PRECISIONS [STAGES]] [--pretrain ARGS...]...: PRECISIONS and STAGES
    comma-separated, default bf16,fp32 and 0,1,2,3."""
    groups: list[list[str]] = [[]]  # the job's own arguments, then each --pretrain's
    for arg in sys.argv[1:]:
        if arg == "--pretrain":
            groups.append([])
        elif not arg.startswith("--local_rank"):
            groups[-1].append(arg)
    args, pretrain_runs = groups[0], groups[1:]
    data, run, out = (Path(a) for a in args[:3])
    precisions = (args[3] if len(args) > 3 else "bf16,fp32").split(",")
    precisions = [] if precisions == ["none"] else precisions
    stages = [int(z) for z in (args[4] if len(args) > 4 else "0,1,2,3").split(",")]
    rank, world = init_distributed()
    index = read_index(data)
    batch = next(
        iter(
            validation_stream(
                index,
                resolve(None, {}).data,
                batch_size=4,
                seq_len=index.seq_len,
                rank=0,
                world_size=1,
            )
        )
    )
    report = {"export": {}, "nan": {}}
    for precision in precisions:
        for stage in stages:
            key = f"{precision}-{stage}"
            started = time.perf_counter()
            cfg, engine = make_engine(index, precision, stage, run / key)
            nan = train_with_a_nan(engine, index, cfg, rank, world)
            nan.pop("final")
            report["nan"][key] = nan
            report["export"][key] = check_export(engine, index, run / key, rank, stage, batch)
            if precision == "fp32" and stage == 3:
                report["validation"] = uneven_validation(engine, index, cfg, rank, world)
            report["export"][key]["s"] = round(time.perf_counter() - started, 1)
            del engine
    if rank == 0:
        out.write_text(json.dumps(report, indent=1))
    torch.distributed.barrier()
    from shatter.train.lifecycle import run_cli
    from shatter.train.pretrain import main as pretrain

    for pretrain_args in pretrain_runs[:-1]:
        pretrain.main(pretrain_args, standalone_mode=False)
    if pretrain_runs:
        run_cli(lambda: pretrain.main(pretrain_runs[-1]))


if __name__ == "__main__":
    main()
