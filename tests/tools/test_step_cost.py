"""tools/bench/step_cost.py: the traced step's FLOPs against train/cost.py, the pricing of a
hand-made trace (a custom op per kernel), SDPA's kernel with and without padding, ZeRO-1's share of
the optimizer per rank, the compiled step from inductor's own plan (tools/bench/inductor_plan.py:
what it keeps of the trace, what inductor fuses, the eager regions), --config, and the --json
figures' shape (tiny models on meta tensors: seconds; each inductor plan of a tiny model about
15 s, once per module: a private plan cache)."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.eager import eager_region
from shatter.kernels.launch import INTERPRET
from shatter.tools.bench.inductor_plan import WRAPPER, planned
from shatter.tools.bench.step_cost import (
    EFFICIENCY,
    REPLAY_VOCAB,
    SPLIT,
    cost_py_flops,
    gpus,
    kernel_seconds,
    main,
    model_flops,
    price,
)
from shatter.tools.bench.step_trace import StepTrace, build_meta, records, trace_step

ROWS, LENGTH, VOCAB = 4, 64, 1000


@pytest.fixture(scope="module", autouse=True)
def plan_cache(tmp_path_factory):
    """One inductor plan cache for the module's tests (not the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHATTER_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))
        yield


def _trace(arch, impl=None, optimizer="zero1", **kw):
    return records(_step(arch, impl, optimizer, **kw))


def _step(
    arch, impl=None, optimizer="zero1", padding=False, low=torch.bfloat16, flash=True, world=1,
    vocab=VOCAB, max_len=128,
) -> StepTrace:  # fmt: skip
    model = build_meta(
        shatter.build_model,
        arch,
        "tiny",
        vocab,
        max_len,
        torch.float32 if optimizer == "fused" else low,
        impl,
    )
    return trace_step(model, LENGTH, ROWS, optimizer, low, flash, padding_mask=padding, world=world)


@pytest.mark.parametrize(
    "arch, impl",
    [("bert", None), ("shatter", "naive"), ("shatter", "lean"), ("shatter", "triton"), ("shatter", "fused")],
)  # fmt: skip
def test_trace_flops_per_token_match_cost_py(arch, impl):
    """Products only, SDPA's recomputation left out: the convention train/cost.py counts in."""
    if impl in ("triton", "fused"):
        pytest.importorskip("triton")  # its custom ops trace on meta tensors with no GPU
    traced = model_flops(_trace(arch, impl)) / (ROWS * LENGTH)
    counted = cost_py_flops(arch, LENGTH, ROWS, "tiny", VOCAB)
    assert traced == pytest.approx(counted, rel=0.02)


def test_pricing_of_a_hand_made_trace():
    h100 = gpus()["H100"]
    peak, bw = h100.peak, h100.bandwidth
    mix = [["Z", "gemm", 1e12, 1e6], ["mixing", "custom", 1e11, 4e9], ["stats", "memory", 0, 1e9]]
    rows = [  # a GEMM bound by its FLOPs, one bound by its bytes, an elementwise op twice, AdamW,
        # a custom op of three kernels
        dict(phase="forward", kind="gemm", flops=1e12, model_flops=1e12, bytes=1e6, launches=1, count=1),
        dict(phase="backward", kind="gemm", flops=1e6, model_flops=1e6, bytes=1e10, launches=1, count=1),
        dict(phase="forward", kind="memory", flops=0, model_flops=0, bytes=3e9, launches=1, count=2),
        dict(phase="backward", kind="flash", flops=2e12, model_flops=1.6e12, bytes=1e6, launches=1, count=1),
        dict(phase="optimizer", kind="memory", flops=0, model_flops=0, bytes=2e9, launches=2, count=1),
        dict(op="shatter::op", phase="forward", kind="custom", flops=1.1e12, model_flops=2e12,
             bytes=5e9 + 1e6, launches=3, count=1, kernels=mix),
    ]  # fmt: skip
    split = price(rows, h100)
    mem = EFFICIENCY["memory"] * bw
    assert split["gemm"] == pytest.approx(1e12 / (EFFICIENCY["gemm"] * peak) + 1e10 / mem)
    assert split["elementwise"] == pytest.approx(2 * 3e9 / mem)
    # each kernel the slower of its FLOPs (at its kind's rate) and its bytes, not in series
    custom = 1e12 / (EFFICIENCY["gemm"] * peak) + 4e9 / mem + 1e9 / mem
    assert split["attention"] == pytest.approx(2e12 / (EFFICIENCY["flash"] * peak) + custom)
    assert split["optimizer"] == pytest.approx(2e9 / mem)
    assert split["kernels"] == 10
    assert split["launches"] == pytest.approx(10 * EFFICIENCY["launch_us"] * 1e-6)
    assert split["total"] == pytest.approx(sum(split[k] for k in SPLIT))
    assert model_flops(rows) == pytest.approx(1e12 + 1e6 + 1.6e12 + 2e12)
    accum = price(rows, h100, accum=2)  # two forward-backward passes, one optimizer step
    assert accum["optimizer"] == split["optimizer"]
    assert accum["gemm"] == pytest.approx(2 * split["gemm"])
    assert accum["kernels"] == 2 * 8 + 2


