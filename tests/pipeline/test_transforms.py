"""Each PTransform on literal inputs, with TestPipeline and assert_that (on the FnApiRunner)."""

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from shatter import shards
from shatter.pipeline import packing, tokenizer
from shatter.pipeline.config import BuildConfig, InputSpec
from shatter.pipeline.holdout import HoldOut, content_key, tail_split
from shatter.pipeline.masking import SPECIAL_IDS
from shatter.pipeline.readers import ReadSpec
from shatter.pipeline.sink import ShardAndWrite
from shatter.pipeline.transforms import (
    Clean,
    DocBatch,
    MaskSpec,
    Pack,
    Packed,
    ReadDocuments,
    SampleLines,
    Tokenize,
    Tokenized,
    mask_table,
    row_keys,
)

from .corpus import generated_documents


def _pipeline():
    return BeamTestPipeline(runner=FnApiRunner())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    lines = [line for d in generated_documents(100) for line in d.split("\n")]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(tokenizer.train(lines, 300))
    return str(path)


def test_read_documents_batches_by_characters(tmp_path):
    docs = ["first doc", "second doc here", "third"]
    (tmp_path / "a.txt").write_text("\n".join(docs) + "\n")
    config = BuildConfig(
        inputs=(InputSpec("text", str(tmp_path)),),
        output=str(tmp_path),
        text_mode="line",
        batch_chars=20,
    )
    with _pipeline() as p:
        out = p | ReadDocuments([ReadSpec("text", str(tmp_path / "a.txt"))], "auto", config)
        assert_that(
            out,
            equal_to(
                [
                    DocBatch("text", "auto", ("first doc\n", "second doc here\n")),
                    DocBatch("text", "auto", ("third\n",)),
                ]
            ),
        )


def test_clean_per_corpus_and_drops_empty_documents():
    batches = [
        DocBatch(
            "wiki",
            "auto",
            ("'''Paris''' is the [[capital city|capital]] of [[France]].{{cn}}", "{{stub}}"),
        ),
        DocBatch("text", "train", ("  two\n\nparagraphs  ",)),
    ]
    with _pipeline() as p:
        out = p | beam.Create(batches) | Clean()
        assert_that(
            out,
            equal_to(
                [
                    DocBatch("wiki", "auto", ("Paris is the capital of France.",)),
                    DocBatch("text", "train", ("two\nparagraphs",)),
                ]
            ),
        )


def test_sample_lines_takes_the_smallest_hashes_in_order():
    lines = [f"line {i}" for i in range(50)]
    batches = [
        DocBatch("text", "auto", ("\n".join(lines[:20]),)),
        DocBatch("text", "auto", ("\n".join(lines[20:]),)),
    ]
    expected = [line for _, line in tokenizer.smallest_lines(lines, 7)]
    with _pipeline() as p:
        out = p | beam.Create(batches) | SampleLines(7)
        assert_that(out, equal_to([expected]))


