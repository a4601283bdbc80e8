"""Every arch: shapes, gradients, padding invariance, shift and permutation (in)variance, lengths."""

import pytest
import torch

import shatter
from shatter.config import ARCHS
from tests.shatter.shatter_tiny import ABSOLUTE, RELATIVE, VOCAB, ids, tiny


@pytest.mark.parametrize("arch", ARCHS)
def test_shapes_loss_and_gradients_reach_every_parameter(arch):
    model = tiny(arch).train()
    x = ids(3, 20)
    mask = torch.ones_like(x)
    mask[1, 15:] = 0
    labels = torch.full_like(x, -100)
    labels[0, [2, 5]] = x[0, [2, 5]]
    labels[1, 7] = x[1, 7]
    out = model(x, mask, labels)
    assert out["logits"].shape == (3, VOCAB)  # only the M = 3 predicted positions
    manual = torch.nn.functional.cross_entropy(out["logits"], labels[labels != -100])
    torch.testing.assert_close(out["loss"], manual)
    out["loss"].backward()
    silent = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    if arch == "xlnet":  # w starts the query stream: PLM only (tests/shatter/test_xlnet.py)
        silent.remove("encoder.embeddings.query_stream")
    assert not silent, f"no gradient reaches {silent}"
    h = model.encoder(x, mask)
    assert h.shape == (3, 20, model.config.hidden)
    full = model(x, mask)
    assert full["loss"] is None and full["logits"].shape == (3, 20, VOCAB)


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_never_changes_real_tokens(arch):
    model = tiny(arch)
    x = ids(2, 12)
    ref = model.encoder(x, torch.ones_like(x))
    junk = ids(2, 7, seed=9)  # arbitrary ids under the padding, not just [PAD]
    padded = torch.cat([x, junk], dim=1)
    mask = torch.cat([torch.ones_like(x), torch.zeros_like(junk)], dim=1)
    out = model.encoder(padded, mask)[:, :12]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a batch mixing lengths gives each row what it gets alone
    short = model.encoder(x[:1, :8], torch.ones(1, 8, dtype=torch.long))
    mixed_mask = torch.ones_like(x)
    mixed_mask[0, 8:] = 0
    torch.testing.assert_close(model.encoder(x, mixed_mask)[0, :8], short[0], rtol=1e-5, atol=1e-5)


def _left_shift_gap(arch):
    """Max |difference| at the real tokens between [w, pad*5] and [pad*5, w]."""
    model = tiny(arch)
    x = ids(2, 10)
    pad = torch.zeros(2, 5, dtype=torch.long)
    ones, zeros = torch.ones_like(x), torch.zeros_like(pad)
    right = model.encoder(torch.cat([x, pad], 1), torch.cat([ones, zeros], 1))[:, :10]
    left = model.encoder(torch.cat([pad, x], 1), torch.cat([zeros, ones], 1))[:, 5:]
    return (right - left).abs().max().item()


@pytest.mark.parametrize("arch", RELATIVE)
def test_relative_archs_are_shift_invariant(arch):
    assert _left_shift_gap(arch) < 1e-5


@pytest.mark.parametrize("arch", ABSOLUTE)
def test_absolute_archs_are_not_shift_invariant(arch):
    assert _left_shift_gap(arch) > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_only_no_position_is_permutation_equivariant(arch):
    model = tiny(arch)
    x = ids(1, 16)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(3))
    gap = (model.encoder(x)[:, perm] - model.encoder(x[:, perm])).abs().max().item()
    if arch == "no-position":
        assert gap < 1e-5
    else:
        assert gap > 1e-4  # float noise is ~1e-7


@pytest.mark.parametrize("arch", ["shatter", "bert-rpe", "part-mask"])
def test_same_outputs_at_max_len_128_and_1024(arch):
    short = tiny(arch, max_len=128)
    long = tiny(arch, seed=5, max_len=1024)
    assert {k: v.shape for k, v in short.state_dict().items()} == {
        k: v.shape for k, v in long.state_dict().items()
    }
    long.load_state_dict(short.state_dict())
    x = ids(2, 100)
    torch.testing.assert_close(long.encoder(x), short.encoder(x), rtol=1e-5, atol=1e-5)


def test_state_dict_depends_on_max_len_only_through_position_embeddings():
    for arch in ARCHS:
        a = tiny(arch, max_len=32).state_dict()
        b = tiny(arch, max_len=48).state_dict()
        differ = {k for k in a if a[k].shape != b[k].shape}
        expected = {"encoder.embeddings.position_embeddings.weight"} if arch in ABSOLUTE else set()
        assert differ == expected, arch


