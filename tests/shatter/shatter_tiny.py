"""Tiny models and inputs shared by the model tests."""

import torch

import shatter

VOCAB = 50
RELATIVE = [
    "bert-rpe",
    "no-position",
    "part-mask",
    "1h-softmax",
    "1h-sigmoid",
    "part-bias",
    "shatter",
    "xlnet",
]
ABSOLUTE = ["bert", "bert-rab"]


def tiny(arch: str, seed: int = 0, **overrides) -> shatter.ShatterForMaskedLM:
    """A tiny model in eval mode with deterministic weights."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=VOCAB, dropout=0.0, attention_dropout=0.0, max_len=64)
    kwargs.update(overrides)
    return shatter.build_model(f"{arch}-tiny", **kwargs).eval()


def ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (batch, length), generator=g)
