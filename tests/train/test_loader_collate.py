"""The loader's collate (train/loader/collate.py): named batches padded to their longest row,
static masks from the shards, dynamic masks seeded per row and epoch, truncation, the masker
chosen from the spec and pieces stacked without changing a row."""

import numpy as np
import pyarrow.ipc as ipc
import pytest
import torch

from shatter.shards import read_index
from shatter.train.loader import MaskingSpec, Piece, make_masker
from shatter.train.loader.collate import DynamicMasker, SpanPlmMasker, StaticMasker, StaticPlmMasker
from shatter.train.masking import IGNORE, MASK, PAD, SEP
from tests.train.loaderutil import stream, take


def test_batches_are_named_padded_to_their_longest_row(dataset):
    index = read_index(dataset)
    for b in take(iter(stream(index)), 6):
        ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
        lengths = mask.sum(1)
        assert ids.shape[1] == lengths.max()  # padded to the longest row of this batch, not seq_len
        assert bool((ids[mask == 0] == PAD).all()) and bool((labels[mask == 0] == IGNORE).all())
        assert bool((ids[torch.arange(len(ids)), lengths - 1] == SEP).all())
        assert ids.dtype == labels.dtype == torch.int64


def test_static_masks_cycle_by_epoch_and_match_the_shards(dataset):
    index = read_index(dataset)
    n, dupe = 24, index.dupe_factor
    s = stream(index, batch_size=n, shuffle=False)
    epochs = take(iter(s), dupe + 1)
    shard0 = ipc.open_stream(
        str(dataset / index.raw["splits"]["train"]["shards"][0]["file"])
    ).read_all()
    for e, b in enumerate(epochs[:dupe]):
        row0 = b["sample_id"].tolist().index(0)
        predicted = torch.nonzero(b["labels"][row0] != IGNORE).flatten().tolist()
        assert predicted == shard0["mask_positions"][0][e].as_py()
        assert b["input_ids"][row0, predicted].tolist() == shard0["mask_inputs"][0][e].as_py()
        assert b["labels"][row0, predicted].tolist() == shard0["mask_labels"][0][e].as_py()
    assert torch.equal(
        epochs[dupe]["labels"], epochs[0]["labels"]
    )  # epoch dupe_factor reuses copy 0
    assert not torch.equal(epochs[1]["labels"], epochs[0]["labels"])


@pytest.mark.parametrize("whole_word", [False, True])
def test_dynamic_masks_are_seeded_per_sample_and_epoch(dataset, whole_word):
    index = read_index(dataset)
    spec = MaskingSpec("dynamic", whole_word=whole_word)
    n = 24
    a = take(iter(stream(index, batch_size=n, masking=spec)), 2)
    b = take(iter(stream(index, batch_size=6, masking=spec, rank=0, world_size=1)), 8)
    by_id = {}
    for batch in b:
        for i, uid in enumerate(batch["sample_id"].tolist()):
            by_id.setdefault(uid, []).append(batch["labels"][i][batch["attention_mask"][i] == 1])
    for e in range(2):
        for i, uid in enumerate(a[e]["sample_id"].tolist()):
            mine = a[e]["labels"][i][a[e]["attention_mask"][i] == 1]
            assert torch.equal(mine, by_id[uid][e])  # independent of batch size and composition
    differs = sum(not torch.equal(x[0], x[1]) for x in by_id.values())
    assert differs >= 20, "dynamic masking must re-mask every epoch"
    labels, inputs, mask = a[0]["labels"], a[0]["input_ids"], a[0]["attention_mask"]
    predicted = labels != IGNORE
    content = (mask == 1) & (a[0]["input_ids"] != 2) & (a[0]["input_ids"] != SEP)
    rate = predicted.sum().item() / content.sum().item()
    assert 0.10 < rate < 0.22
    assert (inputs[predicted] == MASK).float().mean() > 0.6


def test_truncation_to_a_shorter_seq_len_keeps_sep(dataset):
    index = read_index(dataset)
    for b in take(iter(stream(index, seq_len=12)), 4):
        ids, lengths = b["input_ids"], b["attention_mask"].sum(1)
        assert ids.shape[1] <= 12
        assert bool((ids[torch.arange(len(ids)), lengths - 1] == SEP).all())
        assert bool((b["labels"][torch.arange(len(ids)), lengths - 1] == IGNORE).all())


