"""A Hugging Face `tokenizers` tokenizer (WordPiece, BPE, Unigram, ...) as the dataset's tokenizer.

`prepare` loads one (a `tokenizer.json`, a directory holding one, or a Hub name) and renumbers
its vocabulary so that the special tokens sit at the toolkit's ids, [PAD]=0 [UNK]=1 [CLS]=2
[SEP]=3 [MASK]=4: each role's token trades places with the token at its id, and every id in
the tokenizer (its model's vocabulary, its added tokens) follows. A role the tokenizer lacks
(byte-level BPE has no [UNK], GPT-2 no [PAD]) gets a new special token of that name. The result
is written as the dataset's `tokenizer.json`, with the `[CLS] a [SEP]` / `[CLS] a [SEP] b [SEP]`
template the rows and finetuning features are built with, so that `AutoTokenizer` on an export
gives the ids the model was trained on.

`Encoder` encodes batches of documents in the Beam workers. Each id carries a flag, `CONTINUES`,
set where its token continues the word before it (`word_start` false): a new word begins where
the tokenizer's pre-tokenizer starts one (its word ids) or where whitespace in the text precedes
the token (its offsets), so whole-word masking works for any pre-tokenizer, also one that keeps
the text whole (sentencepiece's Metaspace without splitting). The shard writer strips the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shatter.shards.tokenizer import (  # noqa: F401  (TOKENIZER_JSON, HFTokenizerError: the pipeline's names)
    CLS_ID,
    CONTINUES,
    ROLES,
    SEP_ID,
    TOKENIZER_JSON,
    HFTokenizerError,
    load_json as load,
    tokenizers_module as _tokenizers,
    vocab_size,
)

# every whitespace code point below U+3001 (str.isspace), for the word starts by offsets
_SPACES = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)


def _load(name: str):
    """(Tokenizer, tokenizer_config.json's content or {}) from a file, a directory or the Hub."""
    tokenizers = _tokenizers()
    path = Path(name)
    if path.is_dir():
        path, config = path / TOKENIZER_JSON, path / "tokenizer_config.json"
        if not path.is_file():
            raise HFTokenizerError(
                f"{name} has no {TOKENIZER_JSON}: save the tokenizer with `tokenizer.save(...)` "
                "(tokenizers) or `save_pretrained` (transformers' fast tokenizers)"
            )
        roles = json.loads(config.read_text()) if config.is_file() else {}
    elif path.is_file():
        roles = {}
    elif path.suffix == ".json" or path.is_absolute() or name.startswith("."):
        raise HFTokenizerError(f"--hf-tokenizer {name}: no such file or directory")
    else:
        try:
            return tokenizers.Tokenizer.from_pretrained(name), _hub_config(name)
        except Exception as e:  # offline, unknown name, no tokenizer.json on the Hub
            raise HFTokenizerError(
                f"--hf-tokenizer {name}: cannot fetch it from the Hugging Face Hub ({type(e).__name__}:"
                f" {str(e).splitlines()[0] if str(e) else ''}); connect to the Hub or pass a local "
                "directory with its tokenizer.json"
            ) from None
    try:
        return tokenizers.Tokenizer.from_file(str(path)), roles
    except Exception as e:
        raise HFTokenizerError(
            f"{path}: not a `tokenizers` tokenizer.json ({str(e).splitlines()[0]}); pass the "
            "tokenizer.json a fast tokenizer saves"
        ) from None


def _hub_config(name: str) -> dict:
    """tokenizer_config.json of a Hub repository (the special tokens' names), or {}."""
    try:
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(name, "tokenizer_config.json")).read_text())
    except Exception:  # a repository without one: the names in ROLES decide
        return {}


def _role_token(vocab: dict, config: dict, names: tuple) -> str | None:
    """The token of one role: tokenizer_config.json's, else the first common name in `vocab`."""
    named = config.get(names[0])
    if isinstance(named, dict):  # an AddedToken serialized by transformers
        named = named.get("content")
    for token in (named, *names[1:]):
        if token is not None and token in vocab:
            return token
    return None


