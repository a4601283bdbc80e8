"""The collate: rows read from record batches become `Piece`s, one masker masks them, and the
masked pieces are laid out as one named batch padded to its longest row.

The masker is chosen once, from the `MaskingSpec`, when the stream is built (`make_masker`):
static masks scatter a stored masking of the row's record batch, so each block's piece is masked
on its own; dynamic masks and the permutation LM's spans depend on (seed, epoch, row id) alone, so
a batch's pieces of one epoch are stacked and masked in one call (academic-budget-bert's static
masks with a dupe factor, RoBERTa's dynamic masking).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shatter.shards import Shard
from shatter.train.masking import CLS, IGNORE, PAD, SEP, dynamic_mask, ragged_gather, static_mask
from shatter.train.plm import plm_batch, static_plm_batch


@dataclass(frozen=True)
class MaskingSpec:
    mode: str  # "static" or "dynamic"
    fixed_copy: int | None = None  # static: always this stored masking (validation uses 0)
    mask_prob: float = 0.15
    whole_word: bool = False
    objective: str = "mlm"  # "plm": targets and a factorisation order instead (train/plm.py)
    plm_targets: str = "spans"
    plm_ratio: int = 6
    plm_max_span: int = 5


def _plm_fields(d) -> dict:
    return dict(
        objective=d.objective or "mlm",
        plm_targets=d.plm_targets,
        plm_ratio=d.plm_ratio,
        plm_max_span=d.plm_max_span,
    )


def masking_spec(data_args) -> MaskingSpec:
    """The training stream's masking, from the config's data section."""
    d = data_args
    return MaskingSpec(d.masking, None, d.mask_prob, d.whole_word, **_plm_fields(d))


def validation_masking(data_args) -> MaskingSpec:
    """The validation stream's masking: the fixed stored masks (copy 0), comparable across runs."""
    return MaskingSpec("static", fixed_copy=0, **_plm_fields(data_args))


@dataclass(frozen=True)
class Piece:
    """Unmasked rows of one record batch (or of several, stacked) bound for one batch."""

    where: np.ndarray  # [n] their slots in the batch
    ids: np.ndarray  # [n, L] int64, PAD beyond each row's length
    word_start: np.ndarray  # [n, L] bool
    length: np.ndarray  # [n]
    uid: np.ndarray  # [n] canonical row id: base of its shard + row
    epoch: int
    block: Shard | None = None  # the record batch they were read from (its stored masks)
    rows: np.ndarray | None = None  # [n] their rows in `block`
    shift: np.ndarray | None = None  # [n] a cut row: stored position - piece position

    @staticmethod
    def stack(pieces: list[Piece]) -> Piece:
        """Several pieces of one epoch as one, padded to the widest (without their blocks)."""
        if len(pieces) == 1:
            return pieces[0]
        n, L = sum(len(p.where) for p in pieces), max(p.ids.shape[1] for p in pieces)
        ids, ws = np.full((n, L), PAD, np.int64), np.zeros((n, L), bool)
        at = 0
        for p in pieces:
            k, w = p.ids.shape
            ids[at : at + k, :w], ws[at : at + k, :w] = p.ids, p.word_start
            at += k

        def cat(field: str) -> np.ndarray:
            return np.concatenate([getattr(p, field) for p in pieces])

        return Piece(cat("where"), ids, ws, cat("length"), cat("uid"), pieces[0].epoch)


@dataclass(frozen=True)
class Masked:
    """A masked piece: model inputs and targets for its slots of the batch."""

    where: np.ndarray
    inputs: np.ndarray  # [n, L] int64
    labels: np.ndarray  # [n, L] int64, IGNORE where not predicted
    length: np.ndarray
    uid: np.ndarray
    epoch: int
    perm_rank: np.ndarray | None = None  # [n, L] the permutation LM's factorisation order


