"""Each PTransform on literal inputs, with TestPipeline and assert_that (on the FnApiRunner)."""
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

import apache_beam as beam
from pipeline import packing, shards, tokenizer
from pipeline.masking import SPECIAL_IDS
from pipeline.readers import ReadSpec
from pipeline.transforms import (Clean, DocBatch, Mask, Pack, Packed, ReadDocuments, SampleLines, ShardAndWrite,
                                 Tokenize, Tokenized, content_key, mask_table)

from pipeline.config import BuildConfig, InputSpec

from .conftest import generated_documents


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
    config = BuildConfig(inputs=(InputSpec("text", str(tmp_path)),), output=str(tmp_path), text_mode="line",
                         batch_chars=20)
    with _pipeline() as p:
        out = p | ReadDocuments([ReadSpec("text", str(tmp_path / "a.txt"))], "auto", config)
        assert_that(out, equal_to([DocBatch("text", "auto", ("first doc\n", "second doc here\n")),
                                   DocBatch("text", "auto", ("third\n",))]))


def test_clean_per_corpus_and_drops_empty_documents():
    batches = [DocBatch("wiki", "auto", ("'''Paris''' is the [[capital city|capital]] of [[France]].{{cn}}", "{{stub}}")),
               DocBatch("text", "train", ("  two\n\nparagraphs  ",))]
    with _pipeline() as p:
        out = p | beam.Create(batches) | Clean()
        assert_that(out, equal_to([DocBatch("wiki", "auto", ("Paris is the capital of France.",)),
                                   DocBatch("text", "train", ("two\nparagraphs",))]))


def test_sample_lines_takes_the_smallest_hashes_in_order():
    lines = [f"line {i}" for i in range(50)]
    batches = [DocBatch("text", "auto", ("\n".join(lines[:20]),)), DocBatch("text", "auto", ("\n".join(lines[20:]),))]
    expected = [line for _, line in tokenizer.smallest_lines(lines, 7)]
    with _pipeline() as p:
        out = p | beam.Create(batches) | SampleLines(7)
        assert_that(out, equal_to([expected]))


def test_tokenize_splits_by_document_hash(model_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    docs = tuple(generated_documents(40, seed=5))
    fraction = 0.3
    held = [d for d in docs if content_key(d.encode()) < fraction * 2.0**64]
    assert 0 < len(held) < len(docs)

    def check(outputs):
        by_split = {t.split: t.docs for t in outputs}
        assert [list(a) for a in by_split["validation"]] == sp.encode(held)
        assert len(by_split["train"]) == len(docs) - len(held)

    with _pipeline() as p:
        out = p | beam.Create([DocBatch("text", "auto", docs)]) | Tokenize(model_path, fraction)
        assert_that(out, check)


def test_pack_keys_rows_by_content():
    docs = (np.arange(5, 60, dtype=np.int32), np.arange(100, 120, dtype=np.int32))
    want = packing.pack_documents(list(docs), 16)

    def check(outputs):
        (packed,) = outputs
        assert packed.split == "train" and [r.tolist() for r in packed.rows] == [r.tolist() for r in want]
        assert packed.keys.tolist() == [content_key(r.astype(np.int32).tobytes()) for r in want]

    with _pipeline() as p:
        assert_that(p | beam.Create([Tokenized("train", docs)]) | Pack(16, True), check)


def test_mask_adds_static_maskings(model_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    rows = tuple(packing.pack_documents([np.array(sp.encode(d)) for d in generated_documents(10)], 32))
    keys = np.array([content_key(r.astype(np.int32).tobytes()) for r in rows], dtype=np.uint64)
    want = mask_table(rows, keys, tokenizer.word_start_table(sp), sp.get_piece_size(), 7, 3, 0.15, False)

    def check(outputs):
        (split, table), = outputs
        assert split == "validation" and table.equals(want)
        assert table.schema.equals(shards.schema(300))
        copies = table["mask_positions"].to_pylist()
        assert all(len(c) == 3 for c in copies)
        labels = table["mask_labels"].to_pylist()
        assert not any(lab in SPECIAL_IDS for row in labels for copy in row for lab in copy)

    with _pipeline() as p:
        assert_that(p | beam.Create([Packed("validation", keys, rows)]) | Mask(model_path, 7, 3, 0.15, False), check)


def test_shard_and_write_balances_sorts_and_writes_every_shard(model_path, tmp_path):
    sp = tokenizer.load(open(model_path, "rb").read())
    rows = packing.pack_documents([np.array(sp.encode(d)) for d in generated_documents(120)], 16)
    keys = np.array([content_key(r.astype(np.int32).tobytes()) for r in rows], dtype=np.uint64)
    table = mask_table(rows, keys, tokenizer.word_start_table(sp), 300, 0, 1, 0.15, False)
    pieces = [("train", table.slice(i, 50)) for i in range(0, table.num_rows, 50)]
    out = tmp_path / "out"
    counts = {"train": 4, "validation": 2}
    with _pipeline() as p:
        infos = p | beam.Create(pieces) | ShardAndWrite(str(out), str(tmp_path / "work"), counts, 300, 120)
        assert_that(infos | beam.Map(lambda i: (i["split"], i["shard"], i["file"])), equal_to(
            [("train", i, f"train-{i:05d}-of-00004.arrow") for i in range(4)]
            + [("validation", i, f"validation-{i:05d}-of-00002.arrow") for i in range(2)]))
    tables = [shards.read_shard(str(out / f"train-{i:05d}-of-00004.arrow")) for i in range(4)]
    sizes = [t.num_rows for t in tables]
    assert sum(sizes) == table.num_rows and max(sizes) - min(sizes) <= 3
    merged = pa.concat_tables(tables)["key"].to_numpy()
    assert (np.diff(merged.astype(np.float64)) >= 0).all()  # key ranges, sorted within and across shards
    assert sorted(merged.tolist()) == sorted(keys.tolist())
