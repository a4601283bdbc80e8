"""The model config: one frozen dataclass, named size presets, and strict (de)serialisation.

`ModelConfig` is what `config.json` in an export holds (docs/model.md, Exports). Presets are `"{arch}-{size}"`;
base and large follow Table 2 of the paper: 12 layers, hidden
768, 12 heads or parts; and 24 layers, hidden 1024, 16 heads or parts. See docs/model.md for the
Table 2 discrepancy (its Large parameter counts match 12 layers, not 24).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shatter.attention import ATTENTIONS  # the registry is the one list of archs

ARCHS = tuple(ATTENTIONS)

# How the single-head partition archs compute attention (shatter/attention/impls.py): every impl
# gives the same values and gradients from the same weights; `auto` picks one by device.
ATTENTION_IMPLS = ("auto", "triton", "fused", "rows", "rows-keep", "chunked", "lean", "naive")
FFN_IMPLS = ("auto", "triton", "torch")  # shatter/ffn.py

# Archs whose attention multiplies by the partition mask N (§3.1): heads are the n parts.
PARTITION_ARCHS = tuple(name for name, cls in ATTENTIONS.items() if cls.parts)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of ARCHS: the attention variant (shatter/attention/)
    vocab_size: int = 32000  # word embeddings rows; the pipeline's tokenizer size
    hidden: int = 768  # d, the hidden size
    layers: int = 12  # L, the number of encoder blocks
    heads: int = 12  # attention heads; for partition archs the number of parts n (even, >= 4)
    ffn: int = 3072  # inner width of the GELU feed-forward network (4d in the paper)
    max_len: int = 512  # longest input; rows of the absolute position embeddings (bert, bert-rab)
    dropout: float = 0.1  # hidden dropout: embeddings, after W^O, after the FFN
    attention_dropout: float = 0.1  # dropout on softmax attention probabilities (softmax archs)
    initializer_range: float = 0.02  # std of the normal init of weights (BERT's value)
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon (BERT's value)
    pad_id: int = 0  # [PAD] id (shatter.shards.tokenizer's special ids)
    sep_id: int = 3  # [SEP] id: xlnet's segments are counted from it (index.json special_ids)
    rpe_max_distance: int = 128  # bert-rpe: R has 2*128-1 rows, distances clipped to +-127 (§4)
    rab_buckets: int = 32  # bert-rab: T5 relative attention bias buckets (T5 default)
    rab_max_distance: int = 128  # bert-rab: T5 max distance for the log-spaced buckets
    attention_impl: str = "auto"  # single-head partition archs: one of ATTENTION_IMPLS
    fused_qkv: bool = True  # multi-head archs: Q, K, V from one [d, 3d] GEMM (same weights)
    ffn_impl: str = "auto"  # every arch: GELU in the FFN GEMMs' epilogues or not (FFN_IMPLS)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; expected one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "hidden", "layers", "heads", "ffn", "max_len"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("pad_id", "sep_id"):
            if not 0 <= int(getattr(self, name)) < self.vocab_size:
                raise ValueError(
                    f"config.{name} must be an id below vocab_size={self.vocab_size}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.arch in PARTITION_ARCHS and (self.heads < 4 or self.heads % 2):
            raise ValueError(
                f"arch {self.arch!r} needs an even number of parts >= 4 (appendix: D = n/2 - 1 >= 1), "
                f"got heads={self.heads}"
            )
        if self.arch == "bert-rab" and (
            self.rab_buckets < 4
            or self.rab_buckets % 4
            or self.rab_max_distance <= self.rab_buckets // 4
        ):
            # T5's bidirectional buckets: half per sign, exact below rab_buckets/4, log-spaced
            # from there to rab_max_distance, so the log range must be non-empty.
            raise ValueError(
                f"bert-rab needs rab_buckets a multiple of 4 (>= 4) and rab_max_distance > rab_buckets/4, "
                f"got rab_buckets={self.rab_buckets}, rab_max_distance={self.rab_max_distance}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; expected one of "
                f"{', '.join(ATTENTION_IMPLS)}"
            )
        if self.ffn_impl not in FFN_IMPLS:
            raise ValueError(
                f"unknown ffn_impl {self.ffn_impl!r}; expected one of {', '.join(FFN_IMPLS)}"
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"config.{name} must be in [0, 1), got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from a dict (e.g. config.json), rejecting keys this version does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(unknown)}")
        if "arch" not in data:
            raise ValueError("ModelConfig needs an 'arch'")
        return cls(**data)


# The ModelConfig fields that hold a special token's id, by the token's piece.
SPECIAL_ID_FIELDS = {"[PAD]": "pad_id", "[SEP]": "sep_id"}


def special_id_overrides(special_ids: Mapping[str, int]) -> dict[str, int]:
    """The config fields for a tokenizer's special ids (index.json `tokenizer.special_ids`,
    `{"[PAD]": 0, "[SEP]": 3, ...}`); pieces it does not list keep the config's defaults."""
    return {
        field: int(special_ids[piece])
        for piece, field in SPECIAL_ID_FIELDS.items()
        if piece in special_ids
    }


# Sizes: tiny and small are for CPU runs and tests; base and large follow Table 2.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=64, layers=2, heads=4, ffn=256),
    "small": dict(hidden=256, layers=4, heads=4, ffn=1024),
    "base": dict(hidden=768, layers=12, heads=12, ffn=3072),
    "large": dict(hidden=1024, layers=24, heads=16, ffn=4096),
}


def preset_config(preset: str, **overrides: Any) -> ModelConfig:
    """`"{arch}-{size}"` plus any config field overrides, e.g. `max_len=1024`."""
    arch, _, size = preset.rpartition("-")
    if arch not in ARCHS or size not in SIZES:
        names = ", ".join(f"{a}-{{{','.join(SIZES)}}}" for a in ARCHS)
        raise ValueError(f"unknown preset {preset!r}; presets are {names}")
    fields = {"arch": arch, **SIZES[size], **overrides}
    return ModelConfig.from_dict(fields)
