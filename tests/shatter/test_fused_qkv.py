"""config.fused_qkv: the multi-head archs' Q, K and V from one [d, 3d] GEMM, its weight made once
per forward for every layer from the same three parameters, equal the three GEMMs of the eager
layer (values and every gradient), with the same state dict (query, key, value)."""

import math

import pytest
import torch

from tests.shatter.shatter_tiny import ids, tiny

MULTI_HEAD = ["bert", "bert-rab", "bert-rpe", "no-position", "part-mask"]


def _step(model, x, mask):
    labels = torch.where(x % 3 == 0, x, -100)
    out = model(x, mask, labels)
    out["loss"].backward()
    return out["logits"], {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", MULTI_HEAD)
def test_fused_qkv_equals_three_projections(arch, dtype):
    x = ids(2, 12)
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    fused, eager = (tiny(arch, fused_qkv=f).to(dtype) for f in (True, False))
    assert fused.state_dict().keys() == eager.state_dict().keys()
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    (got, got_g), (want, want_g) = _step(fused, x, mask), _step(eager, x, mask)
    torch.testing.assert_close(got, want, **tol)
    assert got_g.keys() == want_g.keys()
    for name, g in got_g.items():
        torch.testing.assert_close(g, want_g[name], **tol, msg=name)


def test_fused_qkv_is_one_gemm_per_layer():
    """A forward of bert-tiny (2 layers) runs 1 + 1 GEMMs per layer before the FFN with
    fused_qkv (QKV, W^O), 3 + 1 without."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm"):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for fused in (True, False):
        Count.n = 0
        with Count():
            tiny("bert", fused_qkv=fused).encoder(ids(2, 8))
        counts[fused] = Count.n
    assert counts[False] - counts[True] == 2 * 2  # two fewer GEMMs in each of the 2 layers


def test_fused_qkv_s_backward_copies_no_token_wide_gradient():
    """The backward reads SDPA's three gradients where they are: no cat (or other copy) of a
    [tokens, 3d] gradient (seen failing with the layer's `linear(...).chunk(3)`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny("bert", fused_qkv=True)
    x = ids(2, 8)
    tokens, d = x.numel(), model.config.hidden

    class Record(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                Record.ops.append((func.overloadpacket.__name__, tuple(out.shape)))
            return out

    loss = model(x, None, torch.where(x % 3 == 0, x, -100))["loss"]
    with Record():
        loss.backward()
    wide = [op for op in Record.ops if op[1][-1:] == (3 * d,) and math.prod(op[1][:-1]) == tokens]
    assert not [op for op in wide if op[0] in ("cat", "clone", "copy_", "_to_copy")], wide
    assert model.encoder.layers[0].attention.query.weight.grad is not None


def test_fused_qkv_s_backward_makes_only_the_gradients_asked_for():
    """With the weights frozen (a finetune's frozen encoder), the backward makes dx alone: no
    weight-gradient GEMM, no bias sum, and the input's gradient is as with the weights live."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny("bert", fused_qkv=True)
    x = ids(2, 8)
    labels = torch.where(x % 3 == 0, x, -100)
    embeds = model.encoder.embeddings.word_embeddings.weight
    want = torch.autograd.grad(model(x, None, labels)["loss"], embeds)[0]
    for name, p in model.named_parameters():
        p.requires_grad_("embeddings" in name)
    d, tokens = model.config.hidden, x.numel()

    class Shapes(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("mm", "sum") and isinstance(out, torch.Tensor):
                Shapes.seen.append(tuple(out.shape))
            return out

    loss = model(x, None, labels)["loss"]
    with Shapes():
        got = torch.autograd.grad(loss, embeds)[0]
    assert (d, d) not in Shapes.seen and (d,) not in Shapes.seen, Shapes.seen
    assert (tokens, d) in Shapes.seen  # dx was made
    torch.testing.assert_close(got, want)
