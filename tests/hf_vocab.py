"""Hugging Face `tokenizers` tokenizers trained in the test itself (offline), saved as the
tokenizer.json a user would pass to `shatter-data build --hf-tokenizer`."""

from __future__ import annotations

from pathlib import Path


def wordpiece(texts: list[str], path: Path, vocab_size: int = 300) -> Path:
    """bert-base-uncased's kind: BERT normalizer (lower-cased), BERT pre-tokenizer, "##"
    continuations, its special tokens away from the toolkit's ids ([UNK] at 3, [CLS] at 4, ...)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    )
    tokenizer.save(str(path))
    return path


def byte_level_bpe(texts: list[str], path: Path, specials: list[str], vocab_size: int = 400):
    """RoBERTa's / GPT-2's kind: byte-level BPE (cased), with the given special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path
