"""The export's tokenizer as a Hugging Face fast tokenizer (`tokenizer.json`): a dataset's own
tokenizer.json (`shatter-data build --hf-tokenizer`) as it is, or the sentencepiece model converted.

transformers' own converter (`SpmConverter`) parses the model with sentencepiece's bundled
`sentencepiece_model_pb2`, which needs protobuf >= 7, while apache-beam pins protobuf < 7: in
the toolkit's one environment that parse fails. So the pieces, scores and ids come from
`sentencepiece.SentencePieceProcessor` (no protobuf), and the few normalizer fields the
`tokenizers` pipeline needs (the precompiled NFKC + case-folding charsmap of `nmt_nfkc_cf`, and
the whitespace flags) are read off the model's protobuf wire format by `normalizer_spec`.

The tokenizer mirrors sentencepiece's encoding: Unigram over the same pieces and scores, the
precompiled normalizer, sentencepiece's whitespace handling (strip, collapse runs of spaces,
escape to '▁', a dummy prefix), then the toolkit's conventions (the format's special ids
[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4): `[CLS] a [SEP]` and `[CLS] a [SEP] b [SEP]`, as
pretraining rows and finetuning features are built. There are no token type ids (no arch has
segment embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path

from shatter.pipeline.format.tokenizer import (
    NORMALIZATION,
    HFTokenizerError,
    load as load_sentencepiece,
    load_json as load_hf_tokenizer,
    special_tokens,
)

SPIECE_UNDERLINE = "\u2581"
UNIGRAM, BPE = 1, 2  # sentencepiece TrainerSpec.ModelType
SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}


class TokenizerError(ValueError):
    """A tokenizer file that cannot be converted; the message names it and the fix."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes) -> dict[int, object]:
    """The last value of each field number of one protobuf message (varints and bytes)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            value, i = None, i + (8 if wire == 1 else 4)
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out[key >> 3] = value
    return out


def normalizer_spec(model: bytes) -> dict:
    """The sentencepiece ModelProto fields the conversion needs (sentencepiece_model.proto:
    ModelProto.trainer_spec = 2 {model_type = 3}, ModelProto.normalizer_spec = 3 {name = 1,
    precompiled_charsmap = 2, add_dummy_prefix = 3, remove_extra_whitespaces = 4,
    escape_whitespaces = 5}; the three flags default to true)."""
    proto = _fields(model)
    trainer, spec = _fields(proto.get(2, b"")), _fields(proto.get(3, b""))
    return {
        "model_type": trainer.get(3, UNIGRAM),
        "name": bytes(spec.get(1, b"")).decode(errors="replace"),  # "nmt_nfkc_cf", "nmt_nfkc", ...
        "precompiled_charsmap": spec.get(2, b""),
        "add_dummy_prefix": bool(spec.get(3, 1)),
        "remove_extra_whitespaces": bool(spec.get(4, 1)),
        "escape_whitespaces": bool(spec.get(5, 1)),
    }


def _model(sp, model_type: int):
    """The `tokenizers` model of the processor's pieces: Unigram over the same scores, or BPE
    whose merges are every split of a piece into two pieces, ranked by the merged piece's score
    (sentencepiece's BPE merges the best-scoring pair first; transformers' SpmConverter alike)."""
    from tokenizers.models import BPE as BPEModel, Unigram

    size = sp.get_piece_size()
    byte_fallback = any(sp.is_byte(i) for i in range(size))
    if model_type == UNIGRAM:
        vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(size)]
        return Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=byte_fallback)
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    ranked = []
    for i in range(size):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        piece = sp.id_to_piece(i)
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-sp.get_score(i), i, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = sp.id_to_piece(sp.unk_id())
    return BPEModel(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback)


def build_tokenizer(path: Path):
    """A `tokenizers.Tokenizer` encoding like the sentencepiece model at `path`, plus our
    [CLS]/[SEP] template."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors

    data = path.read_bytes()
    try:
        sp = load_sentencepiece(data)
        spec = normalizer_spec(data)
    except (RuntimeError, ValueError, OSError) as e:
        raise TokenizerError(
            f"{path} is not a sentencepiece model with the toolkit's special ids ({e}); "
            "export a model trained with `shatter-data build`, whose tokenizer.model is one"
        ) from None
    if spec["model_type"] not in (UNIGRAM, BPE):
        raise TokenizerError(
            f"{path} is a sentencepiece model of type {spec['model_type']} (not unigram, 1, or "
            "bpe, 2); only unigram and bpe models (shatter-data's) convert to tokenizer.json"
        )
    tokenizer = Tokenizer(_model(sp, spec["model_type"]))
    steps = []  # sentencepiece's order: charsmap, whitespace, escape, dummy prefix
    if spec["precompiled_charsmap"]:
        steps.append(normalizers.Precompiled(spec["precompiled_charsmap"]))
    if spec["remove_extra_whitespaces"]:
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if spec["escape_whitespaces"]:
        steps.append(normalizers.Replace(" ", SPIECE_UNDERLINE))
    if spec["add_dummy_prefix"]:
        # Metaspace skips its prefix when the text already starts with '▁'; sentencepiece doesn't
        steps.append(normalizers.Replace(Regex(rf"\A{SPIECE_UNDERLINE}"), SPIECE_UNDERLINE * 2))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_UNDERLINE, prepend_scheme="always", split=False
        )
    tokenizer.normalizer = normalizers.Sequence(steps)
    cls, sep = "[CLS]", "[SEP]"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:0 {sep}:0",
        special_tokens=[(cls, sp.piece_to_id(cls)), (sep, sp.piece_to_id(sep))],
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def hf_tokenizer(path: Path):
    """(`tokenizers.Tokenizer`, its special tokens by role) of an export's tokenizer file: the
    sentencepiece model converted (`build_tokenizer`), or a dataset's own tokenizer.json (from
    `shatter-data build --hf-tokenizer`: the toolkit's special ids and template already)."""
    if path.suffix != ".json":
        return build_tokenizer(path), SPECIAL_TOKENS
    try:
        tokenizer = load_hf_tokenizer(path.read_bytes(), str(path))
    except HFTokenizerError as e:
        raise TokenizerError(
            f"{e}; export a model trained on a dataset built with `shatter-data build "
            "--hf-tokenizer`, whose tokenizer.json is one"
        ) from None
    return tokenizer, special_tokens(tokenizer)


def save_tokenizer(path: Path, output: Path, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json and the special tokens into `output`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer, specials = hf_tokenizer(path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **specials,
        model_max_length=max_len,
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(str(output))


def describe(path: Path) -> str:
    """The tokenizer's kind for the model card: "sentencepiece unigram, lower-cased", ..."""
    if path.suffix == ".json":
        return f"{json.loads(path.read_text())['model']['type']}, Hugging Face tokenizers"
    spec = normalizer_spec(path.read_bytes())
    kinds = {UNIGRAM: "unigram", BPE: "bpe", 3: "word", 4: "char"}
    folded = spec["name"] == NORMALIZATION
    return f"sentencepiece {kinds.get(spec['model_type'], '?')}, " + (
        "lower-cased" if folded else "cased"
    )
