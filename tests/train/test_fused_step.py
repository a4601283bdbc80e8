"""The fused optimizer step (optim.impl torch: torch.optim.AdamW(fused=True), which DeepSpeed's
ZeRO-1 runs over its flat fp32 partition, one tensor per param group) equals the eager
per-parameter AdamW loop, with §A.2's groups (no weight decay on biases and LayerNorm weights)."""

import copy
import json

import pytest
import torch

import shatter
from shatter.kernels.launch import INTERPRET
from shatter.train.config import OptimArgs
from shatter.train.engine import client_optimizer, param_groups


def _steps(model, optimizer, batches):
    for x in batches:
        optimizer.zero_grad()
        model(x, None, torch.where(x % 3 == 0, x, -100))["loss"].backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fused_adamw_equals_the_eager_loop():
    torch.manual_seed(0)
    model = shatter.build_model("shatter-tiny", vocab_size=50, max_len=16, dropout=0.0)
    twin = copy.deepcopy(model)
    o = OptimArgs(lr=1e-2)
    fused = client_optimizer(param_groups(model, o.weight_decay), o)
    assert all(g["fused"] for g in fused.param_groups)
    eager = torch.optim.AdamW(
        param_groups(twin, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
        foreach=False, fused=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(5, 50, (2, 16), generator=g) for _ in range(3)]
    start = [p.detach().clone() for p in model.parameters()]
    got, want = _steps(model, fused, batches), _steps(twin, eager, batches)
    assert all(not torch.equal(a, b) for a, b in zip(want, start, strict=True))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_zero1_s_gradient_norm_in_few_kernels_equals_deepspeed_s():
    """DeepSpeed's ZeRO-1 global norm (a cast and a norm per gradient tensor, per parameter
    group, then the groups' norms combined) and the trainer's (`fuse_grad_norm`: one
    multi-tensor norm over every group) on a real bf16 engine: equal to fp32 rounding, both
    infinite (the step skipped) for a NaN gradient in either group, and the trainer's in a
    handful of ops where DeepSpeed's takes two per tensor."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from shatter.tools.bench.count_ops import OpCounter, mlm_batch

    engine = _bf16_zero1_engine()
    engine.backward(engine(**mlm_batch(2, 32, 300, 0))["loss"])
    opt = engine.optimizer
    tensors = sum(len(g) for g in opt.averaged_gradients.values())
    assert "scaled_global_norm" in vars(opt) and len(opt.averaged_gradients) == 2 < tensors / 10

    def norms() -> tuple[torch.Tensor, torch.Tensor, int, int]:
        counted = []
        for fn in (opt.scaled_global_norm, DeepSpeedZeroOptimizer.scaled_global_norm.__get__(opt)):
            counter = OpCounter()
            with counter, counter.counting("step"):
                norm = fn()
            counted.append((norm, counter.tally.ops["step"]))
        return counted[0][0], counted[1][0], counted[0][1], counted[1][1]

    mine, theirs, my_ops, their_ops = norms()
    assert float(theirs) > 0
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
    assert my_ops <= 8 and their_ops >= 2 * tensors, (my_ops, their_ops)  # any size: 7
    for group in (1, 0):  # the 1-D parameters' group, then both
        opt.averaged_gradients[group][1].view(-1)[0] = float("nan")
        mine, theirs, _, _ = norms()
        assert float(mine) == float(theirs) == float("inf")


def test_zero1_s_clip_without_host_reads_equals_deepspeed_s():
    """The trainer's unscale and clip (`clip_without_host_reads`: the factor made on the device,
    once for the norm the groups share) against DeepSpeed's own on a real bf16 ZeRO-1 engine's
    flat fp32 gradient: equal for a norm above the clip, one below it and an invalid one (-1:
    infinite, as DeepSpeed takes it), with no host read where DeepSpeed's reads once. With
    torch's fused AdamW as the client the factor is its `grad_scale` (the gradient left as it
    is, divided in the optimizer's kernel); with any other client, the gradient multiplied."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from shatter.tools.bench.count_ops import OpCounter
    from shatter.train.engine import clip_without_host_reads

    opt = _bf16_zero1_engine().optimizer
    client = opt.optimizer
    assert "unscale_and_clip_grads" in vars(opt) and opt.clip_grad > 0
    theirs = DeepSpeedZeroOptimizer.unscale_and_clip_grads.__get__(opt)
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    for fused in (True, False):
        for group in client.param_groups:
            group["fused"] = fused
        client.grad_scale = None  # as a client fresh from DeepSpeed
        clip_without_host_reads(opt)
        for norm in (40 * opt.clip_grad, 0.5 * opt.clip_grad, -1.0):
            got, want = grad.clone(), grad.clone()
            reads = []
            for fn, g in ((opt.unscale_and_clip_grads, got), (theirs, want)):
                counter = OpCounter()
                with counter, counter.counting("step"):
                    fn([g], torch.tensor(norm))
                reads.append(counter.tally.reads["step"])
            scale = getattr(client, "grad_scale", None)
            assert (scale is not None) == fused and (torch.equal(got, grad) or not fused)
            torch.testing.assert_close(got / scale if fused else got, want, rtol=1e-6, atol=0)
            assert reads == [0, 1], reads


