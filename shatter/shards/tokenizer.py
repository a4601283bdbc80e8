"""A dataset's tokenizer as the pipeline, the trainer and the model read it: the special ids
every shard and model share, the text normalisation, and the loaders that check them, of a
sentencepiece model (`load`) and of a Hugging Face `tokenizers` tokenizer.json (`load_json`).
Beam-free and torch-free (sentencepiece; `tokenizers` imported only for a tokenizer.json), so
`shatter/` and `train/` import it without the pipeline's Beam side."""

from __future__ import annotations

import json

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
SPECIAL_PIECES = {
    "[PAD]": PAD_ID,
    "[UNK]": UNK_ID,
    "[CLS]": CLS_ID,
    "[SEP]": SEP_ID,
    "[MASK]": MASK_ID,
}
NORMALIZATION = "nmt_nfkc_cf"  # NFKC and case folding: text is lower-cased
CASED_NORMALIZATION = "nmt_nfkc"  # NFKC alone: a cased model (`--cased`)
TOKENIZER_JSON = "tokenizer.json"  # a Hugging Face tokenizer's file in a dataset and an export
CONTINUES = np.int32(1 << 30)  # an id's flag in the pipeline: its token continues a word
ROLES = {  # the special ids, each with the names its token goes by in public vocabularies
    PAD_ID: ("pad_token", "[PAD]", "<pad>"),
    UNK_ID: ("unk_token", "[UNK]", "<unk>"),
    CLS_ID: ("cls_token", "[CLS]", "<s>", "<cls>"),
    SEP_ID: ("sep_token", "[SEP]", "</s>", "<sep>"),
    MASK_ID: ("mask_token", "[MASK]", "<mask>"),
}


def load(model: bytes) -> spm.SentencePieceProcessor:
    """A processor from serialized model bytes, checked against the special ids."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    for piece, want in SPECIAL_PIECES.items():
        got = sp.piece_to_id(piece)
        if got != want or sp.id_to_piece(want) != piece:
            raise ValueError(
                f"tokenizer has {piece} at id {got}, expected {want} (the format's special ids)"
            )
    return sp


class HFTokenizerError(ValueError):
    """A tokenizer.json that cannot be loaded or used; the message names it and the fix."""


def tokenizers_module():
    """The `tokenizers` package, or one line naming the extra that installs it."""
    try:
        import tokenizers
    except ImportError:
        raise HFTokenizerError(
            "a tokenizer.json needs the `tokenizers` package: pip install 'shatter[pipeline-hf]'"
        ) from None
    return tokenizers


def load_json(data: bytes, name: str = TOKENIZER_JSON):
    """A `tokenizers.Tokenizer` from tokenizer.json bytes, checked for the special ids."""
    tokenizers = tokenizers_module()
    try:
        tokenizer = tokenizers.Tokenizer.from_str(data.decode())
    except Exception as e:
        raise HFTokenizerError(f"{name}: not a `tokenizers` tokenizer.json ({e})") from None
    for want, names in ROLES.items():
        if tokenizer.id_to_token(want) is None:
            raise HFTokenizerError(f"{name}: no token at id {want} ({names[1]})")
    if vocab_size(tokenizer) >= int(CONTINUES):
        raise HFTokenizerError(f"{name}: a vocabulary of 2**30 ids or more is not supported")
    return tokenizer


def file_vocab_size(data: bytes, name: str) -> int:
    """Rows the model's embedding needs for the tokenizer file `name` of bytes `data`: a
    sentencepiece model's pieces, or one past a tokenizer.json's largest id (read as JSON, so a
    trainer checks it without the `tokenizers` package)."""
    if not name.endswith(".json"):
        try:
            return spm.SentencePieceProcessor(model_proto=data).get_piece_size()
        except RuntimeError:
            raise ValueError(f"{name}: not a sentencepiece model") from None
    try:
        raw = json.loads(data)
        vocab = raw["model"]["vocab"]  # {token: id} (WordPiece, BPE) or [[piece, score]] (Unigram)
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(t["id"]) for t in raw.get("added_tokens") or ()]
        return max(ids) + 1
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HFTokenizerError(f"{name}: not a `tokenizers` tokenizer.json ({e})") from None


def vocab_size(tokenizer) -> int:
    """Rows the model's embedding needs: one past the largest id (ids may leave gaps)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def special_tokens(tokenizer) -> dict[str, str]:
    """The token of each role ({"pad_token": "[PAD]", ...}), for transformers' config."""
    return {names[0]: tokenizer.id_to_token(i) for i, names in ROLES.items()}
