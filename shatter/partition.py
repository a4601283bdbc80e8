"""The soft relative partition of unity {f_h} (§3.1 and appendix "Partition of Unity").

Given n parts (n even, n >= 4) and D = n/2 - 1, the functions for x = j - i > 0 are the Bernstein
polynomials of degree D,

    B_nu(u) = C(D, nu) u^nu (1 - u)^(D - nu),          0 <= nu <= D,

of u(x) = ln(e^(beta x) (1 - e^alpha) + e^alpha) / alpha, which maps x = 0 to u = 0 and
x = +inf to u = 1, with, for layer k of L,

    alpha = -(k + 1) D / L,      beta = -(1/D) (D/12)^((k + 1)/L).

Parts 0..n/2-1 cover x > 0 (f_nu(x) = B_nu(u(x))); parts n/2..n-1 are their mirror images and
cover x < 0 (f_{n/2+nu}(x) = f_nu(-x)).

x = 0 (a token attending to itself) would be counted twice, since u(0) = 0 gives B_0 = 1 on both
sides. We split it evenly: f_0(0) = f_{n/2}(0) = 1/2 and every other f_h(0) = 0, so the
functions are non-negative and sum to exactly 1 everywhere, x = 0 included, and the split keeps
the mirror symmetry f_h(0) = f_{h+n/2}(0).

Everything is computed in float64 and cast at the end; `partition_table` gives the values for all
relative positions -(m-1)..(m-1) as an (n, 2m-1) table, from which N[h, i, j] = f_h(j - i) is
indexed (`relative_index`) instead of being evaluated per batch.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from shatter.eager import outside_graphs


def partition_params(n_parts: int, layer: int, n_layers: int) -> tuple[int, float, float]:
    """(D, alpha, beta) of the appendix for layer `layer` (0-based) of `n_layers`."""
    if n_parts < 4 or n_parts % 2:
        raise ValueError(f"the partition of unity needs an even n_parts >= 4, got {n_parts}")
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is outside 0..{n_layers - 1}")
    D = n_parts // 2 - 1
    t = (layer + 1) / n_layers
    alpha = -t * D
    beta = -(1.0 / D) * (D / 12.0) ** t
    return D, alpha, beta


def partition_of_unity(
    rel_pos: torch.Tensor,
    n_parts: int,
    layer: int,
    n_layers: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """f_h(rel_pos) for every part h: a Tensor[n_parts, *rel_pos.shape] (see the module docstring)."""
    if rel_pos.is_floating_point() or rel_pos.is_complex():
        raise TypeError("rel_pos must be an integer tensor of relative positions j - i")
    D, alpha, beta = partition_params(n_parts, layer, n_layers)
    x = rel_pos.to(torch.float64)
    ax = x.abs()
    # u(|x|) in [0, 1): ln(e^(beta x)(1 - e^alpha) + e^alpha) / alpha
    u = torch.log(torch.exp(beta * ax) * (1.0 - math.exp(alpha)) + math.exp(alpha)) / alpha
    u = u.clamp(0.0, 1.0)
    nu = torch.arange(D + 1, dtype=torch.float64).view(-1, *([1] * x.dim()))
    binom = torch.tensor([math.comb(D, v) for v in range(D + 1)], dtype=torch.float64)
    bern = (
        binom.view_as(nu) * u.unsqueeze(0) ** nu * (1.0 - u.unsqueeze(0)) ** (D - nu)
    )  # [D+1, ...]
    right = torch.where(x > 0, bern, torch.zeros_like(bern))
    left = torch.where(x < 0, bern, torch.zeros_like(bern))
    at_zero = (x == 0).to(torch.float64)
    right[0] = right[0] + 0.5 * at_zero  # the even split of x = 0 between f_0 and f_{n/2}
    left[0] = left[0] + 0.5 * at_zero
    return torch.cat([right, left], dim=0).to(dtype)


@lru_cache(maxsize=256)
def _table_cpu(n_parts: int, layer: int, n_layers: int, max_len: int) -> torch.Tensor:
    rel = torch.arange(-(max_len - 1), max_len)
    return partition_of_unity(rel, n_parts, layer, n_layers, dtype=torch.float64)


def partition_table(
    n_parts: int,
    layer: int,
    n_layers: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Tensor[n, 2*max_len - 1]: column c holds f_h(c - (max_len - 1))."""
    return _table_cpu(n_parts, layer, n_layers, max_len).to(device=device, dtype=dtype)


_INDEX_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}


