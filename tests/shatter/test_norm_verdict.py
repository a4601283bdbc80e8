"""The optimizer step's scalars in one kernel (shatter/kernels/norm_verdict.py): equal to the
bit to torch's one-element ops (`norm_verdict_reference`, DeepSpeed's step as the trainer ran
it) for finite, zero, NaN and infinite sums of squares, with and without clipping; its op's
registration and cost; compiled ahead of time for the V100 and the H100. Under Triton's
interpreter (tests/conftest.py)."""

import os

import pytest
import torch

from shatter.kernels.cost import OP_COSTS, op_totals
from shatter.kernels.launch import INTERPRET
from shatter.kernels.norm_verdict import MAX_STEPS, norm_verdict, norm_verdict_reference

needs_kernel = pytest.mark.skipif(not INTERPRET, reason="the kernel needs TRITON_INTERPRET=1 here")
INF = float("inf")


def _both(squares: float, clip: float, fresh: bool, groups: int = 2):
    """(the kernel's, the reference's) outputs, skipped count and step counts."""
    out = []
    for fn in (norm_verdict, norm_verdict_reference):
        skipped = torch.tensor(2.0)
        steps = [torch.tensor(3.0 + i) for i in range(groups)]
        norm, bad, factor = fn(torch.tensor(squares), skipped, steps, clip, fresh)
        out.append([norm, bad, factor, skipped, *steps])
    return out


@needs_kernel
@pytest.mark.parametrize("squares", [4.0, 0.0, 2.5e-3, 1e30, float("nan"), INF])
@pytest.mark.parametrize("clip", [0.0, 1.0, 0.3])
def test_equals_torch_s_one_element_ops_to_the_bit(squares, clip):
    for fresh in (True, False):
        mine, theirs = _both(squares, clip, fresh)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (mine, theirs)


@needs_kernel
def test_a_nonfinite_norm_skips_and_keeps_the_step_counts():
    """A NaN or inf sum: norm inf, bad 1, the skip counted, every group's step count kept; a
    finite one: bad 0, each count up by one, the clip's divisor at least 1."""
    for squares in (float("nan"), INF):
        norm, bad, factor, skipped, *steps = _both(squares, 1.0, False, groups=MAX_STEPS)[0]
        assert (float(norm), float(bad), float(factor), float(skipped)) == (INF, 1.0, INF, 3.0)
        assert [float(s) for s in steps] == [3.0, 4.0, 5.0, 6.0]
    norm, bad, factor, skipped, *steps = _both(16.0, 2.0, True, groups=1)[0]
    assert (float(norm), float(bad), float(skipped), [float(s) for s in steps]) == (4, 0, 0, [4])
    assert float(factor) == pytest.approx(2.0) and float(_both(1.0, 2.0, True)[0][2]) == 1.0


def test_the_op_s_registration_and_cost():
    """torch's opcheck (its schema, its mutations, its fake); one kernel, no FLOPs; more step
    counts than one launch serves are refused."""
    args = (torch.tensor(4.0), torch.tensor(0.0), [torch.tensor(1.0)] * 2, 1.0, False)
    torch.library.opcheck(
        torch.ops.shatter.norm_verdict.default, args, test_utils=("test_schema", "test_faketensor")
    )
    kernels = OP_COSTS["shatter::norm_verdict"](args, {}, None)
    assert len(kernels) == 1 and op_totals(kernels)[0] == 0
    with pytest.raises(ValueError, match="at most"):
        norm_verdict(args[0], args[1], [torch.tensor(0.0)] * (MAX_STEPS + 1), 1.0, False)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shatter.kernels.norm_verdict import norm_verdict_kernel
names = norm_verdict_kernel.arg_names
signature = dict(zip(names, ["*fp32"] * 9 + ["fp32"] + ["constexpr"] * 3))
constexprs = {"CLIP": True, "FRESH": False, "STEPS": 2}
for arch in (70, 90):
    src = ASTSource(norm_verdict_kernel, signature, constexprs, {})
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 1}).asm["ptx"]
    print(arch, ptx.count("sqrt.rn.f32"), ptx.count("div.rn.f32"), ptx.count(".local"))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_the_v100_and_the_h100_with_ieee_rounding():
    """Compiled ahead of time for sm_70 and sm_90 (Triton's interpreter off): the root and the
    division rounded as IEEE's (torch's), no local memory."""
    import subprocess
    import sys

    from tests.jobs import child_env

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 2 and all(r[1] != "0" and r[2] != "0" and r[3] == "0" for r in rows), rows


@pytest.mark.gpu
def test_on_a_gpu_equals_the_reference_and_the_norms_are_one_buffer():
    """On a GPU: the kernel equals torch's ops to the bit (finite, NaN, inf); `_foreach_norm`'s
    results are the elements of one buffer, which train/engine.py's `joined` takes as it is."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from shatter.train.engine import joined

    for squares in (4.0, 2.5e-3, float("nan"), INF):
        outs = []
        for fn in (norm_verdict, norm_verdict_reference):
            skipped, steps = torch.tensor(2.0, device="cuda"), [torch.ones((), device="cuda")]
            out = fn(torch.tensor(squares, device="cuda"), skipped, steps, 1.0, False)
            outs.append([*out, skipped, *steps])
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True)), outs
    grads = [torch.randn(n, device="cuda") for n in (5, 300, 70_000)]
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    flat = joined(norms)
    assert flat.data_ptr() == norms[0].data_ptr() and flat.numel() == 3
    torch.testing.assert_close(flat, torch.stack([g.norm() for g in grads]))
