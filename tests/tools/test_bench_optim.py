"""tools/bench/bench_optim.py's three ways of bf16 ZeRO-1's update, each run once on CPU tensors
under Triton's interpreter (the timing itself needs a GPU): each steps the fp32 master and writes
its bf16 cast into the weights."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheel for this platform")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_each_way_steps_the_master_and_writes_the_weights():
    from shatter.tools.bench.bench_optim import _steps

    torch.manual_seed(0)
    n, ways, state = _steps("bert-tiny", "cpu")
    assert n > 100_000 and set(ways) == {"torch", "master", "flat"}
    for count, name in enumerate(ways, start=1):
        before = state["master"].clone()
        ways[name]()
        assert not torch.equal(state["master"], before) and float(state["step"]) == count
        assert torch.equal(state["weight"], state["master"].bfloat16()), name
