"""Inductor's mix-order final reductions, one torch op a kernel (train/mix_order.py): the merged
lines compute what inductor's lines compute, in both torch wordings of them, and anything else is
left as inductor wrote it. tests/tools/test_step_cost.py plans a real compiled step with them."""

import pytest
import torch

from shatter.train.mix_order import FINAL, finish_in_one, finished_or_as_is, merged

# torch 2.13's wording (the sizes in parentheses, each gradient's shape restored) and 2.11's
# (no parentheses, no view, a cast where the gradient is not fp32)
NEW = "{buf} = ws_0[{i} * (16) * (24) : ({i} + 1) * (16) * (24)].view(16, 24).{op}(dim=0).view([2, 12])"
OLD = (
    "{buf} = ws_0[{i} * 16 * 24 : ({i} + 1) * 16 * 24].view(16, 24).{op}(dim=0).to(torch.bfloat16)"
)


def _run(lines: list[str], workspace: torch.Tensor) -> dict:
    scope = {"torch": torch, "ws_0": workspace}
    exec("\n".join(lines), scope)
    return {k: v for k, v in scope.items() if k.startswith("buf")}


@pytest.mark.parametrize("wording", [NEW, OLD], ids=["torch-2.13", "torch-2.11"])
@pytest.mark.parametrize(("op", "parts"), [("sum", 2), ("sum", 3), ("amax", 2)])
def test_one_reduction_gives_each_gradient_inductor_s_lines_give(wording, op, parts):
    lines = [wording.format(buf=f"buf{7 + i}", i=i, op=op) for i in range(parts)]
    assert all(FINAL.fullmatch(line) for line in lines)
    workspace = torch.randn(parts * 16 * 24 + 5, generator=torch.Generator().manual_seed(0))
    want, got = _run(lines, workspace), _run(merged(lines), workspace)
    assert sum(f".{op}(" in line for line in merged(lines)) == 1
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6)


def test_the_casts_of_the_gradients_are_one_cast_of_the_rows():
    """The casts inductor would run as kernels of their own (to bf16, a LayerNorm's weight and
    bias gradients) made from the merged rows by one `.to`."""
    lines = [NEW.format(buf=f"buf{7 + i}", i=i, op="sum") for i in range(3)]
    casts = {"buf7": ("buf20", "torch.bfloat16", "[2, 12]"), "buf9": ("buf21", "torch.bfloat16", "[24]")}  # fmt: skip
    out = merged(lines, casts)
    assert sum(".to(" in line for line in out) == 1
    workspace = torch.randn(3 * 16 * 24, generator=torch.Generator().manual_seed(0))
    got = _run(out, workspace)
    want = _run(lines, workspace)
    assert got.keys() == {*want, "buf20", "buf21"}
    torch.testing.assert_close(got["buf20"], want["buf7"].to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(got["buf21"], want["buf9"].to(torch.bfloat16).view(24), rtol=0, atol=0)  # fmt: skip
    assert got["buf20"].shape == (2, 12) and got["buf21"].dtype == torch.bfloat16


def test_gradients_read_by_their_casts_alone_are_one_kernel():
    """Where nothing reads the fp32 gradients but their casts, the sums and the casts are one
    kernel (shatter::partial_sums) and the fp32 gradients are not made."""
    import shatter.kernels.partial_sums  # noqa: F401  (registers the op)

    lines = [NEW.format(buf=f"buf{7 + i}", i=i, op="sum") for i in range(2)]
    casts = {"buf7": ("buf20", "torch.bfloat16", "[2, 12]"), "buf8": ("buf21", "torch.bfloat16", "[24]")}  # fmt: skip
    out = merged(lines, casts, unread=True)
    assert sum("(" in line for line in out) == 3 and "partial_sums" in out[0]  # one op, 2 views
    workspace = torch.randn(2 * 16 * 24, generator=torch.Generator().manual_seed(0))
    got, want = _run(out, workspace), _run(lines, workspace)
    assert got.keys() == {"buf20", "buf21"}
    torch.testing.assert_close(got["buf20"], want["buf7"].to(torch.bfloat16))
    torch.testing.assert_close(got["buf21"], want["buf8"].to(torch.bfloat16).view(24))
    # a gradient without a cast, or an amax: the sums in torch, the fp32 gradients made
    assert "partial_sums" not in merged(lines, dict(list(casts.items())[:1]), unread=True)[0]
    amax = [NEW.format(buf=f"buf{7 + i}", i=i, op="amax") for i in range(2)]
    assert "partial_sums" not in merged(amax, casts, unread=True)[0]


def test_other_lines_are_written_as_inductor_wrote_them():
    one = NEW.format(buf="buf2", i=0, op="sum")
    second = NEW.format(buf="buf3", i=1, op="sum")
    assert merged([one]) == [one]
    assert merged([one, NEW.format(buf="buf3", i=2, op="sum")]) == [one, NEW.format(buf="buf3", i=2, op="sum")]  # fmt: skip
    assert merged([one, second.replace("ws_0", "ws_1")]) == [one, second.replace("ws_0", "ws_1")]
    assert merged([one, NEW.format(buf="buf3", i=1, op="amin")])[0] == one  # another op
    assert merged([one, OLD.format(buf="buf3", i=1, op="sum")])[0] == one  # another cast
    assert not FINAL.fullmatch("buf2 = torch.ops.aten.sum(ws_0)")


def test_a_scheduler_read_otherwise_keeps_inductor_s_lines_and_says_so():
    lines = [NEW.format(buf=f"buf{7 + i}", i=i, op="sum") for i in range(2)]
    with pytest.warns(UserWarning, match="mix-order lines kept as written"):
        assert finished_or_as_is(object(), object(), lines) == lines


def test_finish_in_one_installs_once():
    from torch._inductor.codegen.simd import SIMDScheduling

    assert finish_in_one() and finish_in_one()
    codegen = SIMDScheduling._codegen_mix_order_reduction
    assert codegen.finishes_in_one and not getattr(codegen.__wrapped__, "finishes_in_one", False)
    # inductor's graph cache keyed on this change (its custom passes' uuids are in the key)
    assert torch._inductor.config.post_grad_custom_post_pass.uuid()


@pytest.mark.gpu
def test_on_a_gpu_a_compiled_layernorm_s_gradients_equal_eager_s_from_one_sum_a_kernel():
    """On a GPU, inductor's real wrapper: a bf16 LayerNorm at a size inductor folds (8,192 rows
    of 1,280) finishes both gradients in one kernel, equal to the eager ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch._inductor.utils import run_and_get_code

    finish_in_one()
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(1280, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(8192, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def grads(fn):
        norm.zero_grad()
        x.grad = None
        fn(x).backward(dy)
        return [x.grad, norm.weight.grad, norm.bias.grad]

    want = grads(norm)
    torch._dynamo.reset()
    got, code = run_and_get_code(lambda: grads(torch.compile(norm)))
    wrapper = "\n".join(code)
    assert "shatter.partial_sums" in wrapper, "no mix-order kernel, or its sums not finished in one"
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