def relative_index(length: int, max_len: int, device: torch.device) -> torch.Tensor:
    """LongTensor[l, l] with (j - i) + (max_len - 1): the column of `partition_table` for (i, j)."""
    if length > max_len:
        raise ValueError(f"sequence length {length} exceeds max_len {max_len}")
    key = (length, max_len, str(device))
    idx = _INDEX_CACHE.get(key)
    if idx is None:
        pos = torch.arange(length, device=device)
        idx = pos.view(1, -1) - pos.view(-1, 1) + (max_len - 1)
        if len(_INDEX_CACHE) > 16:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = idx
    return idx


class PartitionBuffer:
    """Mixin for the attention modules that hold their layer's table as the non-persistent buffer
    `partition` (listed before nn.Module among the bases, for its `_apply`). A module-wide
    `.bfloat16()`/`.half()`/`.to(dtype)`, or a DeepSpeed engine with `data_types.buffer_dtype`
    set, rounds buffers; a rounded table no longer sums to 1 (a bf16 f_h has 8 bits).
    `exact_partition()` is what the forward reads: the fp32 table, rebuilt from the float64
    values (and the buffer restored) if anything cast it.

    The module casts (`_apply`) rebuild it at once: a table found rounded under torch.compile is
    a graph break inside the encoder's loop over the layers, and Dynamo then runs that loop
    eagerly for good (each layer's forward a graph of its own, a few more per layer: host-bound
    on a GPU). A cast that bypasses the module (DeepSpeed's `b.data = b.data.to(...)`) is caught
    by `exact_partitions`, one call for every layer before the loop."""

    def register_partition(self, n_parts: int, layer: int, n_layers: int, max_len: int) -> None:
        self._partition_args = (n_parts, layer, n_layers, max_len)
        table = partition_table(n_parts, layer, n_layers, max_len)
        self.register_buffer("partition", table, persistent=False)  # (n, 2 max_len - 1)

    def _apply(self, fn, recurse=True):
        """nn.Module's `_apply` (every `.to`, `.cuda`, `.bfloat16`), then the table made exact
        again where `fn` cast it."""
        module = super()._apply(fn, recurse)
        table = self._buffers.get("partition")
        if table is not None and table.dtype != torch.float32:
            self._exact_table(table.device)
        return module

    def exact_partition(self) -> torch.Tensor:
        table = self.partition
        if table.dtype != torch.float32:  # metadata only: no host sync
            table = self._rebuilt(table.device)
        return table

    def _exact_table(self, device: torch.device) -> torch.Tensor:
        self.partition = partition_table(*self._partition_args, device=device)
        return self.partition

    # once a run, eagerly: Dynamo would trace the table's cache
    _rebuilt = outside_graphs(_exact_table)


def exact_partitions(modules) -> None:
    """Every PartitionBuffer among `modules` given its exact table again, in one call outside
    Dynamo's graphs when any was cast (dtypes only: nothing runs when none was)."""
    tables = [m for m in modules if isinstance(m, PartitionBuffer)]
    if any(m.partition.dtype != torch.float32 for m in tables):
        _rebuild_all(tables)


@outside_graphs
def _rebuild_all(modules) -> None:
    for module in modules:
        module.exact_partition()


def partition_mask(table: torch.Tensor, length: int) -> torch.Tensor:
    """N: Tensor[n, l, l] with N[h, i, j] = f_h(j - i), indexed from an (n, 2m-1) table.

    Any Toeplitz [n, l, l] built from per-relative-position values works the same way (bert-rab
    indexes its bias from W^B's rows this way); gradients flow back into `table`."""
    max_len = (table.shape[1] + 1) // 2
    return table[:, relative_index(length, max_len, table.device)]


def plot_partition(n_parts: int, layer: int, n_layers: int, span: int = 48, ax=None):
    """Plot the f_h of one layer over relative positions -span..span (the paper's Figure 2).

    Returns the matplotlib Axes. matplotlib is imported lazily: it is a docs/demo dependency.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.6))
    rel = torch.arange(-span, span + 1)
    f = partition_of_unity(rel, n_parts, layer, n_layers, dtype=torch.float64)
    for h in range(n_parts):
        ax.plot(
            rel.numpy(),
            f[h].numpy(),
            marker=".",
            markersize=3,
            linewidth=1,
            label=f"$f_{{{h}}}$",
            color=plt.cm.tab20(h % 20),
        )
    ax.plot(rel.numpy(), f.sum(0).numpy(), "k--", linewidth=0.8, label="sum")
    ax.set_xlabel("relative position x = j - i")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(f"partition of unity, n = {n_parts}, layer k = {layer} of L = {n_layers}")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, ncol=2)
    return ax


def save_figure(path: str) -> None:
    """The figure in docs/model.md: n = 4 (the paper's Figure 2), and n = 12 at the first and
    last of 12 layers (base size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5))
    plot_partition(4, 0, 2, span=16, ax=axes[0])
    plot_partition(12, 0, 12, span=64, ax=axes[1])
    plot_partition(12, 11, 12, span=64, ax=axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