def _renumbering(tokenizer, config: dict) -> tuple[np.ndarray, list[str]]:
    """(new id of each old id, the five special tokens by new id), adding missing roles."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = []
    for names in ROLES.values():
        token = _role_token(vocab, config, names)
        if token is None:
            token = names[1]
            tokenizer.add_special_tokens([token])
            vocab = tokenizer.get_vocab(with_added_tokens=True)
        tokens.append(token)
    if len(set(tokens)) < len(tokens):
        raise HFTokenizerError(
            f"the tokenizer uses one token for two special roles ({tokens}); [PAD], [UNK], [CLS], "
            "[SEP] and [MASK] need five different tokens"
        )
    size = max(vocab.values()) + 1
    order = np.arange(size)  # order[new id] = old id
    where = np.arange(size)  # where[old id] = new id
    for target, token in enumerate(tokens):
        old = vocab[token]
        displaced = order[target]
        order[target], order[where[old]] = old, displaced
        where[displaced], where[old] = where[old], target
    return where, tokens


def _renumber_json(data: dict, where: np.ndarray, tokens: list[str]) -> dict:
    """The tokenizer.json content with every id mapped through `where` and the toolkit's
    template as its post-processor (no padding or truncation: the loader and features do both)."""
    model = data["model"]
    if isinstance(model.get("vocab"), dict):  # WordPiece, WordLevel, BPE (merges are by token)
        model["vocab"] = {t: int(where[i]) for t, i in model["vocab"].items()}
        # tokens only added (RoBERTa's <mask>) join the vocabulary at their new ids: an added
        # token outside it gets the next free id when loaded, whatever id it was saved with
        for added in data.get("added_tokens", []):
            model["vocab"].setdefault(added["content"], int(where[added["id"]]))
    elif isinstance(model.get("vocab"), list):  # Unigram: [piece, score] in id order
        pieces = model["vocab"]
        renumbered = [None] * len(pieces)
        for i, piece in enumerate(pieces):
            if where[i] >= len(pieces):
                raise HFTokenizerError(
                    f"special token {tokens} outside the Unigram vocabulary: add it to the "
                    "model's pieces before using the tokenizer"
                )
            renumbered[where[i]] = piece
        model["vocab"] = renumbered
        if model.get("unk_id") is not None:
            model["unk_id"] = int(where[model["unk_id"]])
    else:
        raise HFTokenizerError(f"tokenizer model {model.get('type')!r} has no vocabulary to map")
    for added in data.get("added_tokens", []):
        added["id"] = int(where[added["id"]])
    data["added_tokens"].sort(key=lambda added: added["id"])
    cls, sep = tokens[CLS_ID], tokens[SEP_ID]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [_special(cls), _seq("A"), _special(sep)],
        "pair": [_special(cls), _seq("A"), _special(sep), _seq("B"), _special(sep)],
        "special_tokens": {
            t: {"id": t, "ids": [i], "tokens": [t]} for t, i in ((cls, CLS_ID), (sep, SEP_ID))
        },
    }
    data["padding"] = data["truncation"] = None
    return data


def _special(token: str) -> dict:
    return {"SpecialToken": {"id": token, "type_id": 0}}


def _seq(which: str) -> dict:
    return {"Sequence": {"id": which, "type_id": 0}}


def prepare(name: str) -> bytes:
    """The tokenizer `name` (tokenizer.json, its directory, or a Hub name) renumbered to the
    toolkit's special ids, as the dataset's tokenizer.json bytes."""
    tokenizer, config = _load(name)
    where, tokens = _renumbering(tokenizer, config)
    data = _renumber_json(json.loads(tokenizer.to_str()), where, tokens)
    text = json.dumps(data, ensure_ascii=False, indent=2, sort_keys=True).encode()
    load(text, name)  # the result loads and has the special ids where they belong
    return text


class Encoder:
    """Batch encoding of documents to flagged id arrays (`CONTINUES`), without special tokens;
    literal special tokens in the text ("[MASK]") are encoded as text, as sentencepiece does."""

    def __init__(self, data: bytes):
        self.tokenizer = load(data)
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = vocab_size(self.tokenizer)

    def word_start_table(self) -> None:
        """None: the word starts are flags on the ids (`word_starts`), not a table by id."""
        return None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [_flagged(text, e) for text, e in zip(texts, encodings)]


def _flagged(text: str, encoding) -> np.ndarray:
    """One document's ids, with `CONTINUES` on each token that does not begin a word."""
    ids = np.asarray(encoding.ids, dtype=np.int32)
    if not len(ids):
        return ids
    words = np.array([-1 if w is None else w for w in encoding.word_ids], dtype=np.int64)
    starts = np.asarray(encoding.offsets, dtype=np.int64)[:, 0]
    # the text's whitespace-separated word of each character; a token belongs to the word of
    # its first non-space character (a lone '▁' or 'Ġ' to the word after it)
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    space = np.append(np.isin(chars, _SPACES), False)
    begins = ~space & np.concatenate([[True], space[:-1]])
    word_of_char = np.cumsum(begins)
    word_of_char[-1] = word_of_char[-2] + 1 if len(chars) else 1  # past the end: a word of its own
    next_content = np.minimum.accumulate(
        np.where(space, len(chars), np.arange(len(chars) + 1))[::-1]
    )[::-1]
    text_words = word_of_char[next_content[np.clip(starts, 0, len(chars))]]
    begin = np.ones(len(ids), dtype=bool)
    begin[1:] = (words[1:] != words[:-1]) | (text_words[1:] != text_words[:-1])
    return np.where(begin, ids, ids | CONTINUES)


def word_starts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids without the flag, word_start) of flagged ids of any shape."""
    return ids & ~CONTINUES, (ids & CONTINUES) == 0
