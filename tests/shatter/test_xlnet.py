"""XLNet's two streams: what each stream at z_t may see, and the single-stream encoder."""

import pytest
import torch
from shatter_tiny import ids, tiny

from shatter.xlnet import two_stream_encode


def _streams(model, x, rank):
    return two_stream_encode(model.encoder, x, torch.ones_like(x), rank)


def _order(L: int, seed: int = 4) -> torch.Tensor:
    """rank [1, L] of a random factorisation order (every token its own rank)."""
    z = torch.randperm(L, generator=torch.Generator().manual_seed(seed))
    rank = torch.empty(L, dtype=torch.long)
    rank[z] = torch.arange(L)
    return rank[None]


@pytest.mark.parametrize("t", [0, 5, 11])
def test_query_stream_at_z_t_sees_exactly_the_content_of_z_before_t(t):
    model = tiny("xlnet")
    L = 12
    x, rank = ids(1, L), _order(L)
    z = rank[0].argsort()  # z[s] = the position at step s of the order
    pos = int(z[t])
    h, g = _streams(model, x, rank)
    for s in range(L):  # perturb the content of z_s alone
        y = x.clone()
        y[0, z[s]] = (y[0, z[s]] + 7) % 45 + 5
        h2, g2 = _streams(model, y, rank)
        gap = (g2[0, pos] - g[0, pos]).abs().max().item()
        if s >= t:  # z_t itself and every later position: invisible to the query stream at z_t
            assert gap < 1e-6, (s, gap)
        else:
            assert gap > 1e-4, (s, gap)
        content_gap = (h2[0, pos] - h[0, pos]).abs().max().item()
        if s <= t:  # the content stream at z_t sees z_t itself and everything before it
            assert content_gap > 1e-4, (s, content_gap)
        else:
            assert content_gap < 1e-6, (s, content_gap)


def test_with_every_position_visible_the_content_stream_is_the_encoder():
    model = tiny("xlnet")
    x = ids(2, 10)
    mask = torch.ones_like(x)
    mask[1, 7:] = 0
    h, _ = two_stream_encode(model.encoder, x, mask, torch.zeros_like(x))
    ref = model.encoder(x, mask)
    torch.testing.assert_close(h[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-5)


def test_query_stream_knows_its_position_and_uses_the_mask_embedding():
    model = tiny("xlnet")
    x, rank = ids(1, 8), torch.full((1, 8), -1)
    rank[0, 3], rank[0, 6] = 0, 1  # two targets, the rest context
    _, g = _streams(model, x, rank)
    # same visible content, different positions: different query states
    assert (g[0, 3] - g[0, 6]).abs().max() > 1e-4
    with torch.no_grad():
        model.encoder.embeddings.query_stream.add_(1.0)
    assert (_streams(model, x, rank)[1][0, 3] - g[0, 3]).abs().max() > 1e-4


def test_plm_loss_is_the_query_streams_cross_entropy_and_reaches_w():
    model = tiny("xlnet").train()
    x, rank = ids(2, 8), torch.full((2, 8), -1)
    rank[:, 5], rank[:, 2] = 0, 1
    labels = torch.full_like(x, -100)
    labels[:, [5, 2]] = x[:, [5, 2]]
    out = model(x, torch.ones_like(x), labels, perm_rank=rank)
    model.eval()
    g = _streams(model, x, rank)[1]
    manual = torch.nn.functional.cross_entropy(model.mlm_head(g[labels != -100]), x[labels != -100])
    torch.testing.assert_close(out["loss"], manual)
    out["loss"].backward()
    assert model.encoder.embeddings.query_stream.grad.abs().sum() > 0


def test_mlm_archs_refuse_a_factorisation_order():
    model = tiny("bert")
    x = ids(1, 6)
    with pytest.raises(ValueError, match="needs arch xlnet"):
        model(x, torch.ones_like(x), x, perm_rank=torch.zeros_like(x))
