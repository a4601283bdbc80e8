"""The export's tokenizer.json is built by transformers' SpmConverter where sentencepiece's
protobuf module loads (protobuf >= 7), else from sentencepiece's processor: both paths give the
same encodings, sentencepiece's own, on varied text, for unigram and bpe models trained by the
pipeline's trainer.

This environment's protobuf is older (apache-beam pins it below 7), so the converter path runs in
a subprocess whose PYTHONPATH puts a protobuf 7 wheel (from the package registry, once per
session) first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from shatter.hf.tokenizer import BY_HAND, CONVERTER, build_tokenizer, proto_module  # noqa: E402
from tests.pipeline.corpus import generated_documents  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# what the training text lacks (the unknown piece) and what sentencepiece's whitespace and
# normalization rules touch
VARIED = [
    "",
    " ",
    "   ",
    "Hello  World, çà  va? 123 ka-lo!",
    " KALO mine",
    "  leading and trailing  ",
    "trailing tab\t",
    "a\tb\nc  \n d",
    "ÉCOLE Ünïcödé naïve café Straße",
    "e\u0301 vs \u00e9",
    "東京大学で 日本語を勉強する。",
    "全角\u3000スペース ＡＢＣ１２３",
    "½ ² ℃ Ⅻ ﬁ",
    "3.14159, 2,718 and 1e-10; 100% (or 99.9%)...",
    "!!!???---___***",
    "\u2581leading escape x \u2581 y",
    "emoji 🙂🚀 and ☃",
    "MiXeD CaSe WoRdS",
]
SPECIALS = "[CLS] a [SEP] [MASK] [PAD] x[MASK]y"
PAIRS = [("Hello  World", " KALO mine "), ("", "東京"), ("3.14!", "")]
MODELS = [("unigram", False), ("bpe", False), ("unigram", True)]  # (model type, cased)


def training_lines() -> list[str]:
    lines = [x for d in generated_documents(300, seed=21) for x in d.split("\n")]
    extra = ["Café naïve École Über 東京 大学 日本語 123 4567 89.5%, ka-lo!", "HELLO World"]
    return lines + extra * 20


def encodings(model: Path, texts: list[str], pairs: list) -> dict:
    """What `build_tokenizer` gives for `model`: which path built it (and the protobuf it ran
    with), ids, tokens and offsets of every text and pair, and its JSON."""
    from google.protobuf import __version__ as protobuf

    tokenizer, how = build_tokenizer(model)
    singles = tokenizer.encode_batch(texts)
    both = tokenizer.encode_batch([list(p) for p in pairs])
    return {
        "how": how,
        "protobuf": protobuf,
        "ids": [e.ids for e in singles],
        "tokens": [e.tokens for e in singles],
        "offsets": [[list(o) for o in e.offsets] for e in singles],
        "pair_ids": [e.ids for e in both],
        "pair_offsets": [[list(o) for o in e.offsets] for e in both],
        "json": tokenizer.to_str(),
    }


@pytest.fixture(scope="session")
def protobuf7(tmp_path_factory) -> Path:
    """A directory holding protobuf >= 7, from the package registry (pip, once per session)."""
    root = tmp_path_factory.mktemp("protobuf7")
    wheels, target = root / "wheels", root / "site"
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run(
        [*download, "protobuf>=7,<8", "-d", str(wheels)], capture_output=True, text=True
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.fail(
            f"pip download 'protobuf>=7,<8' failed (is the package registry reachable?): {last}"
        )
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target)]
    done = subprocess.run(
        [*install, *map(str, wheels.glob("*.whl"))], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return target


@pytest.fixture(scope="module", params=MODELS, ids=["unigram", "bpe", "unigram-cased"])
def model(request, tmp_path_factory) -> Path:
    from shatter.pipeline.tokenizer import train

    model_type, cased = request.param
    path = tmp_path_factory.mktemp(model_type) / "tokenizer.model"
    path.write_bytes(train(training_lines(), 600, model_type, cased=cased))
    return path


def converted_in_subprocess(model: Path, protobuf7: Path, texts, pairs) -> dict:
    env = dict(os.environ)
    paths = [str(protobuf7), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    code = (
        "import json, sys; from pathlib import Path\n"
        "from tests.export.test_tokenizer_converter import encodings\n"
        "args = json.load(sys.stdin)\n"
        "print(json.dumps(encodings(Path(args['model']), args['texts'], args['pairs'])))\n"
    )
    args = json.dumps({"model": str(model), "texts": texts, "pairs": pairs})
    done = subprocess.run(
        [sys.executable, "-c", code], input=args, capture_output=True, text=True, cwd=REPO, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_converter_and_the_fallback_encode_alike_and_as_sentencepiece(model, protobuf7):
    import sentencepiece as spm

    if proto_module() is not None:
        pytest.skip("this environment's protobuf loads sentencepiece's module: no fallback here")
    texts = VARIED + training_lines()[:200:4] + [SPECIALS]
    pairs = [list(p) for p in PAIRS]
    by_hand = encodings(model, texts, pairs)
    converted = converted_in_subprocess(model, protobuf7, texts, pairs)
    assert by_hand["how"] == BY_HAND and int(by_hand["protobuf"].split(".")[0]) < 7
    assert converted["how"] == CONVERTER and int(converted["protobuf"].split(".")[0]) >= 7
    for key in ("ids", "tokens", "offsets", "pair_ids", "pair_offsets"):
        assert converted[key] == by_hand[key], key
    # the ground truth: sentencepiece's own ids, in our template
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert by_hand["ids"][:-1] == [[2, *sp.encode(t), 3] for t in texts[:-1]]
    assert by_hand["pair_ids"] == [[2, *sp.encode(a), 3, *sp.encode(b), 3] for a, b in pairs]
    assert sp.unk_id() in {i for ids in by_hand["ids"] for i in ids}  # the sample reaches [UNK]
    # unlike sentencepiece, a special token spelt in the text is that token (as transformers'
    # tokenizers do: "[MASK]" in a fill-mask input is the mask)
    control = {"[PAD]", "[CLS]", "[SEP]", "[MASK]"}
    specials = [t for t in by_hand["tokens"][-1][1:-1] if t in control]
    assert specials == ["[CLS]", "[SEP]", "[MASK]", "[PAD]", "[MASK]"]
    # the same tokenizer.json, character for character: model (pieces, scores, merges in their
    # order), normalizer, pre-tokenizer, template, decoder and added tokens
    assert converted["json"] == by_hand["json"]
