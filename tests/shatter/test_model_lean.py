"""The memory-lean partition mixing equals the naive reference, forward and gradients, and
keeps far fewer activations for the backward pass."""

import pytest
import torch

from shatter.attention.lean import PartitionMix, partition_mix_lean, partition_mix_naive
from shatter.partition import partition_table
from shatter.tools.bench.bench_model import saved_bytes
from tests.shatter.shatter_tiny import ids, tiny

SINGLE_HEAD = ["1h-softmax", "1h-sigmoid", "part-bias", "shatter"]


def _inputs(bias: bool, dtype=torch.float64, B=2, L=7, n=4, k=3):
    g = torch.Generator().manual_seed(0)
    Z0 = torch.randn(B, L, L, generator=g, dtype=dtype, requires_grad=True)
    c = torch.randn(B, L, n, generator=g, dtype=dtype, requires_grad=True) if bias else None
    V = torch.randn(B, n, L, k, generator=g, dtype=dtype, requires_grad=True)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 5:] = False
    table = partition_table(n, 1, 3, max_len=16, dtype=dtype)
    return Z0, c, V, mask, table


@pytest.mark.slow
@pytest.mark.parametrize("sigmoid", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_lean_kernel_gradcheck(sigmoid, bias):
    Z0, c, V, mask, table = _inputs(bias)
    args = (Z0, c, V) if bias else (Z0, V)

    def f(*a):
        return PartitionMix.apply(a[0], a[1] if bias else None, a[-1], mask, table, sigmoid)

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("sigmoid", [True, False])
def test_lean_kernel_equals_naive(sigmoid):
    Z0, c, V, mask, table = _inputs(True)
    g_out, g_part = (
        torch.randn(2, 4, 7, 3, dtype=torch.float64),
        torch.randn(2, 7, 4, dtype=torch.float64),
    )
    results = []
    for mix in (partition_mix_lean, partition_mix_naive):
        out, part = mix(Z0, c, V, mask, table, sigmoid)
        grads = torch.autograd.grad((out * g_out).sum() + (part * g_part).sum(), (Z0, c, V))
        results.append((out, part, *grads))
    for lean, naive in zip(*results):
        torch.testing.assert_close(lean, naive)


@pytest.mark.parametrize("arch", SINGLE_HEAD)
def test_lean_model_equals_naive_forward_and_gradients(arch):
    lean = tiny(arch)
    naive = tiny(arch, seed=1, attention_impl="naive")
    naive.load_state_dict(lean.state_dict())
    x = ids(2, 24)
    mask = torch.ones_like(x)
    mask[0, 17:] = 0
    labels = torch.where(
        torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.3, x, -100
    )
    outs = [m(x, mask, labels) for m in (lean, naive)]
    torch.testing.assert_close(outs[0]["logits"], outs[1]["logits"], rtol=1e-5, atol=1e-5)
    for out in outs:
        out["loss"].backward()
    for (name, p), q in zip(lean.named_parameters(), naive.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lean_keeps_a_fraction_of_the_naive_activations():
    x = ids(2, 256)
    batch = {
        "input_ids": x,
        "attention_mask": torch.ones_like(x),
        "labels": torch.where(x % 7 == 0, x, -100),
    }
    lean = saved_bytes(tiny("shatter", max_len=256).train(), batch)
    naive = saved_bytes(tiny("shatter", max_len=256, attention_impl="naive").train(), batch)
    # naive keeps A ⊙ N ([B, n, L, L], n = 4) and more per layer; lean keeps one [B, L, L]
    assert lean[0] < 0.5 * naive[0]  # the whole model
    assert lean[1] < 0.25 * naive[1]  # inside the attention modules