def test_zero1_s_gradients_flattened_into_fp32_equal_deepspeed_s():
    """The partition's gradients of each parameter group flattened straight into fp32 by one
    multi-tensor copy (`flatten_into_fp32`) on a real bf16 ZeRO-1 engine: bit for bit
    DeepSpeed's flatten (padded to the partition's size) then cast, in two ops (an allocation,
    the copy) where DeepSpeed's make a bf16 copy and then an fp32 one."""
    from shatter.tools.bench.count_ops import OpCounter, mlm_batch

    engine = _bf16_zero1_engine()
    engine.backward(engine(**mlm_batch(2, 32, 300, 0))["loss"])
    opt = engine.optimizer
    for i, grads in opt.averaged_gradients.items():
        counter = OpCounter()
        with counter, counter.counting("step"):
            mine = opt._get_preflattened_grad_partition(i)
        size = int(opt.partition_size[i])
        theirs = opt.flatten_dense_tensors_aligned(grads, size).to(torch.float32)
        assert mine.dtype == torch.float32 and len(grads) > 5
        assert torch.equal(mine, theirs) and mine.numel() == size
        names = counter.tally.names
        assert counter.tally.ops["step"] <= 3 and names["step _foreach_copy_"] == 1, names


def test_zero1_s_streamlined_step_equals_deepspeed_s():
    """A whole bf16 ZeRO-1 step three ways from the same weights and batches, the norm above the
    clip: DeepSpeed's own; the trainer's norm, clip (its factor handed to torch's fused AdamW)
    and flattening (`optim.impl: torch`); and the one-pass step (`master`,
    train/master_step.py, under the interpreter): the same fp32 master weights to fp32
    rounding, the same bf16 weights, and no step skipped."""
    from shatter.tools.bench.count_ops import mlm_batch

    masters, weights = [], []
    for way in ("deepspeed", "torch", "master"):
        engine = _bf16_zero1_engine()
        opt = engine.optimizer
        assert ("step" in vars(opt)) == INTERPRET  # the one-pass step, where its kernel runs
        if way != "master" and INTERPRET:
            del opt.step
        if way == "deepspeed":  # DeepSpeed's methods back
            del opt.scaled_global_norm, opt.unscale_and_clip_grads
            del opt._get_preflattened_grad_partition
        start = [p.detach().clone() for p in opt.single_partition_of_fp32_groups]
        for seed in range(3):  # the warm-up's first two steps have lr 0
            engine.backward(engine(**mlm_batch(2, 32, 300, seed))["loss"])
            engine.step()
        assert (engine.global_steps, engine.skipped_steps) == (3, 0)
        assert float(opt._global_grad_norm) > 2 * opt.clip_grad  # the clip acts
        masters.append([p.detach().clone() for p in opt.single_partition_of_fp32_groups])
        weights.append([p.detach().clone() for p in engine.module.parameters()])
        assert not any(torch.equal(a, b) for a, b in zip(masters[-1], start, strict=True))
    for other in (1, 2):
        for a, b in zip(masters[0], masters[other], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(weights[0], weights[other], strict=True):
            torch.testing.assert_close(a, b, rtol=0.01, atol=1e-6)  # a bf16 rounding apart


def test_one_rank_zero1_skips_deepspeed_s_reduction_which_changes_nothing_there():
    """ZeRO-1 on one rank (contiguous gradients off: train/engine.py) on a real bf16 engine:
    DeepSpeed's bucket "all-reduce" (flatten, divide by 1, copy every gradient back) is
    skipped (`skip_one_rank_reduction`); run on the gradients the step reads, it takes a launch
    per tensor and leaves every one bit for bit as it was; the step then runs (not skipped)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from shatter.tools.bench.count_ops import OpCounter, mlm_batch

    engine = _bf16_zero1_engine()
    assert not engine.optimizer.contiguous_gradients  # one rank: no bucket
    opt = engine.optimizer
    assert "buffered_reduce_fallback" in vars(opt)  # the skip, installed
    engine.backward(engine(**mlm_batch(2, 32, 300, 0))["loss"])
    grads = [g for group in opt.averaged_gradients.values() for g in group]  # the step's
    before = [g.clone() for g in grads]
    counter = OpCounter()
    with counter, counter.counting("step"):
        DeepSpeedZeroOptimizer.buffered_reduce_fallback(opt, None, grads, torch.bfloat16)
    assert counter.tally.ops["step"] > len(grads) > 10
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))
    engine.step()
    assert (engine.global_steps, engine.skipped_steps) == (1, 0)


def test_bf16_zero1_skips_a_nonfinite_step_on_the_device_without_a_host_read():
    """bf16 ZeRO-1 with torch's fused AdamW (`skip_on_the_device`) on a real engine: a step
    whose gradient holds a NaN leaves the fp32 masters and AdamW's moments and step count as
    they were, with no host read in the step (DeepSpeed's own test reads the norm's validity);
    `skipped_steps` counts it once, and the next finite step updates the weights."""
    from shatter.tools.bench.count_ops import OpCounter, mlm_batch
    from shatter.train.engine import skipped_steps

    engine = _bf16_zero1_engine()
    opt = engine.optimizer
    assert not opt.check_grad_overflow  # DeepSpeed's host test off: the kernel skips

    def step(seed: int, nan: bool = False) -> int:
        engine.backward(engine(**mlm_batch(2, 32, 300, seed))["loss"])
        if nan:
            opt.averaged_gradients[0][1].view(-1)[0] = float("nan")
        counter = OpCounter()
        with counter, counter.counting("step"):
            engine.step()
        return counter.tally.reads["step"]

    def state() -> list[torch.Tensor]:
        masters = opt.single_partition_of_fp32_groups
        kept = [opt.optimizer.state[m][k] for m in masters for k in ("exp_avg", "step")]
        return [t.detach().clone() for t in (*masters, *kept)]

    for seed in range(3):  # the warm-up's first two steps have lr 0
        assert step(seed) == 0
    before = state()
    assert step(3, nan=True) == 0
    assert all(torch.equal(a, b) for a, b in zip(state(), before, strict=True))
    assert skipped_steps(engine) == 1 and engine.global_steps == 4
    step(4)
    after = state()
    assert all(torch.isfinite(t).all() for t in after)
    assert not torch.equal(after[0], before[0]) and skipped_steps(engine) == 1


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_skip_a_nonfinite_step_on_the_device(tmp_path, stage):
    """bf16 ZeRO-1 and ZeRO-2 on two ranks with a GPU's config (tests/train/skip_job.py: torch's
    fused AdamW, the contiguous bucket's reduce-scatter; ZeRO-2 reduces and partitions the
    gradients during the backward), with the one-pass step and with torch's AdamW stepped by
    DeepSpeed (the same masters both ways): a NaN loss on the last rank only at step 4
    leaves both ranks' fp32 masters unchanged (the norm is all-reduced: both kernels skip), the
    other steps update them (but the warm-up's two at lr 0), all stay finite, no step reads
    the host, and each rank counts one skipped step."""
    from tests.jobs import free_port, run_command
    from tests.train.runs import BIN

    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2"]
    cmd += ["--master_port", str(free_port()), "tests/train/skip_job.py", str(tmp_path), str(stage)]
    done = run_command(cmd, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["equal"], rank  # the one-pass step's masters and torch's AdamW's
        for impl, r in ((impl, rank[impl]) for impl in ("auto", "torch")):
            assert r["one_pass"] == (impl == "auto" and INTERPRET), r
            assert r["device_skip"] and r["contiguous"]
            assert r["unchanged"] == [True, True, False, False, True, False], r
            assert all(r["finite"]) and r["reads"] == [0] * 6 and r["skipped"] == 1, r


def _bf16_zero1_engine():
    """A real bf16 ZeRO-1 engine of bert-tiny on one rank, with the trainer's GPU config
    (overlap_comm off: gloo has no side streams)."""
    from shatter.train.config import resolve
    from shatter.train.engine import build_engine, deepspeed_config, init_distributed

    init_distributed()
    cfg = resolve(None, {"precision": "bf16", "zero_stage": 1, "micro_batch": 2, "max_steps": 10})
    torch.manual_seed(0)
    model = shatter.build_model("bert-tiny", vocab_size=300, max_len=64)
    ds = deepspeed_config(cfg, 1, cpu=False)
    ds["zero_optimization"]["overlap_comm"] = False
    return build_engine(model, cfg, ds)
