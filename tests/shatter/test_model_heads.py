"""Finetuning heads: shapes, losses, gradients, padding invariance, save/load."""

import json

import pytest
import torch

import shatter
from shatter.config import ARCHS
from shatter.heads import SequenceClassificationModel, SpanExtractionModel
from tests.shatter.shatter_tiny import ids, tiny

POSITION_ONLY = (
    "partition_embeddings",
    "relative_embeddings",
    "relative_attention_bias",
    "attention.relative.weight",  # xlnet's W_R
    "position_bias",  # xlnet's v
    "segment_embeddings",  # xlnet's s+, s-: the learnt query has no segment either
    "segment_bias",  # xlnet's b
)


def _padded(x):
    junk = ids(x.shape[0], 5, seed=7)
    mask = torch.cat([torch.ones_like(x), torch.zeros_like(junk)], 1)
    return torch.cat([x, junk], 1), mask


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_modified_classification_gradients_and_padding(arch):
    model = SequenceClassificationModel(tiny(arch), num_labels=3).train()
    x = ids(4, 10)
    mask = torch.ones_like(x)
    mask[2, 6:] = 0
    out = model(x, mask, torch.tensor([0, 2, 1, 2]))
    assert out["logits"].shape == (4, 3)
    torch.testing.assert_close(
        out["loss"], torch.nn.functional.cross_entropy(out["logits"], torch.tensor([0, 2, 1, 2]))
    )
    out["loss"].backward()
    last = f"encoder.layers.{model.config.layers - 1}.attention."
    silent = {
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    }
    expected = {
        n
        for n, _ in model.named_parameters()
        if n.startswith(last) and any(s in n for s in POSITION_ONLY)
    }
    if arch == "xlnet":  # w starts the query stream: pretraining only
        expected.add("encoder.embeddings.query_stream")
    assert silent == expected, silent ^ expected
    model.eval()
    x = ids(2, 10)
    xp, mp = _padded(x)
    torch.testing.assert_close(model(xp, mp)["logits"], model(x)["logits"], rtol=1e-5, atol=1e-5)


def test_modified_head_matches_its_definition():
    """y^{k+1} = block_k.pool(y^k, X^k) over the encoder's own hidden states X^0..X^{L-1}."""
    model = SequenceClassificationModel(tiny("shatter"), num_labels=2).eval()
    x = ids(2, 9)
    states = model.encoder(x, output_hidden_states=True).hidden_states
    mask = torch.ones_like(x, dtype=torch.bool)
    y = model.query.expand(2, -1)
    for k, block in enumerate(model.encoder.layers):
        y = block.pool(y, states[k], mask)
    torch.testing.assert_close(model.sequence_vector(x, None), y)


def test_cls_strategy_and_regression():
    backbone = tiny("bert")
    model = SequenceClassificationModel(backbone, num_labels=1, strategy="cls").eval()
    x = ids(3, 8)
    target = torch.tensor([0.5, -1.0, 2.0])
    out = model(x, None, target)
    assert out["logits"].shape == (3, 1)
    torch.testing.assert_close(out["loss"], ((out["logits"][:, 0] - target) ** 2).mean())
    # [CLS] pooling reads X^L[:, 0] only: changing a later token changes it through attention
    torch.testing.assert_close(model.sequence_vector(x, None), backbone.encoder(x)[:, 0])
    with pytest.raises(ValueError, match="strategy"):
        SequenceClassificationModel(backbone, 2, strategy="mean")


@pytest.mark.parametrize("arch", ["shatter", "bert"])
def test_span_extraction(arch):
    model = SpanExtractionModel(tiny(arch)).train()
    x = ids(2, 12)
    xp, mp = _padded(x)
    out = model(xp, mp, torch.tensor([1, 4]), torch.tensor([3, 20]))  # 20 is outside: ignored
    assert out["start_logits"].shape == out["end_logits"].shape == (2, 17)
    assert (out["start_logits"][:, 12:] == torch.finfo(torch.float32).min).all()
    out["loss"].backward()
    silent = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert not silent
    model.eval()
    torch.testing.assert_close(
        model(xp, mp)["start_logits"][:, :12], model(x)["start_logits"], rtol=1e-5, atol=1e-5
    )


def test_heads_save_and_load(tmp_path):
    x = ids(2, 9)
    cls = SequenceClassificationModel(tiny("shatter"), num_labels=4).eval()
    shatter.save_pretrained(cls, tmp_path / "cls")
    assert json.loads((tmp_path / "cls" / "head.json").read_text()) == cls.head_config()
    loaded = shatter.from_pretrained(tmp_path / "cls")
    assert isinstance(loaded, SequenceClassificationModel) and loaded.strategy == "modified"
    torch.testing.assert_close(loaded(x)["logits"], cls(x)["logits"], rtol=0, atol=0)
    span = SpanExtractionModel(tiny("bert-rpe")).eval()
    shatter.save_pretrained(span, tmp_path / "span")
    loaded = shatter.from_pretrained(tmp_path / "span")
    torch.testing.assert_close(loaded(x)["end_logits"], span(x)["end_logits"], rtol=0, atol=0)
    (tmp_path / "span" / "head.json").write_text('{"head": "ner"}')
    with pytest.raises(shatter.CheckpointError, match=r"head\.json: unknown head 'ner'"):
        shatter.from_pretrained(tmp_path / "span")
    # an MLM export wraps into a head: the finetuning path
    shatter.save_pretrained(tiny("shatter"), tmp_path / "mlm")
    head = SequenceClassificationModel(shatter.from_pretrained(tmp_path / "mlm"), 2)
    assert head(x)["logits"].shape == (2, 2)


@pytest.mark.parametrize("arch", ["bert", "shatter", "xlnet"])
@pytest.mark.parametrize("given", [False, True])
def test_the_mlm_head_decodes_the_predicted_positions(arch, given):
    """The loss and logits with labels, the loader's flat positions given (`predicted`) or
    found by the model, are the full decoding's rows at labels != -100 in row-major order and
    their mean cross-entropy, with the same gradients (xlnet: its query stream)."""
    x = ids(3, 12)
    mask = torch.ones_like(x)
    mask[2, 9:] = 0
    labels = torch.where((x % 4 == 0) & (mask == 1), x, -100)
    order = {}
    if arch == "xlnet":
        rank = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)).argsort(-1)
        order = {"perm_rank": torch.where(labels != -100, rank.argsort(-1), -1)}
    model = tiny(arch).eval()  # no dropout: two forwards, the same function
    full = model(x, mask, **order)["logits"][labels != -100]
    want = torch.nn.functional.cross_entropy(full, labels[labels != -100])
    want_grads = torch.autograd.grad(want, list(model.parameters()), allow_unused=True)
    predicted = shatter.model.predicted_positions(labels) if given else None
    out = model(x, mask, labels, predicted=predicted, **order)
    grads = torch.autograd.grad(out["loss"], list(model.parameters()), allow_unused=True)
    assert full.shape[0] == 8 and out["logits"].shape == full.shape
    torch.testing.assert_close(out["logits"], full)
    torch.testing.assert_close(out["loss"], want)
    for a, b in zip(grads, want_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_predicted_positions_are_the_labels_flat_row_major():
    labels = torch.tensor([[-100, 5, -100], [7, -100, 8]])
    assert shatter.model.predicted_positions(labels).tolist() == [1, 3, 5]
    assert shatter.model.predicted_positions(torch.full((2, 3), -100)).numel() == 0
