"""From examples to model inputs, and from span logits back to answers.

- Sequence (pair) classification: `[CLS] a [SEP] b [SEP]`, truncated longest-first to max_len,
  as BERT (Devlin et al., 2019) and the paper (§3.4) feed classifiers.
- SQuAD: `[CLS] question [SEP] context-window [SEP]`; a context longer than the window is covered
  by windows whose starts are `doc_stride` tokens apart (BERT's `run_squad.py`). The gold
  character span becomes a token span through the tokenizer's offsets (sentencepiece's
  `encode_as_proto`: UTF-8 byte begin/end of each piece, mapped to characters); a window that
  does not contain the whole answer points both ends at `[CLS]`. At prediction time the best
  span over all windows wins (start logit + end logit, start <= end, at most max_answer_len
  tokens, both ends inside the context), and the answer is the context's original characters.

The tokenizer is the export's own, with the project's special ids ([PAD]=0 [UNK]=1 [CLS]=2
[SEP]=3 [MASK]=4): its sentencepiece model (on lower-cased text unless the model is cased) or
its Hugging Face tokenizer.json (WordPiece, BPE, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shatter.checkpoint import CheckpointError
from shatter.hf.tokenizer import normalizer_spec
from shatter.shards.tokenizer import (
    CLS_ID as CLS,  # noqa: F401
    NORMALIZATION,
    PAD_ID as PAD,
    SEP_ID as SEP,
    load as load_sentencepiece,
    load_json as load_hf_tokenizer,
    vocab_size as hf_vocab_size,
)


def _lower_same_length(text: str) -> str:
    """Lower-case without changing the length (e.g. 'İ' -> 'i̇' would), so offsets stay valid."""
    out = text.lower()
    if len(out) == len(text):
        return out
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


def Tokenizer(path: str | Path):
    """The export's tokenizer, whatever its kind: a Hugging Face tokenizer.json
    (`HFTokenizer`) or a sentencepiece model (`SentencePieceTokenizer`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer model not found")
    return HFTokenizer(path) if path.suffix == ".json" else SentencePieceTokenizer(path)


class HFTokenizer:
    """The export's tokenizer.json (`shatter-data build --hf-tokenizer`), checked for the special
    ids by the format's loader (`shatter.shards.tokenizer.load_json`); its own normalizer decides case."""

    def __init__(self, path: Path):
        try:
            self.tokenizer = load_hf_tokenizer(path.read_bytes(), str(path))
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        self.tokenizer.encode_special_tokens = True  # "[SEP]" in a text is text, as in pretraining
        self.vocab_size = hf_vocab_size(self.tokenizer)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Ids and each token's [begin, end) character span in `text` (whitespace trimmed)."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        begins, ends = [], []
        for begin, end in encoding.offsets:
            while begin < end and text[begin].isspace():  # "Ġword" spans its leading space
                begin += 1
            begins.append(begin)
            ends.append(end)
        return encoding.ids, np.asarray(begins, dtype=np.int64), np.asarray(ends, dtype=np.int64)


class SentencePieceTokenizer:
    """The export's sentencepiece model, loaded and checked for the special ids by the pipeline's
    own loader (`shatter.shards.tokenizer.load`). Text is lower-cased first for a case-folding model
    (the pipeline's default) so that offsets stay those of the text; a cased one sees it as is."""

    def __init__(self, path: Path):
        data = path.read_bytes()
        try:
            self.sp = load_sentencepiece(data)
        except (RuntimeError, ValueError) as err:  # not a sentencepiece model, or other special ids
            raise CheckpointError(f"{path}: {err}") from None
        self.vocab_size = self.sp.get_piece_size()
        folds = normalizer_spec(data)["name"] == NORMALIZATION
        self.lower = _lower_same_length if folds else str

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode([self.lower(t) for t in texts])

    def encode_with_offsets(self, text: str) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Ids and each piece's [begin, end) character span in `text` (whitespace trimmed)."""
        lowered = self.lower(text)
        proto = self.sp.encode_as_proto(lowered)
        # sentencepiece reports UTF-8 byte offsets; map them to character offsets.
        widths = [len(c.encode("utf-8")) for c in lowered]
        char_at = np.repeat(np.arange(len(lowered)), widths)
        char_at = np.append(char_at, len(lowered))  # the end offset of the last byte
        ids, begins, ends = [], [], []
        for piece in proto.pieces:
            begin, end = int(char_at[piece.begin]), int(char_at[piece.end])
            while begin < end and text[begin].isspace():  # "▁word" spans its leading space
                begin += 1
            ids.append(piece.id)
            begins.append(begin)
            ends.append(end)
        return ids, np.asarray(begins, dtype=np.int64), np.asarray(ends, dtype=np.int64)


def encode_pair(ids_a: list[int], ids_b: list[int], max_len: int) -> list[int]:
    """`[CLS] a [SEP] (b [SEP])`, truncating the longer side first until it fits max_len."""
    budget = max_len - (3 if ids_b else 2)
    if budget < 2:
        raise ValueError(f"max_len {max_len} leaves no room for text")
    la, lb = len(ids_a), len(ids_b)
    while la + lb > budget:
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    out = [CLS, *ids_a[:la], SEP]
    if ids_b:
        out += [*ids_b[:lb], SEP]
    return out


def pad_batch(sequences: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Right-padded `input_ids` with [PAD] and the `attention_mask` (1 token, 0 padding)."""
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), PAD, dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


@dataclass(frozen=True)
class SpanWindow:
    """One SQuAD window: its inputs, where its context tokens sit, and the gold token span."""

    example: int  # index of the example it belongs to
    input_ids: list[int]
    context_offset: int  # position of the window's first context token in input_ids
    char_begin: np.ndarray  # [n_context] first character of each context token
    char_end: np.ndarray  # [n_context] one past its last character
    start_position: int  # gold start token in input_ids, 0 ([CLS]) when not inside
    end_position: int  # gold end token in input_ids, 0 ([CLS]) when not inside


def span_windows(
    tokenizer: Tokenizer,
    question: str,
    context: str,
    example: int,
    max_len: int,
    doc_stride: int = 128,
    max_query_len: int = 64,
    answer: tuple[int, int] | None = None,
) -> list[SpanWindow]:
    """Cover the context with windows; `answer` is the gold [start, end) character span."""
    q_ids = tokenizer.encode([question])[0][:max_query_len]
    c_ids, begins, ends = tokenizer.encode_with_offsets(context)
    window = max_len - len(q_ids) - 3
    if window < 1:
        raise ValueError(f"max_len {max_len} leaves no room for the context")
    step = max(1, min(doc_stride, window))
    gold = None
    if answer is not None and len(c_ids):
        s, e = answer
        inside = np.nonzero((ends > s) & (begins < e))[0]
        if len(inside):
            gold = (int(inside[0]), int(inside[-1]))
    windows, start = [], 0
    while True:
        stop = min(start + window, len(c_ids))
        offset = len(q_ids) + 2
        ids = [CLS, *q_ids, SEP, *c_ids[start:stop], SEP]
        sp = ep = 0
        if gold is not None and start <= gold[0] and gold[1] < stop:
            sp, ep = gold[0] - start + offset, gold[1] - start + offset
        windows.append(
            SpanWindow(example, ids, offset, begins[start:stop], ends[start:stop], sp, ep)
        )
        if stop >= len(c_ids):
            return windows
        start += step


def best_span(
    windows: Sequence[SpanWindow],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    context: str,
    max_answer_len: int = 30,
    n_best: int = 20,
) -> str:
    """The highest-scoring valid span over one example's windows, as original context text."""
    best_score, best = -np.inf, ""
    for w, sl, el in zip(windows, start_logits, end_logits, strict=True):
        n = len(w.char_begin)
        if n == 0:
            continue
        s_ctx = np.asarray(sl[w.context_offset : w.context_offset + n])
        e_ctx = np.asarray(el[w.context_offset : w.context_offset + n])
        for i in np.argsort(-s_ctx)[:n_best]:
            for j in np.argsort(-e_ctx)[:n_best]:
                if j < i or j - i + 1 > max_answer_len:
                    continue
                score = s_ctx[i] + e_ctx[j]
                if score > best_score:
                    best_score, best = score, context[w.char_begin[i] : w.char_end[j]]
    return best.strip()