def gather(
    block: Shard,
    rows: np.ndarray,
    seq_len: int,
    *,
    where: np.ndarray,
    uid: np.ndarray,
    epoch: int,
    piece: np.ndarray | None = None,
    k: int = 1,
) -> Piece:
    """The piece of `rows` of `block`, truncated to `seq_len`: [CLS] … and a final [SEP] kept;
    cut by k > 1 (`shatter.train.loader.order.cut`): piece number `piece` of each row instead."""
    if k > 1:
        return gather_cut(block, rows, seq_len, where=where, uid=uid, epoch=epoch, piece=piece, k=k)
    idx, valid = ragged_gather(block.ids_off, rows)
    length = valid.sum(1)
    L = seq_len
    if idx.shape[1] > L:
        idx, valid = idx[:, :L], valid[:, :L]
        cut = length > L
        length = np.minimum(length, L)
    else:
        cut = None
    ids = np.where(valid, block.ids[idx], PAD).astype(np.int64)
    word_start = valid & block.word_start[idx]
    if cut is not None and cut.any():
        ids[cut, L - 1] = SEP
    return Piece(where, ids, word_start, length, uid, epoch, block, rows)


def gather_cut(
    block: Shard,
    rows: np.ndarray,
    seq_len: int,
    *,
    where: np.ndarray,
    uid: np.ndarray,
    epoch: int,
    piece: np.ndarray,
    k: int,
) -> Piece:
    """Piece j of k of each row: `[CLS]`, the row's content tokens j·s … (j+1)·s - 1 (s =
    seq_len - 2; a row's tokens beyond k·s are left out), `[SEP]`. Its id is row id · k + j, so
    dynamic masks differ per piece; `shift` maps the stored static masks onto it."""
    start = block.ids_off[rows]
    content = np.maximum(block.ids_off[rows + 1] - start - 2, 0)  # between [CLS] and last [SEP]
    s = seq_len - 2
    shift = piece.astype(np.int64) * s
    count = np.clip(content - shift, 0, s)  # content tokens in this piece
    col = np.arange(s)
    inside = col[None, :] < count[:, None]
    source = np.where(inside, (start + 1 + shift)[:, None] + col[None, :], 0)
    n = len(rows)
    ids = np.full((n, seq_len), PAD, np.int64)
    ids[:, 0] = CLS
    ids[:, 1:-1] = np.where(inside, block.ids[source], PAD)
    word_start = np.zeros((n, seq_len), bool)
    word_start[:, 1:-1] = inside & block.word_start[source]
    ids[np.arange(n), count + 1] = SEP
    length = count + 2
    return Piece(where, ids, word_start, length, uid * k + piece, epoch, block, rows, shift)


class Masker(Protocol):
    stored: bool  # True: reads the stored masks of the piece's block, so pieces are not stacked

    def __call__(self, piece: Piece) -> Masked: ...


def _masked(piece: Piece, inputs, labels, perm_rank=None) -> Masked:
    return Masked(piece.where, inputs, labels, piece.length, piece.uid, piece.epoch, perm_rank)


@dataclass(frozen=True)
class StaticMasker:
    """One of the row's stored maskings: copy epoch mod dupe_factor, or always `fixed_copy`."""

    dupe_factor: int
    fixed_copy: int | None = None
    stored = True

    def copy(self, epoch: int) -> int:
        return self.fixed_copy if self.fixed_copy is not None else epoch % self.dupe_factor

    def __call__(self, p: Piece) -> Masked:
        copy = self.copy(p.epoch)
        inputs, labels = static_mask(p.ids, p.length, p.block, p.rows, copy, p.shift)
        return _masked(p, inputs, labels)


@dataclass(frozen=True)
class DynamicMasker:
    """A fresh BERT masking per row and epoch, seeded by (seed, epoch, row id) (train/masking.py)."""

    seed: int
    vocab_size: int
    mask_prob: float
    whole_word: bool
    stored = False

    def __call__(self, p: Piece) -> Masked:
        inputs, labels = dynamic_mask(
            p.ids,
            p.length,
            p.word_start,
            p.uid,
            epoch=p.epoch,
            seed=self.seed,
            vocab_size=self.vocab_size,
            mask_prob=self.mask_prob,
            whole_word=self.whole_word,
        )
        return _masked(p, inputs, labels)


