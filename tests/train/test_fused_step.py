"""The fused optimizer step (optim.impl torch: torch.optim.AdamW(fused=True), which DeepSpeed's
ZeRO-1 runs over its flat fp32 partition, one tensor per param group) equals the eager
per-parameter AdamW loop, with §A.2's groups (no weight decay on biases and LayerNorm weights)."""

import copy

import torch

import shatter
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
