"""The finetuning tests' synthetic data: sentiment rows and SQuAD paragraphs of made-up reviews,
and a sentencepiece model with the pipeline's special ids trained on them."""

import random
from pathlib import Path

from shatter.pipeline.tokenizer import train

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
    (root / "tokenizer.model").write_bytes(train([line.lower() for line in lines], 200))
    return root / "tokenizer.model"