def test_inputs_longer_than_max_len_are_rejected():
    model = tiny("shatter", max_len=16)
    with pytest.raises(ValueError, match="exceeds max_len 16"):
        model.encoder(ids(1, 17))
    with pytest.raises(ValueError, match="attention_mask shape"):
        model.encoder(ids(1, 8), torch.ones(1, 9))


def test_hidden_states_are_the_per_layer_inputs():
    model = tiny("shatter")
    x = ids(2, 9)
    out = model.encoder(x, torch.ones_like(x), output_hidden_states=True)
    assert isinstance(out, shatter.EncoderOutput)
    assert len(out.hidden_states) == model.config.layers + 1
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)
    torch.testing.assert_close(out.last_hidden_state, model.encoder(x))
    torch.testing.assert_close(out.hidden_states[0], model.encoder.embeddings(x))


def test_mlm_head_is_tied_and_loss_handles_no_predictions():
    model = tiny("bert")
    assert model.mlm_head.word_embeddings.weight is model.encoder.embeddings.word_embeddings.weight
    x = ids(2, 6)
    out = model(x, torch.ones_like(x), torch.full_like(x, -100))
    assert out["logits"].shape == (0, VOCAB) and out["loss"].item() == 0.0


@pytest.mark.parametrize("arch", ["bert", "bert-rpe", "shatter"])
def test_bf16_train_step_runs(arch):
    """The trainer may run in bf16 on CPU: every kernel accepts it and the loss stays finite."""
    model = tiny(arch).to(torch.bfloat16).train()
    x = ids(2, 12)
    out = model(x, torch.ones_like(x), torch.where(x % 3 == 0, x, -100))
    out["loss"].backward()
    assert out["loss"].dtype == torch.bfloat16 and torch.isfinite(out["loss"])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_t5_buckets():
    """T5's bidirectional buckets (32, max distance 128): exact below 8, log-spaced to 128,
    the sign in the upper half."""
    from shatter.attention.multihead import t5_relative_bucket

    rel = torch.tensor([0, 1, -1, 7, -7, 8, 12, 127, 128, 500, -500])
    expected = [0, 17, 1, 23, 7, 24, 25, 31, 31, 31, 15]  # 12: 8 + int(8 ln(1.5)/ln(16)) = 9
    assert t5_relative_bucket(rel, 32, 128).tolist() == expected


@pytest.mark.parametrize("buckets,distance", [(32, 8), (32, 4), (30, 128), (2, 128)])
def test_bert_rab_rejects_bucket_settings_t5_cannot_bucket(buckets, distance):
    with pytest.raises(ValueError, match="rab_max_distance|rab_buckets"):
        shatter.build_model("bert-rab-tiny", rab_buckets=buckets, rab_max_distance=distance)


def test_bert_rab_smallest_valid_bucket_setting_runs():
    model = shatter.build_model(
        "bert-rab-tiny", rab_buckets=8, rab_max_distance=3, vocab_size=50, max_len=64
    )
    ids = torch.randint(5, 50, (1, 64))
    assert torch.isfinite(model.encoder(ids, torch.ones_like(ids))).all()


def test_bert_rab_bias_is_w_b_at_the_bucket_of_each_pair():
    """B[h, i, j] = W^B[bucket(j - i), h] for every pair, from the table indexed per relative position."""
    from shatter.attention.multihead import t5_relative_bucket

    model = tiny("bert-rab", max_len=300)
    attention = model.encoder.layers[1].attention
    L = 300  # beyond rab_max_distance: the far buckets are reached on both sides
    x = torch.zeros(2, L, model.config.hidden)
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[1, 250:] = False
    bias = attention._bias(x, mask)
    pos = torch.arange(L)
    bucket = t5_relative_bucket(
        pos[None, :] - pos[:, None], model.config.rab_buckets, model.config.rab_max_distance
    )
    direct = attention.relative_attention_bias.weight[bucket].permute(2, 0, 1)  # [n, L, L]
    assert (
        bucket.unique().numel() == model.config.rab_buckets - 1
    )  # all but 16 (j > i at distance 0)
    torch.testing.assert_close(bias[0], direct, rtol=0, atol=0)
    torch.testing.assert_close(bias[1, :, :, :250], direct[:, :, :250], rtol=0, atol=0)
    assert (bias[1, :, :, 250:] < -1e30).all()  # padded keys


def test_the_config_knows_exactly_the_registered_archs():
    """ARCHS (which the config validates against) is read from the registry, in order."""
    from shatter.attention import ATTENTIONS
    from shatter.config import ARCHS

    assert tuple(ATTENTIONS) == ARCHS