def _lines_with_long_ones(n_lines: int, seed: int = 3) -> list[str]:
    """Short lines, and lines around sentencepiece's length limit in bytes ("é" is two)."""
    lines = [line for d in generated_documents(n_lines // 2, seed) for line in d.split("\n")]
    limit = tokenizer.MAX_SENTENCE_BYTES
    for k, i in enumerate(range(0, len(lines), 7)):
        word = lines[i].split()[0]
        ascii_, accented = (word + " ") * limit, (word + "é ") * limit
        lines[i] = (
            [
                ascii_[:limit],  # the trainer's longest line
                ascii_[: limit + 1],  # one byte too long
                accented[: limit // 2],  # fewer characters than bytes
                accented[: limit - 5],  # few enough characters, too many bytes
                ascii_ * 3,
            ][k % 5][:-1]
            + "z"
        )  # no space at the ends: cleaned lines have none
    return lines


def test_sample_keeps_the_trainers_lines_and_drops_only_the_text_it_skips():
    """Against the naive reference (heapq over all lines): the same trainable lines in the same
    order, many prunings on the way, and training gives the same model bytes."""
    lines = _lines_with_long_ones(600)
    assert {tokenizer.trainable(x) for x in lines} == {True, False}
    assert any(len(x.encode()) == tokenizer.MAX_SENTENCE_BYTES for x in lines)
    n = 150
    fn = SampleLines(n).fn
    acc, most = fn.create_accumulator(), 0
    for i in range(0, len(lines), 10):
        acc = fn.add_input(acc, DocBatch("text", "auto", ("\n".join(lines[i : i + 10]),)))
        most = max(most, len(acc.items))
        # the long lines' text is never held: memory is bounded by the sample, not the corpus
        assert all(tokenizer.trainable(x) for _, x in acc.items)
    assert most < 1.5 * n + 10
    naive = [line for _, line in tokenizer.smallest_lines(lines, n)]
    sample = fn.extract_output(fn.merge_accumulators([acc, fn.create_accumulator()]))
    assert sample == [x for x in naive if tokenizer.trainable(x)]
    assert len(sample) < len(naive)
    assert tokenizer.train(sample, 200) == tokenizer.train(naive, 200)


def test_sample_merges_accumulators_like_one():
    lines = _lines_with_long_ones(300, seed=4)
    fn, n = SampleLines(40).fn, 40
    parts = [
        fn.add_input(fn.create_accumulator(), DocBatch("text", "auto", ("\n".join(lines[i::3]),)))
        for i in range(3)
    ]
    naive = [x for _, x in tokenizer.smallest_lines(lines, n) if tokenizer.trainable(x)]
    assert fn.extract_output(fn.merge_accumulators(parts)) == naive


def test_tokenize_splits_by_document_hash_or_tails(model_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    docs = tuple(generated_documents(40, seed=5))
    fraction = 0.3
    held = [d for d in docs if content_key(d.encode()) < fraction * 2.0**64]
    assert 0 < len(held) < len(docs)

    def check(outputs):
        by_split = {t.split: t.docs for t in outputs}
        assert [list(a) for a in by_split["validation"]] == sp.encode(held)
        assert len(by_split["train"]) == len(docs) - len(held)

    tails = [tail_split(d, fraction) for d in docs]

    def check_tails(outputs):
        by_split = {t.split: t.docs for t in outputs}
        assert [list(a) for a in by_split["validation"]] == sp.encode([t for _, t in tails if t])
        assert [list(a) for a in by_split["train"]] == sp.encode([h for h, _ in tails])

    with _pipeline() as p:
        batch = p | beam.Create([DocBatch("text", "auto", docs)])
        assert_that(batch | Tokenize(model_path, HoldOut(fraction)), check)
        split = batch | "tails" >> Tokenize(model_path, HoldOut(fraction, tails=True))
        assert_that(split, check_tails, label="tails")


def test_pack_pads_and_keys_rows_by_content():
    docs = (np.arange(5, 60, dtype=np.int32), np.arange(100, 120, dtype=np.int32))
    want = packing.pack_documents(list(docs), 16)

    def check(outputs):
        (packed,) = outputs
        assert packed.split == "train" and packed.ids.shape == (len(want), 16)
        assert [r[:n].tolist() for r, n in zip(packed.ids, packed.lengths)] == [
            r.tolist() for r in want
        ]
        assert all(
            (r[n:] == 0).all() for r, n in zip(packed.ids, packed.lengths)
        )  # padding is [PAD]
        assert packed.lengths[-1] < 16  # the stream's short last row
        assert packed.keys.tolist() == row_keys(packed.ids, packed.lengths).tolist()
        assert len(set(packed.keys.tolist())) == len(want)

    with _pipeline() as p:
        assert_that(p | beam.Create([Tokenized("train", docs)]) | Pack(16, True), check)


def test_row_keys_depend_on_the_row_alone():
    rows = [
        np.array([2, 7, 8, 3]),
        np.array([2, 8, 7, 3]),
        np.array([2, 7, 8, 9, 3]),
        np.array([2, 7, 8, 3]),
    ]
    narrow, lengths = packing.padded(rows, 5)
    wide, _ = packing.padded(rows, 64)
    keys = row_keys(narrow, lengths)
    assert keys.tolist() == row_keys(wide, lengths).tolist()  # padding never changes a key
    assert (
        keys[0] == keys[3] and len(set(keys[:3].tolist())) == 3
    )  # equal rows, equal keys; else distinct
    # well spread: the top bits (the sharding buckets) of many keys are close to uniform
    many = row_keys(
        *packing.padded([np.array([2, i, j, 3]) for i in range(100) for j in range(100)], 4)
    )
    assert np.histogram(many >> np.uint64(60), bins=16, range=(0, 16))[0].min() > 10000 / 16 * 0.85


def _masked(model_path, rows, dupe_factor, seed=7):
    sp = tokenizer.load(open(model_path, "rb").read())
    ids, lengths = packing.padded(rows, max(len(r) for r in rows))
    spec = MaskSpec(model_path, seed, dupe_factor, 0.15, False)
    return mask_table(
        row_keys(ids, lengths),
        ids,
        lengths,
        tokenizer.word_start_table(sp),
        sp.get_piece_size(),
        spec,
    )


def test_mask_table_adds_static_maskings(model_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    rows = packing.pack_documents([np.array(sp.encode(d)) for d in generated_documents(10)], 32)
    table = _masked(model_path, rows, 3)
    assert table.schema.equals(shards.schema(300))
    assert [r.tolist() for r in rows] == table["input_ids"].to_pylist()
    ws = tokenizer.word_start_table(sp)
    assert table["word_start"].to_pylist() == [ws[r].tolist() for r in rows]
    copies = table["mask_positions"].to_pylist()
    assert all(len(c) == 3 for c in copies)
    assert any(a != b for c in copies for a, b in zip(c, c[1:]))  # the copies differ
    labels = table["mask_labels"].to_pylist()
    assert not any(lab in SPECIAL_IDS for row in labels for copy in row for lab in copy)
    for row, positions, copy_labels in zip(rows, copies, labels):
        for pos, lab in zip(positions, copy_labels):
            assert row[pos].tolist() == lab
    assert _masked(model_path, rows, 3).equals(table)  # deterministic
    assert not _masked(model_path, rows, 3, seed=8)["mask_positions"].equals(
        table["mask_positions"]
    )


def test_shard_and_write_balances_sorts_masks_and_writes_every_shard(model_path, tmp_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    rows = packing.pack_documents([np.array(sp.encode(d)) for d in generated_documents(120)], 16)
    ids, lengths = packing.padded(rows, 16)
    keys = row_keys(ids, lengths)
    pieces = [
        Packed("train", keys[i : i + 50], ids[i : i + 50], lengths[i : i + 50])
        for i in range(0, len(rows), 50)
    ]
    out = tmp_path / "out"
    counts = {"train": 4, "validation": 2}
    spec = MaskSpec(model_path, 0, 2, 0.15, False)
    with _pipeline() as p:
        infos = (
            p
            | beam.Create(pieces)
            | ShardAndWrite(str(out), str(tmp_path / "work"), counts, spec, 120)
        )
        assert_that(
            infos | beam.Map(lambda i: (i["split"], i["shard"], i["file"])),
            equal_to(
                [("train", i, f"train-{i:05d}-of-00004.arrow") for i in range(4)]
                + [("validation", i, f"validation-{i:05d}-of-00002.arrow") for i in range(2)]
            ),
        )
    tables = [shards.read_shard(str(out / f"train-{i:05d}-of-00004.arrow")) for i in range(4)]
    sizes = [t.num_rows for t in tables]
    assert sum(sizes) == len(rows) and max(sizes) - min(sizes) <= 3
    merged = pa.concat_tables(tables)
    merged_keys = merged["key"].to_numpy()
    assert (
        np.diff(merged_keys.astype(np.float64)) >= 0
    ).all()  # key ranges, sorted within and across shards
    assert sorted(merged_keys.tolist()) == sorted(keys.tolist())
    # each row is written with its own ids and the maskings mask_table gives it, whatever its spill
    order = np.argsort(keys, kind="stable")
    want = mask_table(
        keys[order],
        ids[order],
        lengths[order],
        tokenizer.word_start_table(sp),
        sp.get_piece_size(),
        spec,
    )
    assert merged.equals(want)
    assert shards.read_shard(str(out / "validation-00000-of-00002.arrow")).num_rows == 0


@pytest.mark.slow
def test_rows_padded_to_different_widths_write_the_same_shards(model_path, tmp_path):
    """Per-document packing of short documents pads each batch only to its longest row; spills and
    the writer stack such batches at the widest, and the bytes written do not depend on it."""
    sp = tokenizer.load(open(model_path, "rb").read())
    docs = [
        np.array(sp.encode(d))[: 2 + (i // 40) * 4] for i, d in enumerate(generated_documents(200))
    ]
    ids, lengths = packing.pack_documents_padded(docs, 32, cross_document=False)
    keys = row_keys(ids, lengths)
    spec = MaskSpec(model_path, 0, 2, 0.15, False)
    counts = {"train": 3, "validation": 1}

    def write(pieces, out):
        with _pipeline() as p:
            _ = (
                p
                | beam.Create(pieces)
                | ShardAndWrite(str(out), str(tmp_path / f"work-{out.name}"), counts, spec, 70)
            )
        return {f.name: f.read_bytes() for f in sorted(out.glob("*.arrow"))}

    full = [
        Packed("train", keys[i : i + 40], ids[i : i + 40], lengths[i : i + 40])
        for i in range(0, len(keys), 40)
    ]
    trimmed = [Packed("train", p.keys, p.ids[:, : p.lengths.max()], p.lengths) for p in full]
    assert len({p.ids.shape[1] for p in trimmed}) > 1 and max(p.ids.shape[1] for p in trimmed) < 32
    assert write(trimmed, tmp_path / "trimmed") == write(full, tmp_path / "full")
    with _pipeline() as p:
        packed = p | beam.Create([Tokenized("train", tuple(docs))]) | Pack(32, False)
        assert_that(packed | beam.Map(lambda x: x.ids.shape[1]), equal_to([int(lengths.max())]))


def test_sample_is_capped_by_bytes_as_well_as_lines():
    """--tokenizer-sample-mb: the longest prefix in hash order within both caps, also when the
    parts are pruned by bytes on the way and merged."""
    lines = _lines_with_long_ones(600, seed=5)
    trainable = [
        x for _, x in tokenizer.smallest_lines(lines, len(lines)) if tokenizer.trainable(x)
    ]
    max_bytes = sum(len(x.encode()) for x in trainable) // 5
    fn = SampleLines(10_000, max_bytes).fn
    parts = []
    for i in range(3):
        acc = fn.create_accumulator()
        for j in range(10 * i, len(lines), 30):
            acc = fn.add_input(acc, DocBatch("text", "auto", ("\n".join(lines[j : j + 10]),)))
            assert acc.size < 1.5 * max_bytes + 10 * tokenizer.MAX_SENTENCE_BYTES
        parts.append(acc)
    sample = fn.extract_output(fn.merge_accumulators(parts))
    expected, total = [], 0
    for line in trainable:  # the naive reference
        total += len(line.encode())
        if total > max_bytes:
            break
        expected.append(line)
    assert sample == expected and 0 < len(sample) < len(trainable)
