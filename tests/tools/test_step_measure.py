"""tools/bench/step_measure.py's parts that mean something without a GPU: the profiler trace's
split into the model's groups, and the ZeRO-1 step it times."""

import pytest
import torch

from shatter.kernels.launch import INTERPRET
from shatter.tools.bench.step_measure import Zero1, split_kernels


def _cpu(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur}


def _launch(ts, correlation):
    args = {"correlation": correlation}
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "args": args}  # fmt: skip


def _kernel(name, correlation, dur, cat="kernel"):
    args = {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": 1000 + correlation, "dur": dur, "args": args}  # fmt: skip


def _trace():
    """A chrome trace as torch.profiler exports it: CPU ranges, launches, kernels."""
    cpu, launch, kernel = _cpu, _launch, _kernel
    return [
        cpu("aten::mm", 0, 10), launch(1, 1), kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 1, 50),
        cpu("shatter::partition_mix", 20, 30), launch(21, 2), kernel("mix_fwd_kernel", 2, 40),
        launch(25, 3), kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 3, 20),  # a GEMM inside the op
        cpu("aten::_scaled_dot_product_flash_attention", 60, 5), launch(61, 4), kernel("flash_fwd_kernel", 4, 30),
        cpu("aten::add", 70, 5), launch(71, 5), kernel("triton_poi_fused_add_0", 5, 7),
        launch(75, 6), kernel("Memset (Device)", 6, 2, cat="gpu_memset"),
        {"ph": "X", "cat": "user_annotation", "name": "step_measure::optimizer", "ts": 100, "dur": 50},
        launch(101, 7), kernel("at::native::vectorized_gemm_like_name_copy", 7, 9),
        launch(102, 8), kernel("fused_adamw_kernel", 8, 11),
        launch(300, 9),  # a launch whose kernel the trace lacks: nothing counted
        cpu("shatter::linear_gelu", 400, 10), launch(401, 10), kernel("linear_gelu_kernel", 10, 13),
        cpu("shatter::partial_sums", 500, 10), launch(501, 11), kernel("partial_sums_kernel", 11, 3),
    ]  # fmt: skip


def test_kernels_are_grouped_by_the_range_they_were_launched_in_then_by_name():
    split = split_kernels(_trace())
    assert split["gemm"] == 50 + 13  # the FFN's GEMM with GELU in its epilogue is a GEMM
    assert split["attention"] == 40 + 20 + 30  # the op's own GEMM is the op's
    assert split["elementwise"] == 7 + 2 + 3  # the LayerNorm gradients' sums (an op of ours)
    assert split["optimizer"] == 9 + 11  # a GEMM-like name inside the optimizer is the optimizer's
    assert split["kernels"] == 10
    assert sum(t for t, _ in split["by_name"].values()) == 63 + 90 + 12 + 20


@pytest.mark.parametrize("one_pass", [False, True], ids=["torch", "one-pass"])
def test_zero1_steps_as_adamw_over_fp32_masters_and_keeps_parameters_views_of_a_group_buffer(
    one_pass,
):
    """Either way the trainer steps (DeepSpeed stepping torch's fused AdamW; bf16's one-pass
    step, its kernels under Triton's interpreter here): AdamW's update of every parameter, the
    parameters views of their group's flat buffer, the gradients released."""
    if one_pass and not INTERPRET:
        pytest.skip("the one-pass step's kernels run here under TRITON_INTERPRET=1 only")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = Zero1(model, one_pass=one_pass)
    grads = [torch.randn_like(r) for r in reference]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.to(torch.bfloat16)
    opt.step()
    adamw = torch.optim.AdamW(reference, lr=1e-4, weight_decay=0.01)
    for r, g in zip(reference, grads):
        r.grad = g.to(torch.bfloat16).float()
    adamw.step()
    flats = {g.flat.untyped_storage().data_ptr() for g in opt.groups}
    assert len(flats) == 2  # the weights; the biases
    for p, r in zip(model.parameters(), reference):
        assert p.untyped_storage().data_ptr() in flats
        torch.testing.assert_close(p.float(), r.detach().to(torch.bfloat16).float())
    assert all(p.grad is None for p in model.parameters())
