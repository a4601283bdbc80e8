"""`shatter::master_adamw_` (shatter/kernels/master_adamw.py): one AdamW step of an fp32 master
from a low-precision gradient, the master cast into the low-precision weights, equals torch's
fused AdamW on the fp32 master (its formulas, its `grad_scale` and `found_inf`, its step count)
and the eager reference, the cast rounding as torch's. Without a GPU the kernel runs Triton's
interpreter (tests/conftest.py)."""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton has no wheel for this platform")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device", allow_module_level=True)

from shatter.kernels.cost import OP_COSTS, op_totals  # noqa: E402
from shatter.kernels.master_adamw import (  # noqa: E402
    BLOCK,
    chunk_map,
    master_adamw_,
    master_adamw_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 2 * BLOCK + 37  # a partial last block
HYPER = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1)


def _state(low=torch.bfloat16, seed=0):
    """(master, exp_avg, exp_avg_sq, step, weight) of N parameters, as an AdamW has them."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(N, generator=g).to(DEVICE)
    zeros = [torch.zeros(N, device=DEVICE) for _ in range(2)]
    return [
        master,
        *zeros,
        torch.zeros((), device=DEVICE),
        torch.empty(N, dtype=low, device=DEVICE),
    ]


def _grads(steps, low=torch.bfloat16):
    """`steps` gradients of the N parameters, each as three tensors (a parameter's, a chunk and
    a partial chunk, and one element: a flat offset that is not a multiple of 8 after it)."""
    g = torch.Generator().manual_seed(7)
    flat = [(torch.randn(N, generator=g) * 10.0 ** -(i % 3)).to(DEVICE, low) for i in range(steps)]
    return [list(f.split([BLOCK + 5, 1, N - BLOCK - 6])) for f in flat]


def _flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _torch_adamw(master, grads, scale=None, **hyper):
    """torch.optim.AdamW(fused=True) on an fp32 copy of `master`, each gradient cast to fp32."""
    p = master.clone()
    opt = torch.optim.AdamW(
        [p], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], fused=True,
    )  # fmt: skip
    for grad in grads:
        p.grad = _flat(grad).float()
        opt.grad_scale = scale
        opt.step()
    return p, opt.state[p]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [None, 4.0])
def test_equals_torch_s_fused_adamw_and_the_reference(low, scale):
    """Four steps: the master and both moments as torch's fused AdamW makes them (fp32 rounding),
    the step count 4, the weights the master cast as torch casts it, the reference alike. ε = 1
    makes the gradient's scale matter (Adam divides it out otherwise)."""
    hyper = {**HYPER, "eps": 1.0}
    grads = _grads(4, low)
    s = torch.tensor(scale, device=DEVICE) if scale else None
    mine, ref = _state(low), _state(low)
    want, state = _torch_adamw(mine[0], grads, s, **hyper)
    for grad in grads:
        master_adamw_(grad, *mine, **hyper, grad_scale=s)
        master_adamw_reference(grad, *ref, **hyper, grad_scale=s)
    for got in (mine, ref):
        torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], state["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[2], state["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        assert float(got[3]) == float(state["step"]) == 4.0
        assert torch.equal(got[4], got[0].to(low))
    moved = (mine[0] - _state(low)[0]).abs()
    assert float(moved.min()) > 0 and float(moved.max()) > 0.05  # every element stepped


def test_a_step_with_found_inf_changes_nothing():
    """found_inf = 1: no master, moment or weight written and the step count kept (torch's fused
    AdamW's skip); found_inf = 0: the step as without it."""
    grads = _grads(2)
    mine, twin = _state(), _state()
    for state in (mine, twin):
        master_adamw_(grads[0], *state, **HYPER)
    before = [t.clone() for t in mine]
    master_adamw_(grads[1], *mine, **HYPER, found_inf=torch.ones((), device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(mine, before, strict=True))
    master_adamw_(grads[1], *mine, **HYPER, found_inf=torch.zeros((), device=DEVICE))
    master_adamw_(grads[1], *twin, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(mine, twin, strict=True))
    assert float(mine[3]) == 2.0 and not torch.equal(mine[0], before[0])


@pytest.mark.parametrize("step", [0, 9, 999, 20_000])
def test_bias_corrections_at_any_step(step):
    """1 - β^t at t = 1 (β2 = 0.9999: 1 - β2 = 1e-4, which 1 - exp(y) in fp32 gives 2e-4 off) to t
    = 20,001 (β1^t underflowed): the update as torch's fused AdamW makes it from the same moments,
    to 1e-5 of itself (small weights: their rounding is far below it)."""
    hyper = {**HYPER, "beta2": 0.9999}
    grad = _grads(1)[0]
    mine = _state()
    mine[0].mul_(1e-3)
    start = mine[0].clone()
    mine[1].copy_(torch.randn(N, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 0.1)
    mine[2].copy_(mine[1].square() * 2)
    mine[3].fill_(step)
    p = mine[0].clone()
    opt = torch.optim.AdamW(
        [p], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], fused=True,
    )  # fmt: skip
    p.grad = _flat(grad).float()
    opt.state[p].update(step=mine[3].clone(), exp_avg=mine[1].clone(), exp_avg_sq=mine[2].clone())
    opt.step()
    master_adamw_(grad, *mine, **hyper)
    torch.testing.assert_close(mine[0] - start, p - start, rtol=1e-5, atol=1e-8)
    assert torch.isfinite(mine[0]).all()


def test_a_partition_s_padding_past_the_gradients_is_left_as_it_is():
    """Gradients covering the master but its last elements (the last rank's padding): those
    are not read or written; the rest steps as the reference steps it."""
    grads = [g[:-1] for g in _grads(1)[0][:2]]  # two tensors, N - 2 - (N - BLOCK - 6) short
    mine, ref = _state(), _state()
    mine[4].zero_()
    covered = sum(g.numel() for g in grads)
    master_adamw_(grads, *mine, **HYPER)
    master_adamw_reference(grads, *ref, **HYPER)
    torch.testing.assert_close(mine[0][:covered], ref[0][:covered], rtol=1e-6, atol=1e-6)
    assert torch.equal(mine[0][covered:], _state()[0][covered:])
    assert not mine[4][covered:].any() and mine[4][:covered].all()


def test_the_chunk_map_covers_each_tensor_once():
    """Each tensor's elements are read by whole chunks of BLOCK, a partial one last, at their
    offset in the master; vector loads only where every size is a multiple of 8."""
    chunks, sizes, aligned = chunk_map((BLOCK + 5, 1, 16), torch.device("cpu"))
    rows = [tuple(r) for r in chunks.tolist()]
    assert rows == [(0, 0, 0), (0, BLOCK, BLOCK), (1, 0, BLOCK + 5), (2, 0, BLOCK + 6)]
    assert sizes.tolist() == [BLOCK + 5, 1, 16] and not aligned
    assert chunk_map((BLOCK, 24, 8), torch.device("cpu"))[2]


def test_the_op_s_registration_and_cost():
    """torch's opcheck of the custom op (its schema, its mutations, its fake); its cost: the
    addresses' copy, the step count, and one kernel reading the gradient, master and moments
    and writing them and the weights (28 bytes a parameter)."""
    mine = _state()
    grad = _grads(1)[0]
    torch.library.opcheck(
        torch.ops.shatter.master_adamw_.default, (grad, *mine, 1e-3, 0.9, 0.999, 1e-8, 0.01),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip
    kernels = OP_COSTS["shatter::master_adamw_"](
        (grad, *mine, 1e-3, 0.9, 0.999, 1e-8, 0.01), {}, None
    )
    flops, nbytes = op_totals(kernels)
    assert flops == 0 and nbytes == N * (2 + 3 * 4 * 2 + 2) + 8 * len(grad)
    assert [k.kind for k in kernels] == ["memory"] * 3  # the addresses, the count, the step
    found = {"found_inf": mine[3]}
    assert len(OP_COSTS["shatter::master_adamw_"]((grad, *mine), found, None)) == 4


@pytest.mark.gpu
def test_compiled_kernel_at_bert_base_s_size():
    """On a GPU, the compiled kernel over bert-base's 110M parameters in one flat partition: the
    master and moments as torch's fused AdamW makes them from the fp32 gradient, the bf16
    weights the master cast by torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    n = 110_000_000
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = [(torch.randn(n, device="cuda", generator=g) * 1e-3).bfloat16()]
    mine = [torch.randn(n, device="cuda", generator=g) * 0.02, torch.zeros(n, device="cuda"),
            torch.zeros(n, device="cuda"), torch.zeros((), device="cuda"),
            torch.empty(n, dtype=torch.bfloat16, device="cuda")]  # fmt: skip
    want, state = _torch_adamw(mine[0], [grad, grad], None, **HYPER)
    for _ in range(2):
        master_adamw_(grad, *mine, **HYPER, found_inf=torch.zeros((), device="cuda"))
    torch.testing.assert_close(mine[0], want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine[2], state["exp_avg_sq"], rtol=1e-6, atol=1e-12)
    assert torch.equal(mine[4], mine[0].bfloat16()) and float(mine[3]) == 2.0


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from shatter.kernels.master_adamw import master_adamw_kernel
pointers = ["*i64"] * 3 + ["*fp32"] * 3 + ["*bf16"] + ["*fp32"] * 3
names = master_adamw_kernel.arg_names
signature = dict(zip(names, pointers + ["fp32"] * 7 + ["constexpr"] * 4))
for arch in (70, 90):
    for aligned in (True, False):
        constexprs = {"HAS_SCALE": True, "HAS_FOUND": True, "ALIGNED": aligned, "BLOCK": 2048}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
        src = ASTSource(master_adamw_kernel, signature, constexprs, attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8}).asm["ptx"]
        print(arch, aligned, ptx.count("ld.global.v4"), ptx.count(".local"))
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_the_v100_and_the_h100_with_vector_loads():
    """Compiled ahead of time for sm_70 and sm_90 (no GPU needed; Triton's interpreter off):
    no local memory (spills), and 16-byte vector loads where every size is a multiple of 8
    and every address aligned, as a bert-base partition is (the `ALIGNED` hints)."""
    import subprocess
    import sys

    from tests.jobs import child_env

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 4 and all(row[3] == "0" for row in rows), rows
    assert all((int(row[2]) > 0) == (row[1] == "True") for row in rows), rows
