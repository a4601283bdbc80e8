"""What a run costs: model FLOPs per token per arch, the device's dense peak, MFU, GPU-hours.

Model FLOPs follow the convention of PaLM (Chowdhery et al. 2022, App. B) and Megatron-LM
(Narayanan et al. 2021, §5.1): matrix multiplications only, 2 FLOPs per multiply-add, a training
token costs 3x its forward (the backward computes two products per forward one), no
recomputation counted. Per token and per layer, with d = hidden, f = FFN width, n = heads or
parts, l = the run's length:

- projections: one d x d product per projection the arch has (W^Q, W^K, W^V; §2 eq. 1; the
  single-head partition archs have no W^K, K = X, §3.2) plus W^O (eq. 3), and the FFN's 2 d f;
- attention (the l x l terms): Q K^T and A V, each l d multiply-adds per token summed over the
  heads (eq. 1-2); the single-head archs score Q X^T, l d, and their A V over the n parts of V
  is l d as well (eq. 5 and the rank-3 V of §3.1);
- per arch extras: Part_Bias and Shatter add Q R^T (n d, the n columns padded to 16 in the
  projection GEMM that computes them) and the bias B = sum_h (Q R^T)[:, h]
  N[h] (n l; N is a constant, so its backward has one product, not two), Shatter also
  A_part V_part (n d), all §3.3; BERT-RPE adds Q K_rel^T and A_rel V_rel (r d each, r = min(2 l - 1, 2 m - 1)
  relative rows, §2); XLNet adds the position term (q + v) . W_R r over 2 l - 1 distances and the
  two segment scores (Dai et al. 2019 §3.3, Yang et al. 2019 §2.5), and its permutation LM runs
  a second (query) stream with its own W^Q, attention, W^O and FFN (§2.3), while the last
  layer's content stream is computed but gets no gradient;
- the MLM head on the predicted share p of the tokens only (cramming): dense d^2 plus the decoder
  d V (BERT's tied output layer).

Products computed once per forward from weights alone (Part_Bias's and Shatter's R W^Q, Shatter's
R W^V, RPE's R W^K and R W^V, XLNet's W_R r) are shared out over the micro-batch's tokens when it is given (a run gives it):
at micro-batch 16 and l = 256 they add under 0.1% for Shatter.
Elementwise work (softmax, sigmoid, L2 normalisation, N, LayerNorm, GELU) is not counted, as in
the convention. tests/train/test_cost.py checks the count against a hand count (bert-base,
shatter-base) and against torch's FLOP counter on small models of every arch.

MFU = achieved model FLOPs per second per device / the device's dense peak at the run's
precision, from DEVICE_PEAK_TFLOPS by CUDA device name, or `run.peak_tflops` when set. A CPU
has no such table entry: MFU is left out (null) unless `run.peak_tflops` gives a peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shatter.config import ModelConfig

# Dense (no sparsity) peak TFLOP/s per device and precision: vendors' datasheets. fp32 is the
# non-tensor-core rate (torch's default has TF32 matmuls off). Keyed by the model in
# torch.cuda.get_device_name() (`device_model`: "NVIDIA H100 PCIe" is "H100 PCIe", "Tesla
# V100-SXM2-32GB" is "V100"), matched exactly: "L40" is not the "L4".
DEVICE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # SXM2; no bf16
}
VENDOR_WORDS = {"NVIDIA", "Tesla", "GeForce", "RTX"}
VARIANT_WORDS = ("PCIe", "NVL")  # a model's variants with other peaks


def device_model(device_name: str) -> str:
    """The table's key for a CUDA device name: its model word, and a variant word if any."""
    words = [w for w in re.split(r"[\s\-_]+", device_name.strip()) if w]
    words = [w for w in words if w not in VENDOR_WORDS] or [""]
    variant = next((w for w in words[1:] if w in VARIANT_WORDS), None)
    return f"{words[0]} {variant}" if variant else words[0]


def projections(config: ModelConfig) -> int:
    """d x d input projections per layer: W^Q, W^K, W^V (eq. 1); no W^K where K = X (§3.2)."""
    from shatter.attention import ATTENTIONS, SingleHeadPartitionAttention

    return 2 if issubclass(ATTENTIONS[config.arch], SingleHeadPartitionAttention) else 3


