"""XLNet: what each stream at z_t may see, the single-stream encoder, the relative segments."""

import json

import pytest
import safetensors.torch
import torch

import shatter
from shatter.attention.xlnet import XLNetAttention
from shatter.config import preset_config
from shatter.model import segment_ids
from shatter.sources import MODEL_STATES, load_deepspeed
from shatter.xlnet import two_stream_encode
from tests.shatter.shatter_tiny import ids, tiny


def _streams(model, x, rank):
    return two_stream_encode(model.encoder, x, torch.ones_like(x), rank)


def _order(L: int, seed: int = 4) -> torch.Tensor:
    """rank [1, L] of a random factorisation order (every token its own rank)."""
    z = torch.randperm(L, generator=torch.Generator().manual_seed(seed))
    rank = torch.empty(L, dtype=torch.long)
    rank[z] = torch.arange(L)
    return rank[None]


@pytest.mark.slow
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


@pytest.mark.parametrize("seps", [(), (3, 6)])
def test_with_every_position_visible_the_content_stream_is_the_encoder(seps):
    model = tiny("xlnet")
    x = ids(2, 10)
    x[:, list(seps)] = 3  # [SEP]: pairs, segments 0, 1, 2
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


# Relative segment encoding (XLNet §2.5): segments from the [SEP]s (id 3) of input_ids.
SEP = 3


def _pairs(batch: int, length: int, seps=(4, 9), seed: int = 1) -> torch.Tensor:
    """ids with [SEP] at `seps` (segment 0 up to the first [SEP], 1 up to the next, ...)."""
    x = ids(batch, length, seed)
    x[:, list(seps)] = SEP
    return x


def _segment_params(model):
    return [b.attention for b in model.encoder.layers]


def test_segments_are_the_seps_strictly_before_each_position():
    x = torch.tensor([[2, 10, 11, SEP, 12, 13, SEP, 0, 0], [2, 10, 11, 12, 13, 14, 15, 16, 17]])
    want = [[0, 0, 0, 0, 1, 1, 1, 2, 2], [0] * 9]
    assert segment_ids(x, SEP).tolist() == want
    assert tiny("xlnet").encoder.attention_inputs(x)["segment_BL"].tolist() == want
    # the id comes from the config (index.json special_ids at pretraining), not a constant
    other = tiny("xlnet", sep_id=11).encoder.attention_inputs(x)["segment_BL"]
    assert other.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 1]]
    assert tiny("bert").encoder.attention_inputs(x) == {}  # only variants that declare segments


def test_segment_term_depends_only_on_same_or_different_segment():
    torch.manual_seed(0)
    attention = XLNetAttention(preset_config("xlnet-tiny", attention_dropout=0.0), 0).eval()
    x, mask = torch.randn(1, 8, 64), torch.ones(1, 8, dtype=torch.bool)

    def out(*segments):
        return attention(x, mask, torch.tensor([segments]))[0]

    three = out(0, 0, 1, 1, 2, 2, 2, 2)
    torch.testing.assert_close(out(4, 4, 7, 7, 9, 9, 9, 9), three)  # relabelled: same output
    # the second [SEP] moved to the end: segments 1 and 2 merge; positions 0-1 keep every
    # relation (different from all of 2..7), positions 2..7 gain same-segment pairs
    merged = out(0, 0, 1, 1, 1, 1, 1, 1)
    torch.testing.assert_close(merged[:2], three[:2])
    assert ((merged[2:] - three[2:]).abs().amax(-1) > 1e-4).all()
    with torch.no_grad():  # s+ == s-: the segment relation no longer matters
        attention.segment_embeddings[1] = attention.segment_embeddings[0]
    torch.testing.assert_close(out(0, 0, 1, 1, 1, 1, 1, 1), out(0, 0, 1, 1, 2, 2, 2, 2))


def test_moving_a_sep_changes_the_encoder_and_a_row_without_sep_is_one_segment():
    model = tiny("xlnet")
    x = ids(1, 12)
    # the same ids with a different [SEP] id: only the segments differ, not the content
    one = tiny("xlnet", sep_id=int(x[0, 4])).encoder(x)
    assert (one - model.encoder(x)).abs().max() > 1e-4
    # a row without [SEP] is one segment: (q_i + b) . s+ is the same for every key j and cancels
    # in the softmax, so it is the model without any segment encoding; a pair is not
    pair = _pairs(1, 12)
    ref_row, ref_pair = model.encoder(x), model.encoder(pair)
    with torch.no_grad():
        for attention in _segment_params(model):
            attention.segment_embeddings.normal_()
            attention.segment_bias.normal_()
    torch.testing.assert_close(model.encoder(x), ref_row, rtol=1e-5, atol=1e-5)
    assert (model.encoder(pair) - ref_pair).abs().max() > 1e-4


def test_both_streams_use_the_segments():
    model = tiny("xlnet")
    x, rank = _pairs(1, 12), _order(12)
    h, g = _streams(model, x, rank)
    with torch.no_grad():
        for attention in _segment_params(model):
            attention.segment_embeddings[1] += 0.5  # s-: only pairs across a [SEP] use it
    h2, g2 = _streams(model, x, rank)
    assert (h2 - h).abs().max() > 1e-4 and (g2 - g).abs().max() > 1e-4


def test_pairs_are_shift_invariant():
    """[pair, pad*5] and [pad*5, pair] give the same states: the segments shift with the ids."""
    model = tiny("xlnet")
    x = _pairs(2, 10)
    pad = torch.zeros(2, 5, dtype=torch.long)
    ones, zeros = torch.ones_like(x), torch.zeros_like(pad)
    right = model.encoder(torch.cat([x, pad], 1), torch.cat([ones, zeros], 1))[:, :10]
    left = model.encoder(torch.cat([pad, x], 1), torch.cat([zeros, ones], 1))[:, 5:]
    torch.testing.assert_close(left, right, rtol=1e-5, atol=1e-5)


def _without_segments(state: dict) -> dict:
    return {k: v for k, v in state.items() if "segment_" not in k}


def test_an_export_or_checkpoint_missing_weights_is_refused_naming_the_file(tmp_path):
    """An xlnet export, or a DeepSpeed checkpoint (shatter-extend's input), without some of the
    model's weights (here s+, s-, b of the segment encoding) is refused, naming the file."""
    model = tiny("xlnet")
    out = shatter.save_pretrained(model, tmp_path / "export")
    weights = out / "model.safetensors"
    state = _without_segments(model.state_dict())
    state.pop("mlm_head.word_embeddings.weight")  # tied: stored once
    safetensors.torch.save_file(state, str(weights), metadata={"format": "pt"})
    (out / "checksums.json").unlink()
    with pytest.raises(
        shatter.CheckpointError, match=r"model\.safetensors does not match.*segment_"
    ):
        shatter.from_pretrained(out)
    tag = tmp_path / "checkpoints" / "step1"
    tag.mkdir(parents=True)
    config = json.loads((out / "config.json").read_text())
    client = {"module": _without_segments(model.state_dict()), "model_config": config}
    torch.save(client, tag / MODEL_STATES)
    with pytest.raises(shatter.CheckpointError, match=f"{tag}: weights do not match.*segment_"):
        load_deepspeed(tag)
