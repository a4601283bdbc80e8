"""Fixtures for the finetuning tests: a synthetic corpus, its sentencepiece model, task files."""

import json
from pathlib import Path

import pytest
import torch

from tests.finetune.data import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    """A sentencepiece model with the project's special ids, trained on the synthetic corpus."""
    return train_tokenizer(tmp_path_factory.mktemp("spm"))


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
        # its own seed: the weights do not depend on the tests the xdist worker ran before
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = shatter.build_model(
                f"{arch}-tiny", vocab_size=200, max_len=max_len, hidden=32, ffn=64
            )
        shatter.save_pretrained(model, path, tokenizer=tokenizer_model)
        return path

    return make
