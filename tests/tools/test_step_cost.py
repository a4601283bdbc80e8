"""tools/bench/step_cost.py: the traced step's FLOPs against train/cost.py, the pricing of a
hand-made trace (a custom op per kernel), SDPA's kernel with and without padding, ZeRO-1's share of
the optimizer per rank, the compiled step's fused pointwise chains, --config, and the --json
figures' shape (tiny models on meta tensors: seconds)."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.tools.bench.step_cost import (
    EFFICIENCY,
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


def _trace(
    arch, impl=None, optimizer="zero1", padding=False, low=torch.bfloat16, flash=True, world=1
):
    model = build_meta(
        shatter.build_model,
        arch,
        "tiny",
        VOCAB,
        128,
        low if optimizer == "zero1" else torch.float32,
        impl,
    )
    rec = trace_step(model, LENGTH, ROWS, optimizer, low, flash, padding_mask=padding, world=world)
    return records(rec)


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
    """The triton impl's ops carry their kernels (cuBLAS GEMMs, Triton mixing), one launch each."""
    pytest.importorskip("triton")
    custom = [r for r in _trace("shatter", "triton") if r["kind"] == "custom"]
    assert {r["op"] for r in custom} == {"shatter::mixing_fwd", "shatter::mixing_bwd"}
    for r in custom:
        assert r["launches"] == len(r["kernels"]) > 1
        assert {k[1] for k in r["kernels"]} == {"gemm", "custom", "memory"}
        assert r["flops"] == sum(k[2] for k in r["kernels"])
        assert r["bytes"] == sum(k[3] for k in r["kernels"])


def test_zero1_updates_a_world_share_on_each_rank():
    """ZeRO-1 over 8 ranks: every gradient still goes into the bucket whole, but the cast, the
    norm, AdamW and the copy back run on 1/8 of the parameters."""
    one, eight = (_trace("bert", world=w) for w in (1, 8))
    opt = lambda rows, op: sum(  # noqa: E731
        r["bytes"] * r["count"] for r in rows if r["phase"] == "optimizer" and r["op"] == op
    )
    assert opt(eight, "aten::_fused_adamw_") == pytest.approx(
        opt(one, "aten::_fused_adamw_") / 8, rel=1e-3
    )
    assert opt(eight, "aten::_to_copy") == pytest.approx(opt(one, "aten::_to_copy") / 8, rel=1e-3)
    model = shatter.build_model("bert-tiny", vocab_size=VOCAB, max_len=128)
    params = sum(p.numel() for p in model.parameters())
    # the bucket's copies alike; the master's copy back (fp32 read, bf16 read and written) 1/8
    master_copy = (4 + 2 + 2) * params
    saved = opt(one, "aten::copy_") - opt(eight, "aten::copy_")
    assert saved == pytest.approx(7 / 8 * master_copy, rel=1e-3)
    rest = [r for r in one if r["phase"] != "optimizer"]
    assert rest == [r for r in eight if r["phase"] != "optimizer"]


def _fusion_trace():
    """x [N] fp32 in, y = ((x * 2 + 1).relu() - x) summed: eager runs four pointwise kernels and
    a sum; the compiled chain reads x once and writes y once (only the sum reads it)."""
    x = torch.empty(1024, device="meta")
    old = torch.empty(1024, device="meta")
    rec = StepTrace(0.15)
    with rec:
        y = (x * 2 + 1).relu() - x
        y.sum()
        rec.phase = "backward"
        z = old * 3  # a dead temporary, then a write into an older tensor
        old.add_(z)
        old.mul_(2)
    return rec


def test_compiled_step_fuses_each_pointwise_chain():
    eager, compiled = records(_fusion_trace()), records(_fusion_trace(), compiled=True)
    assert sum(r["count"] for r in eager) == 4 + 1 + 3
    fused = {r["phase"]: r for r in compiled if r["op"] == "inductor::pointwise"}
    assert fused["forward"]["bytes"] == 2 * 4096 and fused["forward"]["launches"] == 1
    assert fused["backward"]["bytes"] == 2 * 4096  # `old` read once, written once; z never
    assert [r["op"] for r in compiled if r["phase"] == "forward"].count("aten::sum") == 1
    assert sum(r["count"] for r in compiled) == 3


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
    args += ["--gpus", "H100,V100", "--partition-impl", "lean", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["efficiency"] == EFFICIENCY
    assert (data["tokens_per_step"], data["world_size"], data["compiled"]) == (256, 1, True)
    for gpu in ("H100", "V100"):
        for arch in ("bert", "shatter"):
            f = data["figures"][gpu][arch]["64"]
            assert f["ms_per_step"] > 0 and f["flops_per_token"] > 0
            assert f["cost_py_flops_per_token"] > 0 and 0 < f["mfu"] < 1
            assert set(f["split_ms"]) == set(SPLIT)
            assert f["mode"] == "compiled" and f["ms_per_step"] == f["compiled"]["ms_per_step"]
            assert f["compiled"]["kernels"] < f["eager"]["kernels"]
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
