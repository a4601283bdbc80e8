"""The validation hold-out's pure functions: whole documents by hash where they make the fraction
asked, else the tail of each document; and the warning of a share far from the fraction."""

from shatter.pipeline.holdout import (
    HoldOut,
    HoldOutStats,
    batch_stats,
    content_key,
    decide,
    merge,
    tail_split,
    threshold,
)
from shatter.pipeline.inspect import validation_warnings
from tests.pipeline.corpus import generated_documents


def _stats(docs: list[str], fraction: float) -> HoldOutStats:
    keyed = [(content_key(d.encode()), len(d)) for d in docs]
    return merge(batch_stats(keyed[i::3], fraction) for i in range(3))  # as batches would


def test_stats_merge_like_one_batch():
    docs = generated_documents(50, seed=1)
    keyed = [(content_key(d.encode()), len(d)) for d in docs]
    assert _stats(docs, 0.2) == batch_stats(keyed, 0.2)
    assert merge([HoldOutStats(), batch_stats(keyed, 0.2)]) == batch_stats(keyed, 0.2)
    assert batch_stats(keyed, 0.2).smallest_key == min(k for k, _ in keyed)


def test_many_documents_are_held_out_whole_by_hash():
    docs = generated_documents(400, seed=2)
    hold_out = decide(_stats(docs, 0.1), 0.1)
    assert hold_out == HoldOut(0.1)  # the hash alone (what a build with a given tokenizer ran)
    keys = [content_key(d.encode()) for d in docs]
    held = [d for d, k in zip(docs, keys) if hold_out.split(d, k) == [("validation", d)]]
    assert held == [d for d, k in zip(docs, keys) if k < threshold(0.1)]


def test_few_documents_hold_out_each_one_s_tail():
    """Six books at 0.05: one whole book would be about a sixth; each book's last 5% instead."""
    books = ["\n".join(generated_documents(40, seed=b)) for b in range(6)]
    stats = _stats(books, 0.05)
    hold_out = decide(stats, 0.05)
    assert hold_out.tails and stats.documents == 6
    pieces = [hold_out.split(b, content_key(b.encode())) for b in books]
    assert all([s for s, _ in p] == ["train", "validation"] for p in pieces)
    held = sum(len(p[1][1]) for p in pieces) / sum(len(b) for b in books)
    assert 0.045 < held < 0.055, held
    # a single document too (no smallest key of two to hold out)
    assert decide(_stats(books[:1], 0.05), 0.05).tails


def test_a_corpus_without_a_hashed_document_holds_out_its_smallest_key():
    """200 equal documents at 0.5%: none below the hash threshold (almost surely), and the one
    of smallest key is 0.5% of the text: held out whole."""
    docs = [f"text {i} " + "word " * 50 for i in range(200)]
    stats = _stats(docs, 0.005)
    assert stats.hashed_chars == 0
    assert decide(stats, 0.005) == HoldOut(0.005, smallest_key=stats.smallest_key)
    assert decide(stats, 0) == HoldOut(0) and decide(HoldOutStats(), 0.1) == HoldOut(0.1)


def test_tail_split_cuts_at_a_line_break_or_a_space():
    text = "\n".join(f"paragraph {i} " + "x" * 80 for i in range(100))
    head, tail = tail_split(text, 0.05)
    assert head + "\n" + tail == text and tail.startswith("paragraph ")
    assert abs(len(tail) / len(text) - 0.05) < 0.01
    one_line = " ".join(["word"] * 400)
    head, tail = tail_split(one_line, 0.1)
    assert head + " " + tail == one_line and tail.startswith("word")
    solid = "x" * 160  # no space to cut at
    assert tail_split(solid, 0.1) == (solid[:144], solid[144:])
    assert tail_split("short", 0.05) == ("short", "")


def _index(train_rows: int, validation_rows: int, hold_out: str | None) -> dict:
    counters = {"documents_tokenized": 6, **({"validation_hold_out": hold_out} if hold_out else {})}
    return {
        "seq_len": 128,
        "config": {"validation_fraction": 0.05, "validation_inputs": []},
        "splits": {
            "train": {"shards": [{"rows": train_rows}]},
            "validation": {"shards": [{"rows": validation_rows}]},
        },
        "counters": counters,
    }


def test_a_share_far_from_the_fraction_warns_with_why_and_the_fix():
    assert validation_warnings(_index(950, 100, "document tails")) == []
    (whole,) = validation_warnings(_index(1000, 200, "whole documents"))
    assert "16.7% of the rows" in whole and "asked 5.0%" in whole
    assert "whole document" in whole and "6 documents" in whole and "--validation-input" in whole
    (tails,) = validation_warnings(_index(1000, 200, "document tails"))
    assert "last 5.0% of each document" in tails and "rows of 128 ids" in tails
    assert "--validation-input" in tails