def attention_macs(config: ModelConfig, length: int) -> int:
    """Multiply-adds per token per layer of the attention itself (the l x l terms and the arch's
    extras), one stream."""
    d, n, arch = config.hidden, config.heads, config.arch
    macs = 2 * length * d  # Q K^T (or Q X^T) and A V, eq. 1-2 / eq. 5
    if arch in ("part-bias", "shatter"):
        macs += (
            -(-n // 16) * 16 * d
        )  # c = Q R^T (§3.3), n columns of the projection GEMM padded to 16
        macs += n * length  # B[i, :] = sum_h c[i, h] N[h, i, :] (§3.3): N is constant
    if projections(config) == 2:  # the single-head archs: W^O reads [X̄ | A_part]
        # A_part's n columns (§3.3's A_part V_part folded in; zeros without it), padded with zero
        # columns to a multiple of 16 so the context's rows stay aligned (projection.py)
        macs += -(-n // 16) * 16 * d
    if arch == "bert-rpe":
        r = min(2 * length - 1, 2 * config.rpe_max_distance - 1)
        macs += 2 * r * d  # Q K_rel^T and A_rel V_rel (§2)
    if arch == "xlnet":
        macs += (2 * length - 1) * d + 2 * d  # (q + v) . W_R r_{i-j}, (q + b) . s+/-
    return macs


def _stream_macs(config: ModelConfig, length: int) -> tuple[int, int]:
    """(projections and attention, finish) multiply-adds per token per layer of one stream;
    finish is W^O (eq. 3) and the FFN."""
    d = config.hidden
    return (
        projections(config) * d * d + attention_macs(config, length),
        d * d + 2 * d * config.ffn,
    )


def forward_macs_per_token(
    config: ModelConfig, length: int, predicted: float, two_stream: bool = False
) -> float:
    """Multiply-adds of one forward per input token at length `length`, with a share
    `predicted` of the tokens decoded by the MLM head."""
    d = config.hidden
    attend, finish = _stream_macs(config, length)
    layer = attend + finish
    if two_stream:  # XLNet's query stream: its own W^Q, attention over the content, finish
        layer += d * d + attention_macs(config, length) + finish
    head = predicted * (d * d + d * config.vocab_size)  # dense + tied decoder
    return config.layers * layer + head


def weight_flops_per_forward(config: ModelConfig, length: int) -> float:
    """Training FLOPs of the products made once per forward from weights alone, all layers:
    Part_Bias's and Shatter's R W^Q (n d^2: c = Q R^T = x (R W^Q)^T + R b^Q comes out of the
    projection GEMM), Shatter's W^O folded with V_part = R W^V (W^V R^T, then W^O times it:
    2 n d^2, §3.3; shatter/attention/layer_weights.py), R b^Q (n d), and RPE's K_rel = R W^K,
    V_rel = R W^V (r d^2 each, §2), forward and both gradients (3 x 2); XLNet's W_R r over
    2 l - 1 distances (r is fixed: forward and the weight gradient, 2 x 2)."""
    d, arch = config.hidden, config.arch
    if arch in ("part-bias", "shatter"):
        products = 3 if arch == "shatter" else 1  # R W^Q, and W^V R^T, W^O (W^V R^T)
        # each n d^2, plus R b^Q (n d)
        return config.layers * 6.0 * config.heads * d * (products * d + 1)
    if arch == "bert-rpe":
        r = min(2 * length - 1, 2 * config.rpe_max_distance - 1)
        return config.layers * 6.0 * 2 * r * d * d
    if arch == "xlnet":
        return config.layers * 4.0 * (2 * length - 1) * d * d
    return 0.0


def training_flops_per_token(
    config: ModelConfig,
    length: int,
    predicted: float,
    two_stream: bool = False,
    micro_batch: int | None = None,
) -> float:
    """Model FLOPs of one training token: 3 x 2 x the forward multiply-adds (PaLM App. B).
    Two streams: the last layer's content stream (its W^Q, attention, W^O and FFN) feeds
    nothing the loss reads (predictions come from the query stream), so it has no backward.
    With `micro_batch`, the once-per-forward weight products are shared out over its tokens."""
    flops = 6.0 * forward_macs_per_token(config, length, predicted, two_stream)
    if two_stream:
        d = config.hidden
        _, finish = _stream_macs(config, length)
        flops -= 4.0 * (d * d + attention_macs(config, length) + finish)
    if config.arch in ("part-bias", "shatter"):
        flops -= 2.0 * config.layers * config.heads * length  # B's backward: no gradient of N
    if micro_batch:
        flops += weight_flops_per_forward(config, length) / (micro_batch * length)
    return flops


def device_peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The dense peak of a CUDA device by name at `precision`; None when its model is not in
    the table (MFU is then not reported: set `run.peak_tflops`)."""
    if not device_name:
        return None
    model = device_model(device_name)
    peaks = DEVICE_PEAK_TFLOPS.get(model) or DEVICE_PEAK_TFLOPS.get(model.split(" ")[0], {})
    return peaks.get(precision)


@dataclass(frozen=True)
class CostModel:
    """What the loop needs to turn tokens and seconds into the cost fields of a log line."""

    flops_per_token: float  # training model FLOPs per token
    peak_flops: float | None  # dense FLOP/s of one device; None: MFU not reported
    world: int  # devices (ranks)
    max_steps: int

    def fields(self, tokens_per_s: float, s_per_step: float, step: int, gpu_hours: float) -> dict:
        per_gpu = tokens_per_s / self.world
        mfu = per_gpu * self.flops_per_token / self.peak_flops if self.peak_flops else None
        return {
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu,
            "hours_to_max_steps": max(self.max_steps - step, 0) * s_per_step / 3600,
            "gpu_hours": gpu_hours,
        }


def cost_model(cfg, model_config: ModelConfig, seq_len: int, world: int, device) -> CostModel:
    """From a run's TrainConfig, its model config, length, world size and torch device."""
    plm = (cfg.data.objective or ("plm" if model_config.arch == "xlnet" else "mlm")) == "plm"
    predicted = 1.0 / cfg.data.plm_ratio if plm else cfg.data.mask_prob
    flops = training_flops_per_token(
        model_config, seq_len, predicted, two_stream=plm, micro_batch=cfg.run.micro_batch
    )
    peak = cfg.run.peak_tflops
    if peak is None and getattr(device, "type", None) == "cuda":
        import torch

        peak = device_peak_tflops(torch.cuda.get_device_name(device), cfg.run.precision)
    return CostModel(flops, peak * 1e12 if peak else None, world, cfg.run.max_steps)
