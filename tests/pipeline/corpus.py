"""The pipeline tests' generated corpus (deterministic pseudo-text) and a small build config."""

import numpy as np

from shatter.pipeline.config import BuildConfig

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
