"""The export's tokenizer as a Hugging Face fast tokenizer (`tokenizer.json`): a dataset's own
tokenizer.json (`shatter-data build --hf-tokenizer`) as it is, or the sentencepiece model converted.

The converted tokenizer's model (Unigram over the same pieces and scores, or BPE over the same
pieces with every split of a piece into two as a merge, in sentencepiece's score order) comes
from transformers' converter (`SpmConverter`, which parses the model with sentencepiece's bundled
`sentencepiece_model_pb2`) where that module loads: it needs protobuf >= 7, which an install
without apache-beam can have. Where apache-beam pins protobuf < 7 (the toolkit's dev environment)
the module does not load, and the same model is built from `sentencepiece.SentencePieceProcessor`
(no protobuf), the model's fields read off its protobuf wire format by `normalizer_spec`.
`build_tokenizer` says which path ran; both write the same tokenizer.json.

On either model the toolkit sets the rest: the precompiled normalizer (NFKC, plus case folding
for `nmt_nfkc_cf`) and sentencepiece's whitespace handling as the model's own flags set it
(strip, collapse runs of spaces, escape to '▁', a dummy prefix; the converter's normalizer
assumes the default flags), the decoder, and the toolkit's conventions (the format's special
ids [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4): `[CLS] a [SEP]` and `[CLS] a [SEP] b [SEP]`, as
pretraining rows and finetuning features are built. The control pieces ([PAD], [CLS], [SEP],
[MASK]) are special added tokens, as the converter makes them: spelt in a text ("[MASK]" in a
fill-mask input), each is its token, where sentencepiece encodes the characters. There are no
token type ids (no arch has segment embeddings).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from shatter.shards.tokenizer import (
    NORMALIZATION,
    HFTokenizerError,
    load as load_sentencepiece,
    load_json as load_hf_tokenizer,
    special_tokens,
)

log = logging.getLogger(__name__)

SPIECE_UNDERLINE = "\u2581"
# which path built a converted tokenizer's model (`build_tokenizer`)
CONVERTER = "transformers' SpmConverter"
BY_HAND = "sentencepiece's processor (no protobuf parse)"
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
    (sentencepiece's BPE merges the best-scoring pair first), the splits of one piece in
    transformers' order (shorter left part first): the converter's tokenizer.json exactly."""
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
                ranked.append((-sp.get_score(i), i, cut, left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = sp.id_to_piece(sp.unk_id())
    return BPEModel(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback)


def proto_module():
    """sentencepiece's bundled `sentencepiece_model_pb2`, or None where it cannot load: no
    protobuf, or a runtime older than the module's generated code (protobuf < 7, as apache-beam
    pins it), which the import itself reports as protobuf's VersionError."""
    try:
        from google.protobuf.runtime_version import VersionError
    except ImportError:
        return None
    try:
        from sentencepiece import sentencepiece_model_pb2
    except (ImportError, VersionError):
        return None
    return sentencepiece_model_pb2


def _parsed(pb2, data: bytes):
    """The ModelProto of serialized model bytes; ValueError where they are not one."""
    from google.protobuf.message import DecodeError

    proto = pb2.ModelProto()
    try:
        proto.ParseFromString(data)
    except DecodeError as e:
        raise ValueError(f"not a sentencepiece ModelProto: {e}") from None
    return proto


def _proto_spec(proto) -> dict:
    """`normalizer_spec`'s fields, from a parsed ModelProto."""
    norm = proto.normalizer_spec
    return {
        "model_type": proto.trainer_spec.model_type,
        "name": norm.name,
        "precompiled_charsmap": norm.precompiled_charsmap,
        "add_dummy_prefix": norm.add_dummy_prefix,
        "remove_extra_whitespaces": norm.remove_extra_whitespaces,
        "escape_whitespaces": norm.escape_whitespaces,
    }


def _converted(path: Path, proto):
    """The `tokenizers` model over the pieces (and the control pieces as special added tokens)
    by transformers' converter, which parses the model with sentencepiece's protobuf module."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE as BPEModel
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    converter = SpmConverter(SimpleNamespace(vocab_file=str(path)))
    if proto.trainer_spec.model_type == UNIGRAM:
        converter.handle_byte_fallback = proto.trainer_spec.byte_fallback
        return converter.tokenizer(converter.proto)
    # SpmConverter.tokenizer's own BPE branch hands the piece scores to the extractor where it
    # takes a model class (an AttributeError in transformers 5.17 to 5.24); the extractor gives
    # the vocabulary and the merges (every split of a piece into two, ranked by piece id, which
    # is sentencepiece's BPE score order) and the control pieces
    parts = SentencePieceExtractor(str(path)).extract(None)
    tokenizer = Tokenizer(
        BPEModel(
            parts["vocab"],
            parts["merges"],
            unk_token=proto.trainer_spec.unk_piece,
            fuse_unk=True,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    tokenizer.add_tokens(parts["additional_special_tokens"])
    return tokenizer


def _by_hand(sp, model_type: int):
    """`_converted` without protobuf: the model from the processor, the same added tokens."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer(_model(sp, model_type))
    control = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)]
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=True) for p in control])
    return tokenizer


def _conventions(tokenizer, spec: dict, sp) -> None:
    """sentencepiece's normalization and whitespace handling as the model's spec sets them, the
    toolkit's [CLS]/[SEP] template and the decoder, on a tokenizer over the model's pieces."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

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


def build_tokenizer(path: Path):
    """(`tokenizers.Tokenizer` encoding like the sentencepiece model at `path` plus our
    [CLS]/[SEP] template, the path that built its model: CONVERTER or BY_HAND)."""
    data = path.read_bytes()
    pb2 = proto_module()
    try:
        sp = load_sentencepiece(data)
        proto = None if pb2 is None else _parsed(pb2, data)
        spec = normalizer_spec(data) if proto is None else _proto_spec(proto)
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
    if proto is None:
        tokenizer, how = _by_hand(sp, spec["model_type"]), BY_HAND
    else:
        tokenizer, how = _converted(path, proto), CONVERTER
    _conventions(tokenizer, spec, sp)
    log.debug("%s: tokenizer.json's model built by %s", path, how)
    return tokenizer, how


def hf_tokenizer(path: Path):
    """(`tokenizers.Tokenizer`, its special tokens by role) of an export's tokenizer file: the
    sentencepiece model converted (`build_tokenizer`), or a dataset's own tokenizer.json (from
    `shatter-data build --hf-tokenizer`: the toolkit's special ids and template already)."""
    if path.suffix != ".json":
        return build_tokenizer(path)[0], SPECIAL_TOKENS
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
