"""Every attention impl of the single-head partition archs gives the naive reference's values and
gradients; `chunked` keeps activations linear in l and no more than BERT's SDPA."""

import importlib
import json
import sys
import warnings

import pytest
import torch

import shatter
from shatter.attention import impls
from shatter.attention.chunked import ChunkedPartitionAttention, block_rows
from shatter.config import ModelConfig
from shatter.partition import partition_table
from shatter.tools.bench.bench_model import saved_bytes
from tests.shatter.shatter_tiny import ids, tiny

SINGLE_HEAD = ["1h-softmax", "1h-sigmoid", "part-bias", "shatter"]
# (sigmoid, partition bias) of each arch: shatter's A_part V_part term lives outside the impl
FORMS = {"1h-softmax": (False, False), "1h-sigmoid": (True, False), "part-bias": (True, True)}
CPU_IMPLS = ["chunked", "lean", "naive"]


def _inputs(bias: bool, dtype=torch.float64, B=2, L=7, d=8, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q = torch.randn(B, L, d, generator=g, dtype=dtype, requires_grad=True)
    X = torch.randn(B, L, d, generator=g, dtype=dtype, requires_grad=True)
    V = torch.randn(B, n, L, d // n, generator=g, dtype=dtype, requires_grad=True)
    c = torch.randn(B, L, n, generator=g, dtype=dtype, requires_grad=True) if bias else None
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, L - 2 :] = False  # a ragged second sequence
    table = partition_table(n, 1, 3, max_len=max(16, L), dtype=dtype)
    return Q, X, V, c, mask, table


@pytest.mark.parametrize("form", FORMS)
def test_chunked_gradcheck(form):
    sigmoid, bias = FORMS[form]
    Q, X, V, c, mask, table = _inputs(bias, L=5)
    args = (Q, X, V, c) if bias else (Q, X, V)

    def f(*a):
        return ChunkedPartitionAttention.apply(*a[:3], a[3] if bias else None, mask, table, sigmoid)

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("impl", ["chunked", "lean"])
@pytest.mark.parametrize("form", FORMS)
def test_impl_equals_naive_values_and_gradients(impl, form, monkeypatch):
    # several row blocks, the last one short: 3 rows per block over L = 11
    monkeypatch.setattr("shatter.attention.chunked.BLOCK_ELEMENTS", 3 * 2 * 4 * 11)
    assert block_rows(2, 4, 11) == 3
    sigmoid, bias = FORMS[form]
    inputs = _inputs(bias, L=11)
    leaves = [t for t in inputs[:4] if t is not None]
    g = torch.Generator().manual_seed(3)
    g_out = torch.randn(2, 4, 11, 2, generator=g, dtype=torch.float64)
    g_part = torch.randn(2, 11, 4, generator=g, dtype=torch.float64)
    results = []
    for name in (impl, "naive"):
        out, part = impls.IMPLS[name](*inputs, sigmoid)
        grads = torch.autograd.grad((out * g_out).sum() + (part * g_part).sum(), leaves)
        results.append((out, part, *grads))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def test_block_rows_respects_the_budget():
    assert block_rows(32, 12, 512) == 80  # the docstring's BERT-base figure
    for B, n, L in [(1, 4, 7), (32, 12, 512), (8, 16, 4096), (256, 16, 4096)]:
        r = block_rows(B, n, L)
        assert 1 <= r <= L
        assert r == 1 or B * n * r * L <= 1 << 24


def _batch(L=24):
    x = ids(2, L)
    mask = torch.ones_like(x)
    mask[0, L - 7 :] = 0
    labels = torch.where(
        torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.3, x, -100
    )
    return x, mask, labels


@pytest.mark.parametrize("arch", SINGLE_HEAD)
def test_whole_model_equal_for_every_impl(arch):
    x, mask, labels = _batch()
    models = {impl: tiny(arch, attention_impl=impl) for impl in CPU_IMPLS}
    outs = {}
    for impl, model in models.items():
        outs[impl] = model(x, mask, labels)
        outs[impl]["loss"].backward()
    ref = models["naive"]
    for impl in ("chunked", "lean"):
        torch.testing.assert_close(
            outs[impl]["logits"], outs["naive"]["logits"], rtol=1e-5, atol=1e-5
        )
        for (name, p), q in zip(models[impl].named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{impl} {name}")


def test_checkpoint_saved_with_one_impl_runs_with_every_other(tmp_path):
    x, mask, _ = _batch()
    model = tiny("shatter", attention_impl="chunked")
    shatter.save_pretrained(model, tmp_path)
    want = model(x, mask)["logits"]
    assert json.loads((tmp_path / "config.json").read_text())["attention_impl"] == "chunked"
    for impl in ("auto", "lean", "naive"):
        loaded = shatter.from_pretrained(tmp_path, attention_impl=impl)
        assert loaded.config.attention_impl == impl
        torch.testing.assert_close(loaded(x, mask)["logits"], want, rtol=1e-5, atol=1e-5)


def test_a_config_key_this_version_does_not_know_is_refused():
    with pytest.raises(ValueError, match="unknown ModelConfig keys: lean_attention"):
        ModelConfig.from_dict({"arch": "shatter", "lean_attention": True})


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig(arch="shatter", attention_impl="flash")


def test_auto_picks_lean_on_cpu_and_triton_is_imported_lazily(monkeypatch):
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert impls.auto_impl(torch.device("cpu"), bf16) == "lean"
    assert impls.resolve("auto", torch.device("cpu"), fp32) is impls.lean
    monkeypatch.delitem(sys.modules, "shatter.attention.triton_kernel", raising=False)
    tiny("shatter", attention_impl="triton")  # building a model never imports the kernel
    assert "shatter.attention.triton_kernel" not in sys.modules
    # a CUDA device: by capability and dtype, with or without triton (no device needed)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(impls, "_capability", lambda index: (7, 0))
    monkeypatch.setattr(impls, "_triton_available", lambda: True)
    monkeypatch.setattr(impls, "_rows_available", lambda: True)
    # below sm_80: the cuBLAS + Triton row kernels in fp16 (V100s have no bf16)
    assert [impls.auto_impl(cuda, t) for t in (bf16, fp16, fp32)] == ["chunked", "rows", "chunked"]
    monkeypatch.setattr(impls, "_rows_available", lambda: False)
    assert impls.auto_impl(cuda, fp16) == "chunked"
    monkeypatch.setattr(impls, "_rows_available", lambda: True)
    for cap in ((8, 0), (9, 0)):
        monkeypatch.setattr(impls, "_capability", lambda index, cap=cap: cap)
        assert [impls.auto_impl(cuda, t) for t in (bf16, fp16, fp32)] == ["triton"] * 2 + [
            "chunked"
        ]
    monkeypatch.setattr(impls, "_triton_available", lambda: False)
    assert impls.auto_impl(cuda, bf16) == "chunked"
    monkeypatch.setattr(impls, "_triton_available", lambda: True)
    # with the call's (B, l, d, n): the Triton impl the roofline prices faster
    base, small = (64, 256, 768, 12), (16, 1024, 256, 4)
    assert impls.auto_impl(cuda, bf16, base) == "triton"  # d = 768: Q Xᵀ dearer than Z's bytes
    assert impls.auto_impl(cuda, bf16, small) == "fused"  # sm_90, d = 256, l = 1024
    assert impls.auto_impl(cuda, fp32, small) == "chunked"
    assert impls.resolve_layer("auto", cuda, bf16, small) is impls._fused_layer
    assert impls.resolve_layer("fused", cuda, bf16) is impls._fused_layer
    monkeypatch.setattr(impls, "_capability", lambda index: (8, 0))
    assert impls.auto_impl(cuda, bf16, small) == "triton"  # the A100: fewer FLOPs per byte
    # a V100 with the call's shape: `rows` or `triton` (its dots on FMAs), as priced
    monkeypatch.setattr(impls, "_capability", lambda index: (7, 0))
    v100_256, v100_1024 = (16, 256, 768, 12), (4, 1024, 768, 12)
    assert [impls.auto_impl(cuda, fp16, s) for s in (v100_256, v100_1024)] == ["triton"] * 2
    assert impls.auto_impl(cuda, fp16, (1, 4096, 768, 12)) == "rows"  # long rows: W cheaper
    assert impls.resolve_layer("auto", cuda, fp16, v100_256) is impls._triton_layer
    monkeypatch.setattr(impls, "_triton_available", lambda: False)
    assert impls.auto_impl(cuda, fp16, v100_256) == "rows"
    monkeypatch.setattr(impls, "_triton_available", lambda: True)
    # forced where Triton cannot serve: refused in one line naming the fix
    impls.require_triton_capability(cuda)  # `triton` on sm_70 passes: FMA dots
    with pytest.raises(ValueError, match=r"^attention_impl: fused .* sm_70"):
        impls.require_triton_capability(cuda, "fused")
    monkeypatch.setattr(impls, "_capability", lambda index: (6, 1))
    with pytest.raises(
        ValueError, match=r"^attention_impl: triton .* sm_61; fix: set attention_impl"
    ):
        impls.require_triton_capability(cuda)


def test_missing_triton_kernel_names_the_setting(monkeypatch):
    if importlib.util.find_spec("shatter.attention.triton_kernel") is not None:
        pytest.skip("the Triton kernel module is present")
    with pytest.raises(RuntimeError, match="attention_impl: triton.*fix: set attention_impl"):
        impls.IMPLS["triton"](*_inputs(False), True)


def _attention_bytes(arch: str, L: int, **overrides) -> int:
    x = ids(1, L)
    batch = {
        "input_ids": x,
        "attention_mask": torch.ones_like(x),
        "labels": torch.where(x % 7 == 0, x, -100),
    }
    model = tiny(arch, max_len=1024, **overrides).train()
    return saved_bytes(model, batch)[1]


@pytest.mark.slow
def test_chunked_saves_linear_activations_no_more_than_bert_sdpa():
    chunked = {
        L: _attention_bytes("shatter", L, attention_impl="chunked") for L in (256, 512, 1024)
    }
    bert = _attention_bytes("bert", 1024)  # attention dropout 0: PyTorch's fused SDPA
    assert chunked[1024] <= bert
    # linear in l: doubling l from 512 adds twice what doubling from 256 adds (the constant is
    # the layers' partition tables); an l x l term would make it four times
    grow = (chunked[1024] - chunked[512]) / (chunked[512] - chunked[256])
    assert 1.95 < grow < 2.05, chunked
    assert chunked[1024] < 0.2 * _attention_bytes("shatter", 1024, attention_impl="lean")


@pytest.mark.parametrize("arch", ["1h-softmax", "shatter"])
def test_chunked_under_bf16_autocast_tracks_naive(arch):
    x, mask, labels = _batch()
    outs = {}
    for impl in ("chunked", "naive"):
        model = tiny(arch, attention_impl=impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[impl] = model(x, mask, labels)
        outs[impl]["loss"].backward()
        outs[impl]["grad"] = model.encoder.layers[0].attention.query.weight.grad
    for key in ("logits", "grad"):
        got, want = outs["chunked"][key].float(), outs["naive"][key].float()
        assert (got - want).norm() < 0.05 * want.norm(), key


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS)
def test_chunked_in_low_precision_tracks_the_fp64_reference(form, dtype, device):
    """chunked on `dtype` inputs (matmuls in dtype, statistics in fp32) against naive in fp64."""
    sigmoid, bias = FORMS[form]
    Q, X, V, c, mask, table = _inputs(bias, B=2, L=40, d=32)
    exact = [t.detach().to(device).requires_grad_() for t in (Q, X, V, c) if t is not None]
    low = [t.detach().to(dtype).requires_grad_() for t in exact]
    mask, table = mask.to(device), table.float().to(device)
    g_out = torch.randn(V.shape, dtype=torch.float64, device=device)

    def run(leaves, impl):
        q, x, v, *rest = leaves
        out, part = impls.IMPLS[impl](q, x, v, rest[0] if bias else None, mask, table, sigmoid)
        grads = torch.autograd.grad((out.double() * g_out).sum() + part.double().sum(), leaves)
        return [out, part, *grads]

    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    for got, want in zip(run(low, "chunked"), run(exact, "naive"), strict=True):
        assert got.dtype == dtype
        assert (got.double() - want).norm() <= tol * want.norm()


def _interpreted_triton():
    """Skip unless the Triton kernel can run here on CPU tensors (TRITON_INTERPRET=1)."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU tensors only under TRITON_INTERPRET=1")


TRITON_WHOLE = [(arch, "triton") for arch in SINGLE_HEAD]
TRITON_WHOLE += [("shatter", "rows"), ("1h-softmax", "rows-keep")]


@pytest.mark.slow
@pytest.mark.parametrize("arch, impl", TRITON_WHOLE)
def test_whole_model_with_triton_equals_naive_on_cpu(arch, impl):
    """build_model(..., attention_impl=impl) for the Triton impls runs forward and backward on
    CPU tensors (the kernels under Triton's interpreter) and gives the naive reference's logits
    and gradients."""
    _interpreted_triton()
    x, mask, labels = _batch()
    models = {name: tiny(arch, attention_impl=name) for name in (impl, "naive")}
    outs = {}
    for name, model in models.items():
        outs[name] = model(x, mask, labels)
        outs[name]["loss"].backward()
    torch.testing.assert_close(outs[impl]["logits"], outs["naive"]["logits"], rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(
        models[impl].named_parameters(), models["naive"].parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_auto_under_torch_compile_is_a_constant_choice(monkeypatch):
    """On a GPU a forward resolves `auto` by the call's (B, l, d, n); torch.compile takes that
    choice as a constant: one graph, no functools cache or cost model traced, no Dynamo warning
    (a user's compiled run would print one)."""
    monkeypatch.setattr(impls, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(impls, "_triton_available", lambda: True)
    cuda, small = torch.device("cuda", 0), (16, 1024, 256, 4)

    def forward(x):
        layer = impls.resolve_layer("auto", cuda, torch.bfloat16, small)
        return x + (1 if layer is impls._fused_layer else 2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(forward, backend="eager", fullgraph=True)(torch.zeros(1))
    assert out.item() == 1  # sm_90, d = 256, l = 1024: fused, as eager
    assert not [w for w in caught if "Dynamo" in str(w.message)]


def test_a_training_run_keeps_rows_where_they_pay_and_fit():
    """`keeps_rows`: rows-keep below sm_80 in fp16 where the roofline prices it faster than
    `auto`'s pick and its kept W (layers x n x B x l² fp16) fits a tenth of the GPU's memory:
    the paper's 8 V100s (16 GiB, 4 x 1024 tokens each, 1.2 GB kept) yes; at l = 256 (priced
    slower), past the memory share, on sm_80+ or in bf16, no."""
    pytest.importorskip("triton")
    fp16, gib = torch.float16, 2**30
    v100_1024, v100_256 = (4, 1024, 768, 12), (16, 256, 768, 12)
    assert impls.keeps_rows((7, 0), v100_1024, fp16, 12, 16 * gib)
    assert not impls.keeps_rows((7, 0), v100_256, fp16, 12, 16 * gib)  # priced slower
    assert not impls.keeps_rows((7, 0), (16, 1024, 768, 12), fp16, 12, 32 * gib)  # 4.8 GB
    kept = 12 * 12 * 4 * 1024**2 * 2
    assert impls.keeps_rows((7, 0), v100_1024, fp16, 12, kept / impls.KEEP_SHARE)
    assert not impls.keeps_rows((7, 0), v100_1024, fp16, 12, kept / impls.KEEP_SHARE - 1)
    assert not impls.keeps_rows((9, 0), v100_1024, fp16, 12, 80 * gib)
    assert not impls.keeps_rows((7, 0), v100_1024, torch.bfloat16, 12, 16 * gib)


def test_keeping_rows_changes_the_layers_choice_not_the_config():
    """keep_rows_where_they_fit sets every `auto` partition layer's runtime impl to rows-keep
    where keeps_rows says so, and leaves the config (saved in checkpoints and exports) at
    `auto`; a layer set to another impl, and BERT, are left as they are."""
    pytest.importorskip("triton")
    from shatter.attention.single_head import keep_rows_where_they_fit

    gib, v100 = 2**30, (7, 0)
    model = tiny("shatter", hidden=768, heads=12)
    args = (4, 1024, torch.float16, v100)
    assert keep_rows_where_they_fit(model, *args, 16 * gib)
    layers = [b.attention for b in model.encoder.layers]
    assert {a.impl for a in layers} == {"rows-keep"} and model.config.attention_impl == "auto"
    assert not keep_rows_where_they_fit(
        tiny("shatter", hidden=768, heads=12), 16, 256, *args[2:], 16 * gib
    )
    forced = tiny("shatter", hidden=768, heads=12, attention_impl="triton")
    assert not keep_rows_where_they_fit(forced, *args, 16 * gib)
    assert not keep_rows_where_they_fit(tiny("bert"), *args, 16 * gib)