def test_custom_ops_are_priced_per_kernel():
    """The triton impl's ops carry their kernels (cuBLAS GEMMs, Triton mixing), one launch each;
    on sm_90 (the default family) the forward's are two Triton kernels (Z made by the row
    statistics), and δ is made in the dZ kernel."""
    pytest.importorskip("triton")
    custom = [r for r in _trace("shatter", "triton") if r["kind"] == "custom"]
    assert {r["op"] for r in custom} == {"shatter::mixing_fwd", "shatter::mixing_bwd"}
    for r in custom:
        assert r["launches"] == len(r["kernels"]) > 1
        kinds = [k[1] for k in r["kernels"]]
        if r["op"] == "shatter::mixing_fwd":
            assert kinds == ["custom", "custom"]
        else:
            assert {"gemm", "custom"} <= set(kinds) <= {"gemm", "custom", "memory"}
            assert "δ" not in [k[0] for k in r["kernels"]]
        assert r["flops"] == sum(k[2] for k in r["kernels"])
        assert r["bytes"] == sum(k[3] for k in r["kernels"])


@pytest.mark.parametrize("arch", ["bert", "shatter"])
def test_the_folded_biases_leave_no_reduction_of_their_own(arch):
    """The backward's bias gradients that are sums over the tokens (each a read of a [T, width]
    output gradient): of the model's width one a layer for Shatter (the FFN's second bias; b^O
    is W^F's column that meets the context's ones, summed by W^F's weight-gradient GEMM, and
    b^P's sum reads the [T, 2d + 16] projection gradient) where BERT has five (b^O too, and
    b^Q, b^K, b^V, each summed from SDPA's own gradient: fused QKV's backward has no [T, 3d]
    gradient); of the FFN's width one a layer for both (its first bias)."""
    config = shatter.config.preset_config(f"{arch}-tiny", max_len=128)
    tokens, low = ROWS * LENGTH, 2  # bf16 bytes
    sums = [r for r in _trace(arch) if r["phase"] == "backward" and r["op"] == "aten::sum"]

    def reading(width: int) -> int:  # sums of a [T, width] gradient into [width]
        return sum(r["count"] for r in sums if r["bytes"] == (tokens + 1) * width * low)

    assert reading(config.ffn) == config.layers
    assert reading(config.hidden) == config.layers * (1 if arch == "shatter" else 5)
    assert reading(3 * config.hidden) == 0


def test_multi_tensor_ops_launch_as_cuda_s_multi_tensor_apply():
    """A launch of CUDA's multi_tensor_apply is full at its depth's tensors (110 for one list, 36
    for a fused Adam's four) or at 320 chunks of 64 Ki elements; a norm adds its cleanup."""
    from shatter.tools.bench.step_trace import multi_tensor_launches

    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    flat = [meta(85_000_000)]  # one flat parameter group: 1,297 chunks
    adam = [flat, flat, flat, flat, [], [meta(())]]
    assert multi_tensor_launches("_fused_adamw_", adam) == 5
    small = [meta(10) for _ in range(200)]
    assert multi_tensor_launches("_foreach_norm", [small]) == 2 + 1
    assert multi_tensor_launches("_foreach_copy_", [small, small]) == 4  # 64 tensors a launch
    assert multi_tensor_launches("_fused_adamw_", [small] * 4 + [[], [meta(())] * 200]) == 6


