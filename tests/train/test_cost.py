"""The model FLOP count (train/cost.py) against a hand count and against torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import shatter
from shatter.config import ARCHS, preset_config
from shatter.train.cost import CostModel, device_peak_tflops, training_flops_per_token


def test_bert_base_and_shatter_base_match_the_hand_count():
    d, f, layers, n, vocab, p = 768, 3072, 12, 12, 32000, 0.15  # Table 2 base; BERT's 15%
    for length in (256, 1024):
        # BERT (§2): W^Q, W^K, W^V and W^O (eq. 1, 3), the FFN, then Q K^T and A V over l keys
        # per head, l d multiply-adds per token each, summed over the n heads (eq. 1-2)
        bert_layer = 4 * d * d + 2 * d * f + 2 * length * d
        # Shatter (§3): no W^K (K = X, §3.2); Q X^T and A V (eq. 5, V in n parts), Q R^T and
        # A_part V_part (§3.3), n d each, both padded to 16 columns (Q R^T's in the projection
        # GEMM, A_part's in the context W^O reads); and B = sum_h (Q R^T)[:, h] N[h] (§3.3), n l,
        # whose backward is one product (N is constant): 4 FLOPs per multiply-add instead of 6
        shatter_layer = 3 * d * d + 2 * d * f + 2 * length * d + (16 + 16) * d
        head = p * (d * d + d * vocab)  # MLM head on the predicted 15%: dense + tied decoder
        cases = (("bert", bert_layer, 0), ("shatter", shatter_layer, 4 * n * length))
        for arch, layer, bias in cases:
            # 2 FLOPs per multiply-add, 3x for training
            hand = 6 * (layers * layer + head) + layers * bias
            config = preset_config(f"{arch}-base", max_len=length)
            assert training_flops_per_token(config, length, p) == pytest.approx(hand, rel=1e-12)
    # shatter-base at l = 1024, in numbers
    assert hand == pytest.approx(
        6 * 12 * (3 * 768**2 + 2 * 768 * 3072 + 2 * 1024 * 768 + 32 * 768)
        + 12 * 4 * 12 * 1024
        + 6 * 0.15 * (768**2 + 768 * 32000),
        rel=1e-12,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_the_count_is_what_the_model_multiplies(arch):
    """Forward and backward of a small model under torch's FLOP counter: its matmul FLOPs per
    token are the formula's, exactly."""
    B, L = 8, 16
    torch.manual_seed(0)
    model = shatter.build_model(f"{arch}-tiny", vocab_size=300, attention_impl="naive")
    ids = torch.randint(5, 300, (B, L))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    plm = arch == "xlnet"
    if plm:
        inputs["perm_rank"] = torch.rand(B, L).argsort(-1).argsort(-1)
    with FlopCounterMode(display=False) as counter:
        model(**inputs)["loss"].backward()
    measured = counter.get_total_flops() / (B * L)
    expected = training_flops_per_token(model.config, L, 1.0, two_stream=plm, micro_batch=B)
    assert measured == pytest.approx(expected, rel=1e-9)


def test_mfu_needs_a_peak():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert device_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on a V100
    assert device_peak_tflops(None, "bf16") is None


def test_device_names_match_exactly():
    """An L40 is not an L4 (a substring match gave it the L4's peak: MFU 1.5x too high)."""
    assert device_peak_tflops("NVIDIA L40", "bf16") == 181.0
    assert device_peak_tflops("NVIDIA L4", "bf16") == 121.0
    assert device_peak_tflops("NVIDIA L40S", "bf16") == 362.1
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert device_peak_tflops("NVIDIA A100 80GB PCIe", "bf16") == 312.0
    assert device_peak_tflops("NVIDIA H100 NVL", "bf16") == 835.0
    assert device_peak_tflops("NVIDIA A10G", "bf16") is None  # not the A10: no guess
    assert device_peak_tflops("NVIDIA H200", "fp16") == 989.4
    cost = CostModel(flops_per_token=1e9, peak_flops=1e12, world=8, max_steps=100)
    fields = cost.fields(tokens_per_s=8000, s_per_step=36.0, step=50, gpu_hours=2.0)
    assert fields["tokens_per_s_per_gpu"] == 1000
    assert fields["mfu"] == pytest.approx(1.0)  # 1000 tok/s x 1 GFLOP = the 1 TFLOP/s peak
    assert fields["hours_to_max_steps"] == pytest.approx(0.5)
    assert CostModel(1e9, None, 1, 100).fields(1.0, 1.0, 0, 0.0)["mfu"] is None


def test_time_left_reads_as_hours_minutes_and_seconds_and_devices_by_kind():
    from shatter.train.metrics import device_word, h_mm_ss, postfix

    hours = (0, 19 / 3600, 0.0204, 1.5, 26.01)
    assert [h_mm_ss(h) for h in hours] == ["0:00:00", "0:00:19", "0:01:14", "1:30:00", "26:00:36"]
    assert device_word("cuda") == "GPU" and device_word("cpu") == "device"
    line = postfix({"loss": 2.0, "tokens_per_s": 10.0, "tokens_per_s_per_gpu": 5.0}, 1e-4, "device")
    assert "tok/s/device=5" in line
