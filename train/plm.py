"""Permutation-LM batches (XLNet, Yang et al. 2019): targets and a factorisation order per row.

Inputs are never replaced by [MASK]: a PLM batch is the row's own ids, `labels` (the token at
each target, IGNORE elsewhere) and `perm_rank` (each token's place in the factorisation order
z, shatter/xlnet.py). Partial prediction (XLNet §2.3): only the last tokens of the order are
predicted. The non-targets share rank -1 (they come first and see each other, as in XLNet's
implementation); the targets follow in a random order, ranks 0..M-1.

Targets, by `data.plm_targets`:
- "spans" (default): XLNet's span sampling (its `_sample_mask`): repeatedly draw a span length
  n in 1..max_span with p(n) ∝ 1/n, a context block of n * ratio tokens (ratio K = 6), and
  predict the n tokens at a random offset in the block: about 1/K of the tokens.
- "static": the shards' stored mask positions (the copy the MLM would use that epoch) are the
  targets; their stored inputs are not used.

Every draw comes from a generator seeded by (seed, epoch, sample id), as the dynamic masks of
train/masking.py are: a row's targets and order do not depend on ranks, workers, batch
composition or the resume point, so a resumed run is exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shatter.shards.tokenizer import SPECIAL_IDS
from shatter.train.config import ConfigError, TrainConfig
from shatter.train.masking import IGNORE, static_mask

OBJECTIVES = ("mlm", "plm")
TARGETS = ("spans", "static")


def default_objective(arch: str) -> str:
    """The arch's own objective: "plm" for two-stream attention (xlnet), else "mlm"."""
    from shatter.attention import ATTENTIONS

    return "plm" if hasattr(ATTENTIONS.get(arch), "two_stream") else "mlm"


def with_objective(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with data.objective resolved: the arch's own (plm for xlnet, mlm otherwise) when
    unset; plm for an MLM arch is refused."""
    d = cfg.data
    if d.objective is not None and d.objective not in OBJECTIVES:
        raise ConfigError(f"data.objective must be one of {OBJECTIVES}, got {d.objective!r}")
    if d.plm_targets not in TARGETS:
        raise ConfigError(f"data.plm_targets must be one of {TARGETS}, got {d.plm_targets!r}")
    if d.plm_ratio < 2 or d.plm_max_span < 1:
        raise ConfigError("data.plm_ratio must be >= 2 and data.plm_max_span >= 1")
    own = default_objective(cfg.model.preset.rpartition("-")[0])
    objective = d.objective or own
    if objective == "plm" and own != "plm":
        raise ConfigError(
            f"objective plm needs a two-stream arch (xlnet); {cfg.model.preset} is a masked-LM "
            "arch: drop --objective plm (data.objective) or use an xlnet preset"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(d, objective=objective))


def _rng(seed: int, epoch: int, uid: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, int(uid)])


def _candidates(ids_BL: np.ndarray, lengths_B: np.ndarray) -> np.ndarray:
    """Real, non-special tokens: the ones that may be predicted."""
    in_row = np.arange(ids_BL.shape[1])[None, :] < lengths_B[:, None]
    return in_row & ~np.isin(ids_BL, SPECIAL_IDS)


def sample_spans(
    candidate_L: np.ndarray, rng: np.random.Generator, ratio: int, max_span: int
) -> np.ndarray:
    """XLNet's `_sample_mask` over one row: bool [L], spans of 1..max_span tokens, ~1/ratio."""
    L = len(candidate_L)
    target = np.zeros(L, dtype=bool)
    lengths = np.arange(1, max_span + 1)
    p = 1.0 / lengths
    p /= p.sum()
    cur = 0
    while cur < L:
        n = int(rng.choice(lengths, p=p))
        block = n * ratio
        left = int(rng.integers(block - n + 1))
        beg = cur + left
        if beg >= L:
            break
        target[beg : beg + n] = True
        cur += block
    return target & candidate_L


def _order(target_L: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """perm_rank of one row: -1 at non-targets, a random order 0..M-1 over the targets."""
    rank = np.full(len(target_L), -1, dtype=np.int64)
    where = np.flatnonzero(target_L)
    rank[where] = rng.permutation(len(where))
    return rank


def plm_batch(
    ids_BL: np.ndarray,
    lengths_B: np.ndarray,
    uid_B: np.ndarray,
    *,
    epoch: int,
    seed: int,
    ratio: int = 6,
    max_span: int = 5,
    static_labels_BL: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, perm_rank), int64 [B, L]. With `static_labels_BL` its predicted
    positions are the targets; otherwise spans are drawn."""
    ids_BL = ids_BL.astype(np.int64, copy=False)
    candidate = _candidates(ids_BL, lengths_B)
    labels = np.full(ids_BL.shape, IGNORE, dtype=np.int64)
    rank = np.full(ids_BL.shape, -1, dtype=np.int64)
    for b, uid in enumerate(uid_B):
        rng = _rng(seed, epoch, uid)
        if static_labels_BL is None:
            target = sample_spans(candidate[b], rng, ratio, max_span)
        else:
            target = (static_labels_BL[b] != IGNORE) & candidate[b]
        labels[b, target] = ids_BL[b, target]
        rank[b] = _order(target, rng)
    return ids_BL, labels, rank


def static_plm_batch(
    ids_BL, lengths_B, shard, rows_B, copy: int, uid_B, *, epoch: int, seed: int, shift_B=None
):
    """`plm_batch` with the stored masking number `copy` of each row as the targets."""
    _, labels = static_mask(ids_BL, lengths_B, shard, rows_B, copy, shift_B)
    return plm_batch(ids_BL, lengths_B, uid_B, epoch=epoch, seed=seed, static_labels_BL=labels)
