"""Pair encoding, SQuAD windows and the span decoder on a real sentencepiece model."""

import numpy as np
import pytest

from shatter.train.finetuning.features import (
    CLS,
    PAD,
    SEP,
    Tokenizer,
    best_span,
    encode_pair,
    pad_batch,
    span_windows,
)

from .data import squad_json


def test_encode_pair_truncates_the_longer_side_first():
    ids = encode_pair(list(range(10, 30)), [7, 8, 9], max_len=12)
    assert len(ids) == 12
    assert ids[0] == CLS and ids[-1] == SEP and ids.count(SEP) == 2
    assert ids[-4:] == [7, 8, 9, SEP]  # the short side survives whole
    assert encode_pair([5, 6], [], max_len=8) == [CLS, 5, 6, SEP]


def test_pad_batch_masks_padding():
    batch = pad_batch([[CLS, 5, SEP], [CLS, SEP]])
    assert batch["input_ids"].tolist() == [[CLS, 5, SEP], [CLS, SEP, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_encode_pair_matches_token_by_token_longest_first_truncation():
    """BERT's _truncate_seq_pair (pop from the longer list until the pair fits), for every small case."""
    for max_len in range(5, 16):
        for la in range(0, 14):
            for lb in range(1, 14):
                a, b = list(range(10, 10 + la)), list(range(100, 100 + lb))
                ra, rb = list(a), list(b)
                while len(ra) + len(rb) > max_len - 3:
                    (ra if len(ra) >= len(rb) else rb).pop()
                assert encode_pair(a, b, max_len) == [CLS, *ra, SEP, *rb, SEP], (max_len, la, lb)


def test_tokenizer_refuses_a_model_without_the_special_ids(tmp_path, tokenizer_model):
    import sentencepiece as spm

    from shatter.checkpoint import CheckpointError

    with pytest.raises(FileNotFoundError, match="tokenizer model not found"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "corpus.txt").write_text(
        "\n".join(f"line {i} of a small corpus, words {i * 7}" for i in range(200))
    )
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "plain"),
        vocab_size=60,
        minloglevel=2,
    )  # sentencepiece's own ids: <unk>=0 <s>=1 </s>=2
    with pytest.raises(CheckpointError, match=r"plain.model: tokenizer has \[PAD\] at id"):
        Tokenizer(tmp_path / "plain.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="junk.model"):
        Tokenizer(tmp_path / "junk.model")
    assert Tokenizer(tokenizer_model).vocab_size == 200


def test_offsets_point_into_the_original_cased_text(tokenizer_model):
    tok = Tokenizer(tokenizer_model)
    text = "The FILM was   Great, really. Café Ürs naïve — 東京 İstanbul."
    ids, begins, ends = tok.encode_with_offsets(text)
    assert len(ids) == len(begins) == len(ends)
    pieces = "".join(text[b:e] for b, e in zip(begins, ends))
    assert pieces == text.replace(" ", "")  # every non-space character, once, in order


@pytest.mark.parametrize("max_len, stride", [(32, 8), (48, 128), (512, 128)])
def test_windows_cover_the_context_and_find_the_answer(tokenizer_model, max_len, stride):
    tok = Tokenizer(tokenizer_model)
    for p in squad_json(20, seed=3)["data"][0]["paragraphs"]:
        context, qa = p["context"], p["qas"][0]
        answer = qa["answers"][0]
        span = (answer["answer_start"], answer["answer_start"] + len(answer["text"]))
        windows = span_windows(tok, qa["question"], context, 0, max_len, stride, answer=span)
        n_ctx = len(tok.encode_with_offsets(context)[0])
        covered = np.concatenate([w.char_begin for w in windows])
        assert set(covered.tolist()) == set(tok.encode_with_offsets(context)[1].tolist())
        assert all(len(w.input_ids) <= max_len for w in windows)
        hits = [w for w in windows if w.start_position > 0]
        assert hits or n_ctx > max_len  # whole answer fits in some window here
        for w in hits:
            i, j = w.start_position - w.context_offset, w.end_position - w.context_offset
            assert context[w.char_begin[i] : w.char_end[j]] == answer["text"]
        # A decoder given one-hot logits at the gold span recovers the original text.
        if hits:
            w = hits[0]
            sl = np.full(len(w.input_ids), -5.0)
            el = np.full(len(w.input_ids), -5.0)
            sl[w.start_position], el[w.end_position] = 5.0, 5.0
            logits = [
                (sl, el) if x is w else (np.zeros(len(x.input_ids)), np.zeros(len(x.input_ids)))
                for x in windows
            ]
            assert (
                best_span(windows, [s for s, _ in logits], [e for _, e in logits], context)
                == answer["text"]
            )


def test_best_span_respects_order_and_length():
    from shatter.train.finetuning.features import SpanWindow

    context = "alpha beta gamma delta"
    begins, ends = np.array([0, 6, 11, 17]), np.array([5, 10, 16, 22])
    w = SpanWindow(0, [CLS, 9, SEP, 11, 12, 13, 14, SEP], 3, begins, ends, 0, 0)
    start = np.array([0, 0, 0, 0, 0, 9.0, 0, 0])  # best start: 'gamma'
    end = np.array([0, 0, 0, 8.0, 0, 0, 1.0, 0])  # best end 'alpha' lies before it
    assert best_span([w], [start], [end], context) == "gamma delta"
    assert best_span([w], [start], [end], context, max_answer_len=1) == "gamma"
