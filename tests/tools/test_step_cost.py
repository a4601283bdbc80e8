"""tools/bench/step_cost.py: the traced step's FLOPs against train/cost.py, the pricing of a hand-made
trace, SDPA's kernel with and without padding, and the --json figures' shape (tiny models on meta
tensors: seconds)."""

import json

import pytest
import torch
from click.testing import CliRunner

import shatter
from shatter.tools.bench.step_cost import EFFICIENCY, cost_py_flops, gpus, main, model_flops, price
from shatter.tools.bench.step_trace import build_meta, records, trace_step

ROWS, LENGTH, VOCAB = 4, 64, 1000


def _trace(arch, impl=None, optimizer="zero1", padding=False, low=torch.bfloat16, flash=True):
    model = build_meta(
        shatter.build_model,
        arch,
        "tiny",
        VOCAB,
        128,
        low if optimizer == "zero1" else torch.float32,
        impl,
    )
    return records(trace_step(model, LENGTH, ROWS, optimizer, low, flash, padding_mask=padding))  # fmt: skip


@pytest.mark.parametrize(
    "arch, impl", [("bert", None), ("shatter", "naive"), ("shatter", "lean"), ("shatter", "triton")]
)
def test_trace_flops_per_token_match_cost_py(arch, impl):
    """Products only, SDPA's recomputation left out: the convention train/cost.py counts in."""
    if impl == "triton":
        pytest.importorskip("triton")  # its custom ops trace on meta tensors with no GPU
    traced = model_flops(_trace(arch, impl)) / (ROWS * LENGTH)
    counted = cost_py_flops(arch, LENGTH, ROWS, "tiny", VOCAB)
    assert traced == pytest.approx(counted, rel=0.02)


def test_pricing_of_a_hand_made_trace():
    h100 = gpus()["H100"]
    peak, bw = h100.peak, h100.bandwidth
    rows = [  # a GEMM bound by its FLOPs, one bound by its bytes, an elementwise op twice, AdamW
        dict(phase="forward", kind="gemm", flops=1e12, model_flops=1e12, bytes=1e6, launches=1, count=1),
        dict(phase="backward", kind="gemm", flops=1e6, model_flops=1e6, bytes=1e10, launches=1, count=1),
        dict(phase="forward", kind="memory", flops=0, model_flops=0, bytes=3e9, launches=1, count=2),
        dict(phase="backward", kind="flash", flops=2e12, model_flops=1.6e12, bytes=1e6, launches=1, count=1),
        dict(phase="optimizer", kind="memory", flops=0, model_flops=0, bytes=2e9, launches=2, count=1),
        dict(phase="forward", kind="custom", flops=1e12, model_flops=2e12, bytes=4e9, launches=1, count=1),
    ]  # fmt: skip
    split = price(rows, h100)
    mem = EFFICIENCY["memory"] * bw
    assert split["gemm"] == pytest.approx(1e12 / (EFFICIENCY["gemm"] * peak) + 1e10 / mem)
    assert split["elementwise"] == pytest.approx(2 * 3e9 / mem)
    custom = 1e12 / (EFFICIENCY["custom"] * peak) + 4e9 / mem  # its GEMMs, then its mixing
    assert split["attention"] == pytest.approx(2e12 / (EFFICIENCY["flash"] * peak) + custom)
    assert split["optimizer"] == pytest.approx(2e9 / mem)
    assert split["launches"] == pytest.approx(8 * EFFICIENCY["launch_us"] * 1e-6)
    assert split["total"] == pytest.approx(sum(v for k, v in split.items() if k != "total"))
    assert model_flops(rows) == pytest.approx(1e12 + 1e6 + 1.6e12 + 2e12)


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
    for gpu in ("H100", "V100"):
        for arch in ("bert", "shatter"):
            f = data["figures"][gpu][arch]["64"]
            assert f["ms_per_step"] > 0 and f["flops_per_token"] > 0
            assert set(f["split_ms"]) == {
                "gemm",
                "attention",
                "elementwise",
                "optimizer",
                "launches",
            }
        assert data["figures"][gpu]["bert"]["64"]["ratio_to_bert"] == 1.0
        assert data["figures"][gpu]["shatter"]["64"]["ratio_to_bert"] > 0
    assert "| shatter | 64 |" in result.output


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
