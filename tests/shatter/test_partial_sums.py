"""A mix-order reduction's gradients finished in one kernel (shatter/kernels/partial_sums.py):
equal to torch's sum and cast (`partial_sums_reference`) at sizes off the kernel's blocks, in
each dtype a gradient takes; its op's registration and cost; compiled ahead of time for the V100
and the H100. Under Triton's interpreter (tests/conftest.py)."""

import os

import pytest
import torch

from shatter.kernels.cost import OP_COSTS, op_totals
from shatter.kernels.launch import INTERPRET
from shatter.kernels.partial_sums import partial_sums, partial_sums_reference

needs_kernel = pytest.mark.skipif(not INTERPRET, reason="the kernel needs TRITON_INTERPRET=1 here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("parts", "rows", "width"), [(2, 128, 768), (3, 37, 200), (1, 1, 5)])
def test_the_kernel_equals_torch_s_sum_and_cast(dtype, parts, rows, width):
    g = torch.Generator().manual_seed(parts * rows + width)
    ws = torch.randn(parts * rows * width + 7, generator=g) * 3  # a longer workspace
    got = partial_sums(ws, parts, rows, width, dtype)
    want = partial_sums_reference(ws, parts, rows, width, dtype)
    assert got.dtype == dtype and got.shape == (parts, width)
    exact = torch.float32 if dtype == torch.float32 else dtype
    tol = dict(rtol=1e-5, atol=1e-4) if exact == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    # each gradient its own block: a gradient's rows do not reach into the next one's
    ws[: rows * width] = 0
    assert partial_sums(ws, parts, rows, width, dtype)[0].abs().max() == 0


def test_the_op_is_registered_priced_and_refuses_another_workspace():
    args = (torch.randn(2 * 8 * 16), 2, 8, 16, torch.bfloat16)
    torch.library.opcheck(
        torch.ops.shatter.partial_sums.default, args, test_utils=("test_schema", "test_faketensor")
    )
    kernels = OP_COSTS["shatter::partial_sums"](args, {}, None)
    assert len(kernels) == 1 and op_totals(kernels) == (0.0, 4 * 2 * 8 * 16 + 2 * 2 * 16)
    with pytest.raises(ValueError, match="1-D fp32 workspace of at least 256"):
        partial_sums(torch.randn(255), 2, 8, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        partial_sums(torch.randn(256).bfloat16(), 2, 8, 16, torch.bfloat16)


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_equals_torch_s_sum_and_cast():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ws = torch.randn(2 * 1056 * 768, device="cuda")
    got = partial_sums(ws, 2, 1056, 768, torch.bfloat16)
    torch.testing.assert_close(got, partial_sums_reference(ws, 2, 1056, 768, torch.bfloat16))


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shatter.kernels.partial_sums import BLOCK_R, BLOCK_W, partial_sums_kernel
signature = {"WS": "*fp32", "OUT": "*bf16", "ROWS": "i32", "WIDTH": "i32",
             "BLOCK_R": "constexpr", "BLOCK_W": "constexpr"}
for arch in (70, 90):
    src = ASTSource(partial_sums_kernel, signature, {"BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W}, {})
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}).asm["ptx"]
    print(arch, ptx.count("ld.global"), ptx.count(".local"))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_the_v100_and_the_h100():
    """Compiled ahead of time for sm_70 and sm_90 (Triton's interpreter off): global loads,
    no local memory."""
    import subprocess
    import sys

    from tests.jobs import child_env

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 2 and all(r[1] != "0" and r[2] == "0" for r in rows), rows
