"""Fixtures for the finetuning tests: a synthetic corpus, its sentencepiece model, task files."""

import json
import random
from pathlib import Path

import pytest
import sentencepiece as spm

POSITIVE = "good great fine lovely superb brilliant charming moving fresh witty".split()
NEGATIVE = "bad awful dull boring weak tedious clumsy stale flat messy".split()
FILLER = (
    "the film movie plot story actor scene script director cast and was is a of this it".split()
)


def sentence(rng: random.Random, words: list[str], n: int = 8) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def sentiment_rows(n: int, seed: int = 0) -> list[dict]:
    """Reviews whose label is which of two word lists dominates: learnable in a few steps."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        cue = POSITIVE if label else NEGATIVE
        words = [rng.choice(FILLER) for _ in range(6)] + [rng.choice(cue) for _ in range(3)]
        rng.shuffle(words)
        rows.append(
            {
                "id": f"r{i}",
                "review": " ".join(words).capitalize() + ".",
                "sentiment": ["neg", "pos"][label],
            }
        )
    return rows


def squad_json(n_paragraphs: int, seed: int = 0) -> dict:
    """SQuAD v1.1 JSON: each paragraph names a colour; the question asks for it."""
    rng = random.Random(seed)
    colours = "red green blue yellow purple orange".split()
    paragraphs = []
    for p in range(n_paragraphs):
        colour, name = rng.choice(colours), f"item{p}"
        before = sentence(rng, FILLER, rng.randint(5, 60))
        after = sentence(rng, FILLER, rng.randint(5, 60))
        context = f"{before.capitalize()}. The {name} is painted {colour.upper()} today. {after}."
        start = context.index(colour.upper())
        paragraphs.append(
            {
                "context": context,
                "qas": [
                    {
                        "id": f"q{p}",
                        "question": f"What colour is the {name}?",
                        "answers": [
                            {"text": colour.upper(), "answer_start": start},
                            {"text": f"{colour.upper()} today", "answer_start": start},
                        ],
                    }
                ],
            }
        )
    return {"version": "1.1", "data": [{"title": "colours", "paragraphs": paragraphs}]}


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    """A sentencepiece model with the project's special ids, trained on the synthetic corpus."""
    return train_tokenizer(tmp_path_factory.mktemp("spm"))


def train_tokenizer(root: Path) -> Path:
    """`tokenizer_model`'s model, trained in `root`: root/tokenizer.model."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    lines = [r["review"] for r in sentiment_rows(400)]
    lines += [
        p["context"] + " " + p["qas"][0]["question"]
        for p in squad_json(200)["data"][0]["paragraphs"]
    ]
    lines += [sentence(rng, FILLER + POSITIVE + NEGATIVE, 12) for _ in range(200)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(line.lower() for line in lines))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(root / "tokenizer"),
        vocab_size=200,
        pad_id=0,
        unk_id=1,
        bos_id=-1,
        eos_id=-1,
        pad_piece="[PAD]",
        unk_piece="[UNK]",
        user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
        minloglevel=2,
    )
    return root / "tokenizer.model"


@pytest.fixture
def write_jsonl():
    def write(path: Path, rows: list[dict]) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write


@pytest.fixture
def export(tmp_path, tokenizer_model):
    """make(arch, max_len): a tiny export (hidden 32) with the synthetic tokenizer."""
    import shatter

    def make(arch="shatter", max_len=64):
        path = tmp_path / f"export-{arch}"
        model = shatter.build_model(
            f"{arch}-tiny", vocab_size=200, max_len=max_len, hidden=32, ffn=64
        )
        shatter.save_pretrained(model, path, tokenizer=tokenizer_model)
        return path

    return make
