"""Fixtures: a small generated corpus and datasets built from it once per session."""

import numpy as np
import pytest

from shatter.pipeline.build import build
from shatter.pipeline.config import BuildConfig, InputSpec

SYLLABLES = "ka lo mi ne ru sa ti vo be da fe gu hi jo pe qu".split()


def generated_documents(n_docs: int, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text: documents of paragraphs of sentences of made-up words."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(400)]
    docs = []
    for _ in range(n_docs):
        paragraphs = []
        for _ in range(rng.integers(1, 4)):
            sentences = [
                " ".join(rng.choice(words, size=rng.integers(4, 15))).capitalize() + "."
                for _ in range(rng.integers(1, 6))
            ]
            paragraphs.append(" ".join(sentences))
        docs.append("\n".join(paragraphs))
    return docs


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """Two .txt files (paragraph mode: documents separated by blank lines) and a .jsonl file."""
    root = tmp_path_factory.mktemp("corpus")
    docs = generated_documents(300)
    (root / "a.txt").write_text("\n\n".join(d.replace("\n", " ") for d in docs[:120]) + "\n")
    (root / "b.txt").write_text("\n\n".join(d.replace("\n", " ") for d in docs[120:200]) + "\n")
    import json

    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[200:]))
    return root


def small_config(inputs, output, **overrides) -> BuildConfig:
    base = dict(
        inputs=tuple(inputs),
        output=str(output),
        vocab_size=300,
        seq_len=64,
        dupe_factor=2,
        shard_size_mb=0.035,  # 3 train shards, 1 validation shard, sized from the data
        validation_fraction=0.1,
        tokenizer_sample=5000,
        split_bytes=20_000,
        spill_rows=100,
    )  # several read ranges and spills: real splitting
    base.update(overrides)
    return BuildConfig(**base)


def quiet(_message):
    pass


@pytest.fixture(scope="session")
def built(corpus_dir, tmp_path_factory):
    """A dataset from the generated corpus (FnApiRunner, one worker) and its index."""
    out = tmp_path_factory.mktemp("built") / "ds"
    config = small_config([InputSpec("text", str(corpus_dir))], out)
    return out, build(config, [], report=quiet)
