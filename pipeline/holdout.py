"""How a build holds out its validation split for `--validation-fraction` (without
`--validation-input`): pure functions, which the build's DoFns (`shatter.pipeline.transforms`),
the build and its report call.

By default whole documents are held out, by content hash (a document whose key / 2^64 is below the
fraction): no text of a validation document is trained on, and the split is the same for any
tokenizer, length or runner. A corpus of a few long documents (six novels) cannot make the
fraction of whole documents: one book may be a sixth of it. So the build first counts the
documents and their text (`HoldOutStats`), and `decide` picks:
  - whole documents, when they make a share within half to twice the fraction (`in_band`); where
    the hash holds out none, the document with the smallest key is held out instead;
  - else the last `fraction` of each document's text (`tail_split`, cut at a line break or a
    space): the split is the fraction asked, and each document's validation text follows its
    training text, unseen, rather than interleaved with it.
The statistics are of the cleaned text only, so every build of the same inputs (any tokenizer,
`--seq-len` or runner) holds out the same text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

TRAIN, VALIDATION = "train", "validation"


def content_key(data: bytes) -> int:
    """A document's key: the 64-bit blake2b hash of its cleaned UTF-8 text."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def threshold(fraction: float) -> float:
    """Keys below this are held out by hash."""
    return fraction * 2.0**64


def in_band(share: float, asked: float) -> bool:
    """Whether a validation share is close enough to --validation-fraction: within half to twice
    it (the build warns outside it; a whole-document hold-out outside it is not used)."""
    return asked / 2 <= share <= 2 * asked


@dataclass(frozen=True)
class HoldOutStats:
    """What `decide` needs of the corpus's "auto" documents (those without a split of their own),
    summed over batches (`merge`: associative, a Beam combiner's)."""

    documents: int = 0
    chars: int = 0  # of their cleaned text
    hashed_chars: int = 0  # of the documents below the hash threshold
    smallest_key: int | None = None  # the smallest document key
    smallest_chars: int = 0  # that document's characters

    def to_dict(self) -> dict:
        return dict(vars(self))


def batch_stats(keyed: Iterable[tuple[int, int]], fraction: float) -> HoldOutStats:
    """The statistics of documents given as (key, characters)."""
    keyed = list(keyed)
    if not keyed:
        return HoldOutStats()
    below = threshold(fraction)
    smallest = min(keyed)
    return HoldOutStats(
        documents=len(keyed),
        chars=sum(n for _, n in keyed),
        hashed_chars=sum(n for key, n in keyed if key < below),
        smallest_key=smallest[0],
        smallest_chars=smallest[1],
    )


def merge(parts: Iterable[HoldOutStats]) -> HoldOutStats:
    parts = list(parts)
    keyed = [(p.smallest_key, p.smallest_chars) for p in parts if p.smallest_key is not None]
    smallest = min(keyed, default=(None, 0))
    return HoldOutStats(
        documents=sum(p.documents for p in parts),
        chars=sum(p.chars for p in parts),
        hashed_chars=sum(p.hashed_chars for p in parts),
        smallest_key=smallest[0],
        smallest_chars=smallest[1],
    )


def tail_split(text: str, fraction: float) -> tuple[str, str]:
    """(head, tail): the tail is about the last `fraction` of `text`, cut at the line break
    nearest that point if one is within a quarter of the tail's length, else at the nearest
    space within that or 8 characters, else at the point itself (text without spaces)."""
    tail = round(len(text) * fraction)
    if tail == 0:
        return text, ""
    point = len(text) - tail
    for sep, reach in (("\n", tail // 4), (" ", max(tail // 4, 8))):
        before, after = text.rfind(sep, 0, point + 1), text.find(sep, point)
        found = [i for i in (before, after) if i > 0 and abs(i - point) <= reach]
        if found:
            cut = min(found, key=lambda i: abs(i - point))
            return text[:cut], text[cut + 1 :]
    return text[:point], text[point:]


@dataclass(frozen=True)
class HoldOut:
    """The validation hold-out of a build's "auto" documents (`decide`)."""

    fraction: float  # --validation-fraction (0: none)
    smallest_key: int | None = None  # also held out whole (when the hash holds out none)
    tails: bool = False  # the last `fraction` of every document instead of whole documents

    def split(self, text: str, key: int) -> list[tuple[str, str]]:
        """The (split, text) pieces of one document of key `key`: the whole of it in one split,
        or (tails) its head in train and its tail in validation, an empty piece left out."""
        if self.fraction == 0:
            return [(TRAIN, text)]
        if self.tails:
            head, tail = tail_split(text, self.fraction)
            return [(s, t) for s, t in ((TRAIN, head), (VALIDATION, tail)) if t]
        held = key < threshold(self.fraction) or key == self.smallest_key
        return [(VALIDATION if held else TRAIN, text)]

    def describe(self) -> str:
        """How index.json's counters record it (`validation_hold_out`)."""
        return "document tails" if self.tails else "whole documents"


def whole_document_share(stats: HoldOutStats) -> float:
    """The share of the text that a whole-document hold-out would give: the documents below the
    hash threshold, or where there is none, the one of smallest key (if there are two or more)."""
    if not stats.chars:
        return 0.0
    held = stats.hashed_chars or (stats.smallest_chars if stats.documents > 1 else 0)
    return held / stats.chars


def decide(stats: HoldOutStats, fraction: float) -> HoldOut:
    """Whole documents where they make a share `in_band` of `fraction`, else each document's tail."""
    if fraction == 0 or stats.documents == 0:
        return HoldOut(fraction)
    if in_band(whole_document_share(stats), fraction):
        return HoldOut(fraction, None if stats.hashed_chars else stats.smallest_key)
    return HoldOut(fraction, tails=True)
