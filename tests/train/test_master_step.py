"""`optim.impl` `master` and `auto` (train/master_step.py): bf16 ZeRO-1/2's step in one kernel a
parameter group, on real DeepSpeed engines (one rank here; two ranks, ZeRO-1 and ZeRO-2, in
tests/train/test_fused_step.py). Its kernel runs on CPU tensors under Triton's interpreter
(tests/conftest.py); without it `auto` keeps DeepSpeed's step."""

import pytest
import torch

import shatter
from shatter.kernels.launch import INTERPRET
from shatter.tools.bench.count_ops import OpCounter, mlm_batch
from shatter.train.config import ConfigError, resolve
from shatter.train.engine import build_engine, deepspeed_config, init_distributed

needs_kernel = pytest.mark.skipif(not INTERPRET, reason="the kernel needs TRITON_INTERPRET=1 here")


def _engine(
    impl: str, precision: str = "bf16", stage: int = 1, gpu_config: bool = True, accum: int = 1
):
    init_distributed()
    cfg = resolve(
        None,
        {"precision": precision, "zero_stage": stage, "micro_batch": 2, "max_steps": 10,
         "optim_impl": impl, "grad_accum": accum},
    )  # fmt: skip
    torch.manual_seed(0)
    model = shatter.build_model("bert-tiny", vocab_size=300, max_len=64)
    ds = deepspeed_config(cfg, 1, cpu=not gpu_config)
    ds["zero_optimization"]["overlap_comm"] = False
    return build_engine(model, cfg, ds)


def _train(engine, seeds) -> None:
    """A forward, backward and `engine.step` per seed (a micro-step under accumulation)."""
    for seed in seeds:
        engine.backward(engine(**mlm_batch(2, 32, 300, seed))["loss"])
        engine.step()


@needs_kernel
def test_auto_takes_the_one_pass_step_in_fewer_kernels():
    """`auto` on a GPU's bf16 ZeRO-1 config takes the one-pass step; its step launches fewer
    kernels than the same step by torch's fused AdamW under DeepSpeed, and neither reads the
    host."""
    counts = {}
    for impl in ("auto", "torch"):
        engine = _engine(impl)
        assert ("step" in vars(engine.optimizer)) == (impl == "auto")
        _train(engine, range(2))
        engine.backward(engine(**mlm_batch(2, 32, 300, 2))["loss"])
        counter = OpCounter()
        with counter, counter.counting("step"):
            engine.step()
        counts[impl] = (counter.tally.ops["step"], counter.tally.reads["step"])
    assert counts["auto"][1] == counts["torch"][1] == 0
    assert counts["auto"][0] < counts["torch"][0], counts


def test_a_forced_master_it_cannot_serve_says_why():
    """`master` where the one-pass step does not apply (the CPU's own AdamW; fp16's loss-scaled
    step; ZeRO-3) ends in one error naming the option and the fix; `auto` there keeps DeepSpeed's
    step."""
    cases = [
        (dict(gpu_config=False), "torch's fused AdamW"),
        (dict(stage=3), "ZeRO stage 1 or 2"),
    ]
    for kwargs, why in cases:
        with pytest.raises(ConfigError, match=f"optim.impl master: .*{why}.*auto or torch"):
            _engine("master", **kwargs)
        assert "step" not in vars(_engine("auto", **kwargs).optimizer)


@needs_kernel
def test_a_run_resumes_across_impls(tmp_path):
    """The moments and step count are torch's AdamW's own state either way: a checkpoint saved by
    one impl, loaded by the other, steps on as the first would have (fp32 rounding), in both
    directions."""
    ends = {}
    for first, second in (("torch", "master"), ("master", "torch"), ("torch", "torch")):
        engine = _engine(first)
        _train(engine, range(3))
        engine.save_checkpoint(str(tmp_path / first / second), tag="t")
        resumed = _engine(second)
        resumed.load_checkpoint(str(tmp_path / first / second), tag="t")
        _train(resumed, range(3, 5))
        state = resumed.optimizer.optimizer.state
        assert all(float(s["step"]) == 5 for s in state.values())
        ends[first, second] = [
            m.detach().clone() for m in resumed.optimizer.single_partition_of_fp32_groups
        ]
    for pair in (("torch", "master"), ("master", "torch")):
        for a, b in zip(ends[pair], ends["torch", "torch"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("stage", [1, 2])
def test_accumulated_gradients_step_as_deepspeed_s(stage):
    """Two micro-batches a step, ZeRO-1 and ZeRO-2 on one rank: the one-pass step reads the
    accumulated gradients DeepSpeed holds at the boundary; three steps end where torch's AdamW
    stepped by DeepSpeed ends (fp32 rounding)."""
    ends = []
    for impl in ("master", "torch"):
        engine = _engine(impl, stage=stage, accum=2)
        assert ("step" in vars(engine.optimizer)) == (impl == "master")
        start = [m.detach().clone() for m in engine.optimizer.single_partition_of_fp32_groups]
        _train(engine, range(6))
        assert engine.global_steps == 3
        ends.append([m.detach().clone() for m in engine.optimizer.single_partition_of_fp32_groups])
        assert not any(torch.equal(a, b) for a, b in zip(ends[-1], start, strict=True))
    for a, b in zip(*ends, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