def test_zero1_updates_a_world_share_on_each_rank():
    """ZeRO-1 over 8 ranks: every gradient still goes into the bucket whole, but the partition's
    copies, the flattening cast, the norm, AdamW and the copy back run on 1/8 of the
    parameters. On one rank (no contiguous bucket, no reduction: train/engine.py) no gradient is
    copied but into the flat fp32 buffer. A copy's destination is written, not read."""
    one, eight = (_trace("bert", world=w) for w in (1, 8))
    opt = lambda rows, op: sum(  # noqa: E731
        r["bytes"] * r["count"] for r in rows if r["phase"] == "optimizer" and r["op"] == op
    )
    assert opt(eight, "aten::_fused_adamw_") == pytest.approx(
        opt(one, "aten::_fused_adamw_") / 8, rel=1e-3
    )
    model = shatter.build_model("bert-tiny", vocab_size=VOCAB, max_len=128)
    params = sum(p.numel() for p in model.parameters())
    # a gradient's copy (bf16 read, bf16 written), the master's copy back (fp32 read, bf16
    # written): one rank copies no gradient, only the master back; eight copy each gradient
    # into the bucket, then 1/8 into the partition, and 1/8 of the master
    grad_copy, master_copy = (2 + 2) * params, (4 + 2) * params
    assert opt(one, "aten::copy_") == pytest.approx(master_copy, rel=1e-3)
    eight_copies = grad_copy + (grad_copy + master_copy) / 8
    assert opt(eight, "aten::copy_") == pytest.approx(eight_copies, rel=1e-3)
    # the groups' gradients flattened into fp32 (bf16 read, fp32 written), 1/8 on eight ranks;
    # no separate flattening or cast
    assert opt(one, "aten::_foreach_copy_") == pytest.approx(6 * params, rel=1e-3)
    assert opt(eight, "aten::_foreach_copy_") == pytest.approx(6 * params / 8, rel=1e-3)
    assert opt(one, "aten::cat") == opt(one, "aten::_to_copy") == opt(eight, "aten::cat") == 0
    rest = [r for r in one if r["phase"] != "optimizer"]
    assert rest == [r for r in eight if r["phase"] != "optimizer"]


