"""Mixing: several datasets in one training stream, drawn by weight (`--data DIR:WEIGHT ...`).

Global stream position q (`train.loader.order`) is mapped to (source i, position t in source
i's own stream): each source is an endless stream of its own epochs (its own `EpochOrder`), and
the mixture decides which source each global position draws from. The positions come in blocks of
`BLOCK`: every block holds c_i positions of source i, the weights apportioned to the block by
largest remainders (so the shares are the weights to within 1/BLOCK), spread evenly over the
block: source i's j-th position of a block sits at the rank of (j + u_i) / c_i among all such
keys, with phases u_i drawn from the seed. So any window of positions draws each source in
proportion to within a few rows, a source's position t is arithmetic on q
(t = (q div BLOCK)·c_i + j), and the mapping depends on (seed, q) alone: a run resumes exactly,
also on another world size, from the one integer it saves. Each source's epoch is t div rows_i.

As MosaicML streaming's `Stream(proportion=...)`, but deterministic and without a sample list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from pipeline.format import Index
from train.loader.order import EpochOrder

BLOCK = 4096  # positions per block of the schedule: shares are exact to 1/BLOCK
_PHASE_SALT = 0x4D4958  # the seed's stream for the sources' phases


class MixError(ValueError):
    """Weights that cannot be mixed; the message names the fix."""


def apportion(weights: Sequence[float], seats: int) -> np.ndarray:
    """Integer counts summing to `seats`, proportional to `weights` (largest remainders, ties
    to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise MixError(f"mixing weights must be positive numbers, got {list(weights)}")
    exact = w / w.sum() * seats
    counts = np.floor(exact).astype(np.int64)
    order = np.lexsort((np.arange(len(w)), -(exact - counts)))
    counts[order[: seats - int(counts.sum())]] += 1
    if np.any(counts == 0):
        small = [float(x) for x, c in zip(weights, counts) if c == 0]
        raise MixError(
            f"weight(s) {small} are under 1/{seats} of the total: raise them (or leave the "
            "dataset out)"
        )
    return counts


class Mixture:
    """Global positions → (source, position in that source): see the module docstring."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK):
        self.counts = apportion(weights, block)
        self.block = block
        phases = np.random.default_rng([seed, _PHASE_SALT]).random(len(self.counts))
        source = np.repeat(np.arange(len(self.counts)), self.counts)
        j = np.concatenate([np.arange(c) for c in self.counts])
        keys = (j + phases[source]) / self.counts[source]
        order = np.lexsort((source, keys))
        self.source_at, self.rank_at = source[order], j[order]  # [block] each

    def locate(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in that source's stream) of global positions q."""
        full, at = np.divmod(np.asarray(q, dtype=np.int64), self.block)
        source = self.source_at[at]
        return source, full * self.counts[source] + self.rank_at[at]

    def drawn(self, q: int) -> np.ndarray:
        """How many of the global positions before q each source has given."""
        full, at = divmod(int(q), self.block)
        within = np.bincount(self.source_at[:at], minlength=len(self.counts))
        return full * self.counts + within


class MixedOrder:
    """`EpochOrder`'s interface over several sources: their shards numbered one after another
    (source i's shard s is shard offset_i + s), each source read in its own epochs."""

    def __init__(self, orders: Sequence[EpochOrder], weights: Sequence[float], seed: int):
        self.orders, self.mixture = list(orders), Mixture(weights, seed)
        self.offset = np.cumsum([0] + [len(o.rows) for o in self.orders])
        rows_before = np.cumsum([0] + [o.size for o in self.orders])
        # canonical row id: unique over the sources (dynamic masks are seeded by it)
        self.base = np.concatenate(
            [before + o.base[:-1] for before, o in zip(rows_before, self.orders)]
            + [[rows_before[-1]]]
        )
        self.size = int(rows_before[-1])

    def source_of(self, shard: int) -> int:
        return int(np.searchsorted(self.offset, shard, side="right") - 1)

    def next_shard(self, epoch: int, shard: int) -> int:
        """The shard read after `shard`: its own source's next (in that source's epochs)."""
        i = self.source_of(shard)
        return int(self.offset[i] + self.orders[i].next_shard(epoch, shard - self.offset[i]))

    def by_shard(self, q: np.ndarray) -> Iterator[tuple[int, np.ndarray, int, np.ndarray]]:
        """(source's epoch, indices into q, shard, rows) for each (source, epoch, shard) that
        positions q touch."""
        source, t = self.mixture.locate(q)
        for i in np.unique(source):
            hit = np.flatnonzero(source == i)
            for epoch, where, s, rows in self.orders[i].by_shard(t[hit]):
                yield epoch, hit[where], int(self.offset[i] + s), rows


def stream_shape(index: Index, mix: Sequence[tuple[Index, float]] | None):
    """(epoch_size, mix) of a run's `StreamPosition`: the train rows of its one dataset, or of
    all its mixed datasets together and the (rows, weight) of each."""
    if mix is None:
        return index.rows("train"), None
    shape = tuple((ix.rows("train"), float(weight)) for ix, weight in mix)
    return sum(rows for rows, _ in shape), shape


def source_epochs(mix: Sequence[tuple[Index, float]], seed: int, samples: int) -> dict[str, float]:
    """Each mixed dataset's epochs (rows drawn / its train rows) after `samples` global positions."""
    drawn = Mixture([w for _, w in mix], seed).drawn(samples)
    return {ix.root: float(n) / ix.rows("train") for n, (ix, _) in zip(drawn, mix)}
