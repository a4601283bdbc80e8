"""Permutation-LM batches: XLNet's span targets, seeded per (seed, epoch, sample), static option,
inputs never masked; the objective defaults and refusals; the [SEP] id the model is built with."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import shatter
from shatter.pipeline.masking import SPECIAL_IDS
from shatter.shards import read_index
from shatter.train.config import ConfigError, DataArgs, ModelArgs, TrainConfig, model_overrides
from shatter.train.loader import MaskingSpec, ShardStream, validation_stream
from shatter.train.masking import IGNORE
from shatter.train.plm import plm_batch, with_objective
from tests.train.shardutil import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(
        tmp_path_factory.mktemp("plm") / "data", shards=(9, 7), seq_len=64, dupe_factor=2
    )


def _stream(index, **kw):
    spec = MaskingSpec("static", objective="plm", **kw)
    return ShardStream(index, "train", batch_size=16, seq_len=64, masking=spec, seed=3)


def _spans(labels_L: np.ndarray) -> list[int]:
    runs, n = [], 0
    for t in (labels_L != IGNORE).tolist() + [False]:
        if t:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_span_targets_follow_xlnet_and_inputs_are_the_rows_own(dataset):
    index = read_index(dataset)
    batch = next(iter(_stream(index)))
    ids, labels, rank = (batch[k].numpy() for k in ("input_ids", "labels", "perm_rank"))
    plain = next(
        iter(
            ShardStream(
                index, "train", batch_size=16, seq_len=64, masking=MaskingSpec("static"), seed=3
            )
        )
    )
    original = torch.where(plain["labels"] != IGNORE, plain["labels"], plain["input_ids"])
    assert np.array_equal(ids, original.numpy())  # the row's own ids: never [MASK]-ed
    target = labels != IGNORE
    assert np.array_equal(labels[target], ids[target])
    assert not np.isin(ids[target], SPECIAL_IDS).any()
    share = target.sum() / batch["attention_mask"].numpy().sum()
    assert 0.08 < share < 0.25, share  # about 1/K = 1/6
    assert max(n for row in labels for n in _spans(row)) <= 5
    for b in range(len(ids)):  # targets last, in an order: ranks 0..M-1; context -1
        assert sorted(rank[b][target[b]].tolist()) == list(range(target[b].sum()))
        assert (rank[b][~target[b]] == -1).all()


def test_targets_and_orders_depend_on_seed_epoch_and_sample_only():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 100, (6, 40))
    lengths = np.full(6, 40)
    uid = np.arange(10, 16)
    a = plm_batch(ids, lengths, uid, epoch=2, seed=7)
    b = plm_batch(ids[::-1], lengths, uid[::-1], epoch=2, seed=7)  # other batch composition
    for x, y in zip(a[1:], b[1:]):
        assert np.array_equal(x, y[::-1])
    c = plm_batch(ids, lengths, uid, epoch=3, seed=7)
    assert not np.array_equal(a[1], c[1])
    d = plm_batch(ids, lengths, uid, epoch=2, seed=8)
    assert not np.array_equal(a[2], d[2])


def test_static_targets_are_the_stored_mask_positions(dataset):
    index = read_index(dataset)
    plm = next(iter(_stream(index, plm_targets="static")))
    mlm = next(
        iter(
            ShardStream(
                index, "train", batch_size=16, seq_len=64, masking=MaskingSpec("static"), seed=3
            )
        )
    )
    assert torch.equal(plm["labels"], mlm["labels"])
    assert not torch.equal(plm["input_ids"], mlm["input_ids"])  # the MLM's are [MASK]-ed


def test_validation_is_fixed_and_carries_the_order(dataset):
    index = read_index(dataset)
    args = DataArgs(objective="plm")
    one, two = (
        next(iter(validation_stream(index, args, batch_size=4, seq_len=64, rank=0, world_size=1)))
        for _ in range(2)
    )
    assert "perm_rank" in one and torch.equal(one["perm_rank"], two["perm_rank"])


def test_objective_defaults_to_the_arch_and_plm_is_refused_for_mlm_archs():
    cfg = lambda preset, **d: TrainConfig(model=ModelArgs(preset=preset), data=DataArgs(**d))  # noqa: E731
    assert with_objective(cfg("xlnet-tiny")).data.objective == "plm"
    assert with_objective(cfg("xlnet-tiny", objective="mlm")).data.objective == "mlm"
    assert with_objective(cfg("bert-tiny")).data.objective == "mlm"
    with pytest.raises(ConfigError, match="objective plm needs a two-stream arch"):
        with_objective(cfg("shatter-tiny", objective="plm"))
    with pytest.raises(ConfigError, match="plm_targets"):
        with_objective(cfg("xlnet-tiny", plm_targets="words"))


def test_the_model_counts_segments_from_the_datasets_sep_id(tmp_path):
    """The run's model takes [SEP] (and [PAD]) from index.json special_ids, not a constant;
    the config's model.overrides still win."""
    root = write_dataset(tmp_path / "data", shards=(2,), val_rows=())
    raw = json.loads((root / "index.json").read_text())
    raw["tokenizer"]["special_ids"]["[SEP]"] = 7
    (root / "index.json").write_text(json.dumps(raw))
    index = read_index(root, verify_tokenizer=False)
    cfg = TrainConfig(model=ModelArgs(preset="xlnet-tiny"))
    fields = model_overrides(cfg, index, 32)
    assert fields == {"max_len": 32, "vocab_size": 100, "pad_id": 0, "sep_id": 7}
    model = shatter.build_model("xlnet-tiny", **fields)
    x = torch.tensor([[2, 10, 7, 11, 3, 12]])
    assert model.encoder.attention_inputs(x)["segment_BL"].tolist() == [[0, 0, 0, 1, 1, 1]]
    cfg = TrainConfig(model=ModelArgs(preset="xlnet-tiny", overrides={"sep_id": 9}))
    assert model_overrides(cfg, index, 32)["sep_id"] == 9
    assert model_overrides(cfg, None, 32) == {"max_len": 32, "sep_id": 9}
