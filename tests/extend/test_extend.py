"""Length extension: the property (old-length outputs unchanged) for every arch, and what changes."""

import pytest
import torch

import shatter
from shatter.extend import ExtendError, extend_model

OLD, NEW = 16, 40


def tiny(arch: str, **overrides) -> torch.nn.Module:
    fields = dict(
        vocab_size=50,
        hidden=32,
        layers=2,
        heads=4,
        ffn=64,
        max_len=OLD,
        dropout=0.0,
        attention_dropout=0.0,
        rpe_max_distance=8,
        rab_buckets=8,
        rab_max_distance=12,
    )
    fields.update(overrides)
    torch.manual_seed(0)
    return shatter.ShatterForMaskedLM(shatter.ModelConfig(arch=arch, **fields)).eval()


def inputs(length: int, batch: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 50, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length // 2 :] = 0  # a padded row too
    return ids, mask


@pytest.mark.slow
@pytest.mark.parametrize("init", ["random", "copy"])
@pytest.mark.parametrize("arch", shatter.ARCHS)
def test_outputs_at_the_old_length_are_unchanged(arch, init):
    model = tiny(arch)
    extended, report = extend_model(model, NEW, init=init)
    assert extended.config.max_len == NEW and model.config.max_len == OLD  # input untouched
    with torch.no_grad():
        for length in (OLD, 5):
            ids, mask = inputs(length)
            before = model.encoder(ids, mask)
            after = extended.encoder(ids, mask)
            torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
            torch.testing.assert_close(
                extended(ids, mask)["logits"], model(ids, mask)["logits"], rtol=0, atol=1e-5
            )
        ids, mask = inputs(NEW)
        assert extended.encoder(ids, mask).shape == (3, NEW, 32)  # the new length runs
        with pytest.raises(ValueError, match="exceeds max_len"):
            model.encoder(ids, mask)
    absolute = arch in ("bert", "bert-rab")
    assert (report.parameters_added > 0) == absolute
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(extended) - n_params(model) == report.parameters_added
    if absolute:
        assert report.parameters_added == (NEW - OLD) * 32
    if arch in shatter.PARTITION_ARCHS:
        assert report.rebuilt_buffers and all(
            s[-1] == 2 * NEW - 1 for s in report.rebuilt_buffers.values()
        )


@pytest.mark.parametrize("arch", ["bert", "bert-rab"])
def test_new_position_rows(arch):
    model = tiny(arch, initializer_range=0.5)
    old = model.encoder.embeddings.position_embeddings.weight.detach()
    copy, _ = extend_model(model, NEW, init="copy")
    rows = copy.encoder.embeddings.position_embeddings.weight.detach()
    assert torch.equal(rows[:OLD], old)
    assert torch.equal(rows[OLD : 2 * OLD], old) and torch.equal(
        rows[2 * OLD :], old[: NEW - 2 * OLD]
    )
    random, _ = extend_model(model, 4096, init="random", seed=3)
    new = random.encoder.embeddings.position_embeddings.weight.detach()[OLD:]
    assert (
        abs(new.std().item() - 0.5) < 0.02 and abs(new.mean().item()) < 0.02
    )  # the pretraining init
    again, _ = extend_model(model, 4096, init="random", seed=3)
    assert torch.equal(
        again.encoder.embeddings.position_embeddings.weight,
        random.encoder.embeddings.position_embeddings.weight,
    )


def test_refuses_a_length_that_is_not_longer():
    with pytest.raises(ExtendError, match="not larger"):
        extend_model(tiny("shatter"), OLD)
    with pytest.raises(ExtendError, match="unknown init"):
        extend_model(tiny("bert"), NEW, init="zeros")