@dataclass(frozen=True)
class SpanPlmMasker:
    """The permutation LM with XLNet's span targets and a factorisation order (train/plm.py)."""

    seed: int
    ratio: int
    max_span: int
    stored = False

    def __call__(self, p: Piece) -> Masked:
        ids, labels, rank = plm_batch(
            p.ids,
            p.length,
            p.uid,
            epoch=p.epoch,
            seed=self.seed,
            ratio=self.ratio,
            max_span=self.max_span,
        )
        return _masked(p, ids, labels, rank)


@dataclass(frozen=True)
class StaticPlmMasker:
    """The permutation LM predicting a stored masking's positions (train/plm.py)."""

    seed: int
    static: StaticMasker
    stored = True

    def __call__(self, p: Piece) -> Masked:
        copy = self.static.copy(p.epoch)
        ids, labels, rank = static_plm_batch(
            p.ids,
            p.length,
            p.block,
            p.rows,
            copy,
            p.uid,
            epoch=p.epoch,
            seed=self.seed,
            shift_B=p.shift,
        )
        return _masked(p, ids, labels, rank)


def make_masker(spec: MaskingSpec, *, seed: int, dupe_factor: int, vocab_size: int) -> Masker:
    """The one masker of a stream with masking `spec`."""
    static = StaticMasker(dupe_factor, spec.fixed_copy)
    if spec.objective == "plm":
        if spec.plm_targets == "static":
            return StaticPlmMasker(seed, static)
        return SpanPlmMasker(seed, spec.plm_ratio, spec.plm_max_span)
    if spec.mode == "static":
        return static
    return DynamicMasker(seed, vocab_size, spec.mask_prob, spec.whole_word)


class Collator:
    """Masks a batch's pieces with one masker and lays them out as the batch's named tensors."""

    def __init__(self, masker: Masker):
        self.masker = masker

    def mask(self, pieces: Iterable[Piece]) -> list[Masked]:
        """Each stored-mask piece on its own; otherwise one call per epoch, not per block."""
        if self.masker.stored:
            return [self.masker(p) for p in pieces]
        by_epoch: dict[int, list[Piece]] = {}
        for p in pieces:
            by_epoch.setdefault(p.epoch, []).append(p)
        return [self.masker(Piece.stack(group)) for group in by_epoch.values()]

    def __call__(self, pieces: Iterable[Piece], size: int) -> dict[str, torch.Tensor]:
        """The batch of `size` rows that `pieces` fill, padded to its longest row."""
        return assemble(self.mask(pieces), size)


def assemble(parts: list[Masked], B: int) -> dict[str, torch.Tensor]:
    """The named batch of B rows that the masked pieces fill, padded to its longest row."""
    L = max(p.inputs.shape[1] for p in parts)
    input_ids = np.full((B, L), PAD, np.int64)
    labels = np.full((B, L), IGNORE, np.int64)
    lengths, uids, epochs = np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64)
    plm = parts[0].perm_rank is not None
    rank = np.full((B, L), -1, np.int64) if plm else None
    for p in parts:
        w = p.inputs.shape[1]
        input_ids[p.where, :w] = p.inputs
        labels[p.where, : p.labels.shape[1]] = p.labels
        lengths[p.where], uids[p.where], epochs[p.where] = p.length, p.uid, p.epoch
        if plm:
            rank[p.where, :w] = p.perm_rank
    attention_mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.int64)
    extra = {"perm_rank": torch.from_numpy(rank)} if plm else {}
    return {
        **extra,
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention_mask),
        "labels": torch.from_numpy(labels),
        # the labels' predicted positions, flat (the model's `predicted`): counted here on the
        # host, so that the model's head needs no host sync to gather them on a GPU
        "predicted": torch.from_numpy(np.flatnonzero(labels != IGNORE)),
        "sample_id": torch.from_numpy(uids),  # canonical row id: base of its shard + row
        "epoch": torch.from_numpy(epochs),
    }
