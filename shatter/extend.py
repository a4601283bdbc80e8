"""Length extension: a model pretrained at max_len L0 made ready for inputs of length N > L0.

What changes depends on how the arch encodes position (paper §3.1, §4.2.2 "Extending Max
Sequence Length"):

- shatter, part-mask, 1h-softmax, 1h-sigmoid, part-bias: nothing learnt. N[h, i, j] = f_h(j - i)
  is defined at every relative position, so the model is rebuilt for N and its partition tables
  (non-persistent buffers of shape (n, 2N - 1)) are recomputed; the weights are copied as they are.
- bert-rpe: nothing learnt; distances beyond +-(rpe_max_distance - 1) share the edge embeddings.
- no-position: nothing position-dependent at all.
- bert, bert-rab: the absolute position table P (eq. 4) gains rows L0..N-1. `init="random"` draws
  them from N(0, initializer_range), the pretraining initializer, as the paper does for
  "BERT 512-l ext."; `init="copy"` tiles the learnt rows (row i takes row i mod L0), as Longformer
  (Beltagy et al., 2020) does, which usually finetunes better. The learnt rows never change.

`extend_model` is pure (a new module; the input is untouched). Because every position-free arch
attends by relative position only and the learnt rows are kept, outputs on inputs of length
<= L0 are unchanged: `tests/extend/` checks that property for every arch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from shatter.config import ModelConfig
from shatter.model import ShatterForMaskedLM

INITS = ("random", "copy")


class ExtendError(ValueError):
    """A model or request that cannot be extended; the message says why."""


@dataclass(frozen=True)
class ExtendReport:
    """What an extension changed."""

    arch: str  # the model's arch
    old_max_len: int  # L0
    new_max_len: int  # N
    init: str  # how new absolute rows were filled ("random" or "copy"); moot when none are added
    added: dict  # parameter name -> number of scalars added
    rebuilt_buffers: dict  # non-persistent buffer name -> new shape (the partition tables)

    @property
    def parameters_added(self) -> int:
        return sum(self.added.values())

    def describe(self) -> str:
        lines = [f"{self.arch}: max_len {self.old_max_len} -> {self.new_max_len}"]
        if self.added:
            for name, n in self.added.items():
                lines.append(
                    f"  {name}: +{n:,} parameters ({self.init} init of rows "
                    f"{self.old_max_len}..{self.new_max_len - 1}; learnt rows unchanged)"
                )
        else:
            lines.append("  no parameters added: position is relative (weights copied unchanged)")
        if self.rebuilt_buffers:
            shapes = sorted({tuple(s) for s in self.rebuilt_buffers.values()})
            lines.append(
                f"  partition tables N recomputed for the new length in "
                f"{len(self.rebuilt_buffers)} layer(s): shape(s) {', '.join(map(str, shapes))}"
            )
        lines.append(f"  total parameters added: {self.parameters_added:,}")
        return "\n".join(lines)


def _rebuild(model: nn.Module, config: ModelConfig) -> nn.Module:
    """A fresh module of the same kind (MLM model, or a finetuning head around one) for `config`."""
    backbone = ShatterForMaskedLM(config)
    head_config = getattr(model, "head_config", None)
    if head_config is None:
        return backbone
    from shatter.heads import build_head

    return build_head(backbone, head_config())


def new_position_rows(
    learnt: torch.Tensor,
    max_len: int,
    init: str,
    std: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """P extended to `max_len` rows: the learnt rows first, then `init`'s rows."""
    old_len, hidden = learnt.shape
    extra = max_len - old_len
    if init == "random":
        rows = torch.randn(extra, hidden, generator=generator, dtype=torch.float32) * std
    elif init == "copy":
        rows = learnt[torch.arange(old_len, max_len) % old_len]
    else:
        raise ExtendError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    return torch.cat([learnt, rows.to(learnt.dtype)], dim=0)


def extend_model(
    model: nn.Module, max_len: int, init: str = "random", seed: int = 0
) -> tuple[nn.Module, ExtendReport]:
    """Return (a copy of `model` for inputs up to `max_len`, what changed)."""
    config: ModelConfig = model.config
    if init not in INITS:
        raise ExtendError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    if max_len <= config.max_len:
        raise ExtendError(
            f"--max-len {max_len} is not larger than the model's max_len {config.max_len}; "
            "extension only lengthens (a shorter input needs no change)"
        )
    new_config = dataclasses.replace(config, max_len=max_len)
    extended = _rebuild(model, new_config)
    state = model.state_dict()
    target = extended.state_dict()
    generator = torch.Generator().manual_seed(seed)
    added = {}
    for name, tensor in state.items():
        if name not in target:
            raise ExtendError(
                f"parameter {name} has no place in a {config.arch} model of length {max_len}"
            )
        if target[name].shape == tensor.shape:
            continue
        if not name.endswith("position_embeddings.weight") or tensor.shape[0] != config.max_len:
            raise ExtendError(
                f"{name} changes shape with max_len ({tuple(tensor.shape)} -> {tuple(target[name].shape)}) "
                "and is not an absolute position table: this arch cannot be extended safely"
            )
        state[name] = new_position_rows(tensor, max_len, init, config.initializer_range, generator)
        added[name] = (max_len - config.max_len) * tensor.shape[1]
    extended.load_state_dict(state, strict=True)
    extended.train(model.training)
    rebuilt = {
        name: tuple(buf.shape)
        for name, buf in extended.named_buffers()
        if name.endswith("partition") and buf.dim() == 2
    }
    report = ExtendReport(
        config.arch, config.max_len, max_len, init, added, dict(sorted(rebuilt.items()))
    )
    return extended, report