def test_one_masker_is_chosen_from_the_spec():
    def pick(spec):
        return make_masker(spec, seed=3, dupe_factor=3, vocab_size=100)

    assert pick(MaskingSpec("static")) == StaticMasker(3)
    assert pick(MaskingSpec("static", fixed_copy=0)).copy(epoch=5) == 0
    assert pick(MaskingSpec("static")).copy(epoch=5) == 2
    assert isinstance(pick(MaskingSpec("dynamic", whole_word=True)), DynamicMasker)
    assert isinstance(pick(MaskingSpec("dynamic", objective="plm")), SpanPlmMasker)
    plm_static = pick(MaskingSpec("dynamic", objective="plm", plm_targets="static"))
    assert isinstance(plm_static, StaticPlmMasker) and plm_static.stored
    assert not pick(MaskingSpec("dynamic")).stored and pick(MaskingSpec("static")).stored


def test_stacked_pieces_keep_their_rows_and_mask_as_if_alone(dataset):
    """Dynamic masks depend on (seed, epoch, row id) only: a row masked in a stack of pieces of
    different widths gets the same mask as in its own piece; stacking pads with PAD."""
    s = stream(read_index(dataset), batch_size=6, masking=MaskingSpec("dynamic"))
    q = np.arange(24)
    pieces = list(s.pieces(q))
    assert len(pieces) > 1 and len({p.ids.shape[1] for p in pieces}) > 1
    stacked = Piece.stack(pieces)
    assert sorted(stacked.where.tolist()) == list(range(24))
    masker = s.collate.masker
    together = masker(stacked)
    at = 0
    for p in pieces:
        alone, w = masker(p), p.ids.shape[1]
        np.testing.assert_array_equal(stacked.ids[at : at + len(p.where), :w], p.ids)
        assert (stacked.ids[at : at + len(p.where), w:] == PAD).all()
        np.testing.assert_array_equal(together.labels[at : at + len(p.where), :w], alone.labels)
        np.testing.assert_array_equal(together.inputs[at : at + len(p.where), :w], alone.inputs)
        at += len(p.where)


def test_the_permutation_lm_batch_carries_its_order_and_mlm_does_not(dataset):
    index = read_index(dataset)
    mlm = take(iter(stream(index)), 1)[0]
    spec = MaskingSpec("static", objective="plm")
    plm = take(iter(stream(index, masking=spec)), 1)[0]
    assert "perm_rank" not in mlm and plm["perm_rank"].shape == plm["input_ids"].shape
    assert bool((plm["perm_rank"][plm["attention_mask"] == 0] == -1).all())


@pytest.mark.parametrize("seq_len", [16, 8])
def test_a_shorter_length_cuts_each_stored_row_into_pieces(dataset, seq_len):
    """Built at 32: at 16 (8) each row is 2 (4) rows of the stream, [CLS] + its next 14 (6)
    content tokens + [SEP], consecutive positions, the stored masks moved onto each piece,
    an epoch k times as long; dynamic masks differ between a row's pieces."""
    index = read_index(dataset)
    k, s = 32 // seq_len, seq_len - 2
    uncut = stream(index, batch_size=24).batch(np.arange(24))
    cut = stream(index, batch_size=24 * k, seq_len=seq_len)
    assert cut.end is None and cut.k == k
    b = cut.batch(np.arange(24 * k))
    assert b["sample_id"].tolist() == [
        u * k + j for u in uncut["sample_id"].tolist() for j in range(k)
    ]
    for r in range(24):
        n = int(uncut["attention_mask"][r].sum())
        for j in range(k):
            at = r * k + j
            length = int(b["attention_mask"][at].sum())
            count = min(max(n - 2 - j * s, 0), s)
            assert length == count + 2 and int(b["input_ids"][at, 0]) == 2
            assert int(b["input_ids"][at, length - 1]) == SEP
            stored = slice(1 + j * s, 1 + j * s + count)
            assert torch.equal(b["labels"][at, 1 : 1 + count], uncut["labels"][r, stored])
            assert torch.equal(b["input_ids"][at, 1 : 1 + count], uncut["input_ids"][r, stored])
    dynamic = stream(index, batch_size=24 * k, seq_len=seq_len, masking=MaskingSpec("dynamic"))
    d = dynamic.batch(np.arange(24 * k))
    pieces = [d["labels"][r * k : r * k + k] for r in range(24)]
    assert sum(not torch.equal(p[0], p[1]) for p in pieces) >= 12
    assert dynamic.batch(np.arange(24 * k, 48 * k))["epoch"].tolist() == [1] * (24 * k)
