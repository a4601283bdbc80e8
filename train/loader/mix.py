"""Mixing: several datasets in one training stream, drawn by weight (`--data DIR:WEIGHT ...`).

Global stream position q (`shatter.train.loader.order`) is mapped to (source i, position t in source
i's own stream): each source is an endless stream of its own epochs (its own `EpochOrder`), and
the mixture decides which source each global position draws from. The positions come in blocks of
`BLOCK`: every block holds c_i positions of source i, the weights apportioned to the block by
largest remainders (so the shares are the weights to within 1/BLOCK), spread evenly over the
block: source i's j-th position of a block sits at the rank of (j + u_i) / c_i among all such
keys, with phases u_i drawn from the seed. So any window of positions draws each source in
proportion to within a few rows, a source's position t is arithmetic on q
(t = (q div BLOCK)·c_i + j), and the mapping depends on (seed, q) alone: a run resumes exactly,
also on another world size, from the one integer it saves.

Training below a source's stored length cuts its rows (`shatter.train.loader.order.cut`): source i's
stream is then its own cut stream, k_i = L_i // l rows per stored row, so t is a position in it,
t div k_i its stored position and t mod k_i the piece; its epoch is t div (rows_i·k_i). Datasets
built at 1024 and 512 mix at 256 with k = 4 and 2, each drawn by its weight in rows of the stream.

As MosaicML streaming's `Stream(proportion=...)`, but deterministic and without a sample list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from shatter.shards import Index
from shatter.train.loader.order import EpochOrder, cut_by_shard, cut_factor

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
    (source i's shard s is shard offset_i + s), each source read in its own epochs, cut by its
    own k_i (`cuts`, 1 each by default; `by_shard` also gives each hit's piece and k)."""

    def __init__(
        self,
        orders: Sequence[EpochOrder],
        weights: Sequence[float],
        seed: int,
        cuts: Sequence[int] | None = None,
    ):
        self.orders, self.mixture = list(orders), Mixture(weights, seed)
        self.cuts = [1] * len(self.orders) if cuts is None else [int(k) for k in cuts]
        self.offset = np.cumsum([0] + [len(o.rows) for o in self.orders])
        # canonical row id: unique over the sources (dynamic masks are seeded by it), and with
        # cuts so is a piece's id · k + j (`collate.gather_cut`): source i starts at the first
        # multiple of k_i past the pieces of the sources before it
        starts, end = [], 0
        for o, k in zip(self.orders, self.cuts):
            starts.append(-(-end // k))
            end = (starts[-1] + o.size) * k
        self.base = np.concatenate(
            [first + o.base[:-1] for first, o in zip(starts, self.orders)]
            + [[starts[-1] + self.orders[-1].size]]
        )
        self.size = sum(o.size * k for o, k in zip(self.orders, self.cuts))  # one pass of each

    def source_of(self, shard: int) -> int:
        return int(np.searchsorted(self.offset, shard, side="right") - 1)

    def next_shard(self, epoch: int, shard: int) -> int:
        """The shard read after `shard`: its own source's next (in that source's epochs)."""
        i = self.source_of(shard)
        return int(self.offset[i] + self.orders[i].next_shard(epoch, shard - self.offset[i]))

    def by_shard(self, q: np.ndarray) -> Iterator[tuple]:
        """(source's epoch, indices into q, shard, rows, piece numbers, k) for each (source,
        epoch, shard) that positions q touch (`cut_by_shard` in each source's cut stream)."""
        source, t = self.mixture.locate(q)
        for i in np.unique(source):
            hit = np.flatnonzero(source == i)
            for epoch, where, s, rows, piece, k in cut_by_shard(
                self.orders[i], t[hit], self.cuts[i]
            ):
                yield epoch, hit[where], int(self.offset[i] + s), rows, piece, k


def stream_shape(index: Index, mix: Sequence[tuple[Index, float]] | None, seq_len: int):
    """(epoch_size, mix) of a run's `StreamPosition` at `seq_len`: the rows of an epoch of its
    one dataset (train rows × its cut factor), or of all its mixed datasets together and the
    (rows × cut factor, weight) of each."""
    if mix is None:
        return index.rows("train") * cut_factor(index.seq_len, seq_len), None
    shape = tuple(
        (ix.rows("train") * cut_factor(ix.seq_len, seq_len), float(weight)) for ix, weight in mix
    )
    return sum(rows for rows, _ in shape), shape


def source_epochs(
    mix: Sequence[tuple[Index, float]], seed: int, samples: int, seq_len: int
) -> dict[str, float]:
    """Each mixed dataset's epochs (rows drawn / its train rows × its cut factor at `seq_len`)
    after `samples` global positions."""
    drawn = Mixture([w for _, w in mix], seed).drawn(samples)
    _, shape = stream_shape(mix[0][0], mix, seq_len)
    return {ix.root: float(n) / rows for n, (ix, _), (rows, _) in zip(drawn, mix, shape)}