def test_the_one_pass_step_reads_and_writes_28_bytes_a_parameter():
    """ZeRO-1 with the one-pass step (train/master_step.py): one kernel a group reads the
    gradients where they lie, the master and moments, and writes them and the bf16 weights (28
    B a parameter, and the gradients' addresses); eight ranks step 1/8 of the parameters. No
    fp32 flattening, fused AdamW or copy back: 44 B a parameter by torch's fused AdamW."""
    one, eight = (_trace("bert", optimizer="master", world=w) for w in (1, 8))
    torch_one = _trace("bert", world=1)
    opt = lambda rows, op: sum(  # noqa: E731
        r["bytes"] * r["count"] for r in rows if r["phase"] == "optimizer" and r["op"] == op
    )
    model = shatter.build_model("bert-tiny", vocab_size=VOCAB, max_len=128)
    params, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert opt(one, "shatter::master_adamw_") == pytest.approx(28 * params, rel=1e-3)
    assert opt(eight, "shatter::master_adamw_") == pytest.approx(28 * params / 8, rel=1e-2)
    for op in ("aten::_fused_adamw_", "aten::copy_", "aten::_foreach_copy_"):
        assert opt(one, op) == 0
    assert opt(torch_one, "aten::_fused_adamw_") > 0
    total = lambda rows: sum(  # noqa: E731
        r["bytes"] * r["count"]
        for r in rows
        if r["phase"] == "optimizer" and r["op"] != "aten::_foreach_norm"
    )
    assert total(torch_one) == pytest.approx(44 * params, rel=1e-3)
    assert total(one) == pytest.approx(28 * params + 8 * tensors, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bert", "shatter"])
@pytest.mark.parametrize("optimizer,impl", [("zero1", "torch"), ("master", "auto")])
def test_the_traced_zero1_step_launches_as_many_kernels_as_deepspeed_s(arch, optimizer, impl):
    """The ZeRO-1 step the model prices (step_trace.zero1_step), stepping torch's fused AdamW or
    the one-pass step, against a real DeepSpeed engine with the trainer's bf16 config and that
    `optim.impl` on one rank (tools/bench/count_ops.py): its step's kernels, give or take 3
    (the one-pass op counted as the kernels its cost lists), and no gradient copy or
    flattening in the backward beyond the model's own (one rank: no contiguous bucket, no
    reduction)."""
    import argparse

    from shatter.kernels.cost import OP_COSTS
    from shatter.tools.bench.count_ops import count_engine, count_plain
    from shatter.train.engine import init_distributed

    if optimizer == "master" and not INTERPRET:
        pytest.skip("the one-pass step's kernel runs here under TRITON_INTERPRET=1 only")
    init_distributed()
    args = argparse.Namespace(
        micro_batch=2, seq_len=LENGTH, vocab=VOCAB, grad_accum=1, warmup=1, optim_impl=impl
    )
    real = count_engine(f"{arch}-tiny", "bf16", 1, {}, args)
    plain = count_plain(f"{arch}-tiny", "bf16", False, args)
    no_kernel = ("_local_scalar_dense", "profiler::", "c10d::", "step empty", "step new_empty")
    names = real.names.items()
    step = sum(n for k, n in names if k.startswith("step ") and not any(w in k for w in no_kernel))
    one_pass = real.names.get("step shatter::master_adamw_", 0)
    found = {"found_inf": torch.empty((), device="meta"), "step_counted": True}
    meta = [torch.empty(8, device="meta")] * 6
    step += one_pass * (len(OP_COSTS["shatter::master_adamw_"](meta, found, None)) - 1)
    assert (one_pass > 0) == (optimizer == "master")
    copies = real.names["backward copy_"] - plain.names.get("backward copy_", 0)
    flattened = real.names["backward cat"] - plain.names.get("backward cat", 0)
    traced = sum(
        r["launches"] * r["count"]
        for r in _trace(arch, optimizer=optimizer)
        if r["phase"] == "optimizer"
    )
    assert copies + flattened <= 3, (copies, flattened)
    assert abs(traced - (copies + flattened + step)) <= 3, (traced, copies, flattened, step)


def _hand_made_step() -> StepTrace:
    """y = relu(x x) * 2 (the * 2 in the EAGER range), its rows picked by a bool index and
    summed; the backward; an optimizer op."""
    x = torch.empty(64, 64, device="meta", requires_grad=True)
    rec = StepTrace(0.25)
    with rec:
        y = (x @ x).relu()
        with eager_region():
            y = y * 2
        loss = y[torch.empty(64, dtype=torch.bool, device="meta")].sum()
        rec.phase = "backward"
        loss.backward()
        rec.phase = "optimizer"
        x.detach().add_(1)
    return rec


def test_compiled_step_keeps_externs_eager_ops_and_the_optimizer_and_takes_inductors_kernels():
    """Kept as traced: the GEMMs, the EAGER range's op, the bool index and its backward's zeros
    and index_put (Dynamo breaks the graph there), the optimizer; the other ops of the forward
    and backward (relu, sum, their backward, the * 2's backward: autograd's own) are the
    plan's kernels, each launch counted."""
    rec = _hand_made_step()
    eager = records(rec)
    plan = [
        {"name": "triton_poi_fused_relu_0", "phase": "forward", "bytes": 100.0, "launches": 1},
        {
            "name": "triton_poi_fused_mul_threshold_1",
            "phase": "backward",
            "bytes": 50.0,
            "launches": 3,
        },
    ]
    compiled = records(rec, plan)
    key = lambda r: (r["op"], r["phase"])  # noqa: E731
    kept = {
        ("aten::mm", "forward"), ("aten::mul", "forward"), ("aten::index", "forward"),
        ("aten::new_zeros", "backward"), ("aten::index_put", "backward"),
        ("aten::mm", "backward"), ("aten::add_", "optimizer"),
    }  # fmt: skip
    planned_rows = {("inductor::triton_poi_fused_relu_0", "forward"), ("inductor::triton_poi_fused_mul_threshold_1", "backward")}  # fmt: skip
    assert {key(r) for r in compiled} == kept | planned_rows
    assert [r for r in compiled if key(r) in kept] == [r for r in eager if key(r) in kept]
    fused = next(r for r in compiled if r["op"] == "inductor::triton_poi_fused_mul_threshold_1")
    assert (fused["count"], fused["bytes"], fused["kind"]) == (3, 50.0, "memory")


def _plan(arch, impl=None, flash=True, low=torch.bfloat16):
    return planned(arch, "tiny", LENGTH, ROWS, REPLAY_VOCAB, 512, impl, low, flash, False, (9, 0))


def _launches(plan, phase, *words):
    return sum(
        k["launches"] for k in plan if k["phase"] == phase and all(w in k["name"] for w in words)
    )


def test_inductor_plans_the_layers_fusions_and_leaves_the_weight_cat_eager():
    """bert-tiny (2 layers), bf16, flash, as --json's figures plan it (the same plan, cached):
    inductor fuses each residual's dropout and add into its LayerNorm, forward and backward, and
    makes GELU's backward in kernels of its own (neither a GEMM nor SDPA is among its kernels),
    while the fused QKV's cat of every layer's weights runs eagerly, once (`shatter.eager`), not
    as one copy kernel per parameter; the QKV projection's bias gradients come from its weight
    gradients' GEMMs. (Its kernels are not fewer than eager's at this size:
    inductor splits the small reductions in two.)"""
    plan = _plan("bert")
    assert plan and all(k["bytes"] > 0 for k in plan)
    names = " ".join(k["name"] for k in plan)
    assert "mm" not in names.replace("_mm_", "") and "attention" not in names
    # 2 a layer, and the embeddings' sum, dropout and LayerNorm in one
    assert _launches(plan, "forward", "native_dropout", "native_layer_norm") == 2 * 2 + 1
    assert _launches(plan, "backward", "native_dropout_backward", "native_layer_norm_backward") >= 4
    assert _launches(plan, "backward", "gelu_backward") >= 2
    # the only cats: each layer's [x | 1 | 0] (projection.gemm_input), its ones written apart
    # and, for the first layer, x copied in (the embeddings' LayerNorm writes it elsewhere)
    assert _launches(plan, "forward", "cat") == _launches(plan, "forward", "arange_cat") == 2 + 1
    # and so no sum of q's, k's and v's gradients (SDPA's, transposed): their weight-gradient
    # GEMMs over [x | 1 | 0] make the bias gradients
    assert _launches(plan, "backward", "sum_transpose") == 0
    rec = _step("bert", vocab=REPLAY_VOCAB, max_len=512)
    eager, compiled = records(rec), records(rec, plan)
    count = lambda rows, op: sum(  # noqa: E731  (the forward and backward: not the optimizer's)
        r["count"] for r in rows if r["op"] == op and r["phase"] != "optimizer"
    )
    assert count(compiled, "aten::cat") == 2  # W and b, once each: the eager ones
    assert count(eager, "aten::cat") > 2
    memory = lambda rows, field, phase, but=(): sum(  # noqa: E731
        r["count"] * (r[field] if field else 1)
        for r in rows
        if r["kind"] == "memory" and r["phase"] == phase and not any(w in r["op"] for w in but)
    )
    ones = _launches(plan, "forward", "arange_cat")  # the [x | 1 | 0] kernels, compiled only
    # the layers' kernels (the loss's reductions over the vocabulary, of this step's few
    # predicted rows, inductor splits in two kernels each for an H100's 132 SMs: left out)
    loss = ("log_softmax", "nll_loss")
    assert memory(compiled, None, "forward", loss) - ones < 0.6 * memory(
        eager, None, "forward", loss
    )
    # each fused kernel reads its inputs once (the backward's bytes at this size: the vocabulary's)
    assert memory(compiled, "bytes", "forward") < 0.8 * memory(eager, "bytes", "forward")
    assert memory(compiled, "bytes", "backward") <= memory(eager, "bytes", "backward")


def test_the_plan_folds_layernorm_s_weight_gradients_as_a_gpu_s_inductor_does():
    """Inductor folds a LayerNorm backward's weight and bias gradients (sums down the tokens) into
    the kernel that sums each token's row on CUDA, for tensors of at least 5 Mi elements and 4,096
    rows (its mix-order reductions): the plan takes them so, and leaves them out below that size,
    as a GPU does. bert-tiny (d = 64) at 160 x 512 tokens: each layer's two LayerNorms and the
    embeddings'; at the module's small step none."""
    mixed = lambda plan: sum(  # noqa: E731
        k["launches"]
        for k in plan
        if k["grid"] == "MixOrderReductionGrid" and "native_layer_norm_backward" in k["name"]
    )
    large = planned("bert", "tiny", 512, 160, VOCAB, 512, None, torch.bfloat16, True, False, (9, 0))
    assert mixed(large) >= 2 * 2 + 1
    assert {k["phase"] for k in large if k["grid"] == "MixOrderReductionGrid"} == {"backward"}
    assert mixed(_plan("bert")) == 0
    # each folds two sums down the tokens (weight, bias), which inductor's wrapper finishes over
    # the kernel's partial rows with a torch sum each, then casts to bf16 in kernels of its own:
    # one kernel for all four (train/mix_order.py), which the plan counts too
    wrapper = Counter()
    for k in large:
        wrapper[k["name"]] += k["launches"] if k["grid"] == WRAPPER else 0
    assert wrapper["shatter::partial_sums"] == mixed(large)
    assert wrapper["aten::sum"] == wrapper["aten::_to_copy"] == 0
    d = 64  # bert-tiny's width: no kernel of inductor's of a gradient's size
    assert not [k for k in large if "layer_norm_backward" in k["name"] and k["bytes"] < 64 * d]
    # the partial rows are as many as the target GPU's SMs make them (8 programs an SM), not this
    # machine's cores: more on the H100's 132 than on the V100's 80
    sm70 = planned("bert", "tiny", 512, 160, VOCAB, 512, None, torch.bfloat16, True, False, (7, 0))
    rows = lambda plan: {  # noqa: E731  (bytes: 2 gradients' rows of d fp32 read, 2 x d bf16 written)
        (k["bytes"] - 2 * d * 2) / (2 * d * 4) for k in plan if k["name"] == "shatter::partial_sums"
    }
    assert len(rows(large)) == len(rows(sm70)) == 1 and min(rows(large)) > min(rows(sm70)) > 2 * 8
    assert not [k for k in _plan("bert") if k["name"] == "aten::sum"]


def test_shatters_layer_weights_are_made_outside_the_compiled_graphs():
    """shatter-tiny on the `triton` impl, as --json's figures plan it (the same plan, cached):
    no copy kernel of inductor's for W^P, b^P or W^F (made eagerly, `shatter.eager`), and the
    mixing ops, SDPA or a GEMM are none of its kernels (extern: priced from the trace)."""
    plan = _plan("shatter", "triton")
    names = " ".join(k["name"] for k in plan)
    # no cat but each layer's [x | 1 | 0] (projection.gemm_input: ones, and the first layer's x)
    cats = _launches(plan, "forward", "cat")
    assert cats == _launches(plan, "forward", "arange_cat") == 2 + 1
    assert _launches(plan, "forward", "stack") == 0
    assert "mixing" not in names and "mm" not in names.replace("_mm_", "")
    assert _launches(plan, "forward", "native_dropout", "native_layer_norm") == 2 * 2 + 1


def test_bert_runs_flash_without_padding_and_efficient_with_it():
    kinds = lambda rows: {r["kind"] for r in rows}  # noqa: E731
    assert "flash" in kinds(_trace("bert")) and "efficient" not in kinds(_trace("bert"))
    assert "efficient" in kinds(_trace("bert", padding=True))
    assert "efficient" in kinds(_trace("bert", flash=False))  # a V100 has no flash kernel


def test_autocast_step_has_fp32_master_update():
    """The replayed protocol: fp32 weights under autocast, one fused AdamW over all of them."""
    rows = _trace("bert", optimizer="fused")
    adam = [r for r in rows if r["op"] == "aten::_fused_adamw_"]
    model = shatter.build_model("bert-tiny", vocab_size=VOCAB, max_len=128)
    params = sum(p.numel() for p in model.parameters())
    # params, grads, m, v read; params, m, v written: 4 bytes each (and the steps' scalars)
    assert adam and adam[0]["bytes"] == pytest.approx(7 * 4 * params, rel=0.01)
    assert any(r["op"] == "aten::_to_copy" for r in rows)  # the weights' casts to bf16


def test_json_figures(tmp_path):
    out = tmp_path / "cost.json"
    args = ["--archs", "bert,shatter", "--lengths", "64", "--tokens", "256", "--size", "tiny"]
    args += ["--gpus", "H100", "--partition-impl", "triton", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["efficiency"] == EFFICIENCY
    assert (data["tokens_per_step"], data["world_size"], data["compiled"]) == (256, 1, True)
    for gpu in ("H100",):
        for arch in ("bert", "shatter"):
            f = data["figures"][gpu][arch]["64"]
            assert f["ms_per_step"] > 0 and f["flops_per_token"] > 0
            assert f["cost_py_flops_per_token"] > 0 and 0 < f["mfu"] < 1
            assert set(f["split_ms"]) == set(SPLIT)
            assert f["mode"] == "compiled" and f["ms_per_step"] == f["compiled"]["ms_per_step"]
            assert f["compiled"]["ms_per_step"] < f["eager"]["ms_per_step"]
        for mode in ("eager", "compiled"):
            assert data["figures"][gpu]["bert"]["64"][mode]["ratio_to_bert"] == 1.0
        assert data["figures"][gpu]["bert"]["64"]["ratio_to_bert"] == 1.0
        assert data["figures"][gpu]["shatter"]["64"]["ratio_to_bert"] > 0
    assert "| shatter | 64 | compiled |" in result.output


def test_config_sets_tokens_world_and_precision(tmp_path):
    """configs/v100x8-base-256.yaml: 16 x 256 = 4,096 tokens per GPU, ZeRO-1 over 8, fp16,
    compiled (run.compile unset: on a GPU); `--eager` makes the eager figures the main ones."""
    out = tmp_path / "cost.json"
    config = Path(__file__).resolve().parents[2] / "configs" / "v100x8-base-256.yaml"
    args = ["--config", str(config), "--gpus", "V100", "--archs", "bert"]
    args += ["--lengths", "64", "--size", "tiny", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["tokens_per_step"], data["world_size"], data["compiled"]) == (4096, 8, True)
    assert "float16, 4096 tokens a step per GPU, ZeRO-1 over 8 GPUs" in result.output
    f = data["figures"]["V100"]["bert"]["64"]
    assert f["mode"] == "compiled" and f["ms_per_step"] == f["compiled"]["ms_per_step"]
    eager = CliRunner().invoke(main, args[:-2] + ["--eager", "--json", str(tmp_path / "e.json")])
    assert eager.exit_code == 0, eager.output
    f = json.loads((tmp_path / "e.json").read_text())["figures"]["V100"]["bert"]["64"]
    assert f["mode"] == "eager" and f["ms_per_step"] == f["eager"]["ms_per_step"]


def test_config_in_bf16_on_a_v100_is_one_line(tmp_path):
    config = tmp_path / "bf16.yaml"
    config.write_text(
        "model:\n  preset: bert-tiny\ndata:\n  seq_len: 64\nrun:\n  precision: bf16\n"
    )
    result = CliRunner().invoke(main, ["--config", str(config), "--gpus", "V100"])
    assert result.exit_code == 1 and "the V100 has no bf16" in result.output


def test_auto_kernel_choice_prices_with_the_frozen_table():
    """`auto` picks between the Triton impls with shatter.kernels.cost's per-kernel roofline, at
    the GPUs' peaks the step model uses (the efficiency table has one home, that module)."""
    pytest.importorskip("triton")
    from shatter.kernels import cost

    assert EFFICIENCY is cost.EFFICIENCY
    table = gpus()
    for name, family in (("H100", 90), ("A100", 80), ("V100", 70)):
        assert cost.PEAKS[family] == (table[name].peak, table[name].bandwidth)
        assert cost.family_of(table[name].capability) == family
    # a Triton dot below sm_80 runs on FMAs: priced at the fp32 FMA peak, cuBLAS at the tensor one
    flops, v100, h100 = 1e12, table["V100"], table["H100"]
    assert kernel_seconds("custom", flops, 0.0, v100) == flops / (0.5 * 15.7e12)
    assert kernel_seconds("gemm", flops, 0.0, v100) == flops / (0.7 * v100.peak)
    assert kernel_seconds("custom", flops, 0.0, h100) == flops / (0.5 * h100.peak)


def test_unknown_arch_is_one_line():
    result = CliRunner().invoke(main, ["--archs", "gpt"])
    assert result.exit_code == 1 and "unknown arch or GPU ['gpt']" in result.output


def test_bert_without_a_mask_equals_an_all_ones_mask():
    """attention_mask None (a batch without padding, SDPA's flash kernel on a GPU) computes what
    the all-ones mask computes."""
    torch.manual_seed(0)
    model = shatter.build_model("bert-tiny", vocab_size=VOCAB).eval()
    ids = torch.randint(5, VOCAB, (2, 16))
    assert model.encoder.key_mask(ids, None) is None
    torch.testing.assert_close(model.encoder(ids), model.encoder(ids, torch.ones_like(ids)))
