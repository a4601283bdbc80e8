"""Fixtures: a small generated corpus and datasets built from it once per session."""

import pytest

from shatter.pipeline.build import build
from shatter.pipeline.config import InputSpec
from tests.pipeline.corpus import generated_documents, quiet, small_config


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


@pytest.fixture(scope="session")
def built(corpus_dir, tmp_path_factory):
    """A dataset from the generated corpus (FnApiRunner, one worker) and its index."""
    out = tmp_path_factory.mktemp("built") / "ds"
    config = small_config([InputSpec("text", str(corpus_dir))], out)
    return out, build(config, [], report=quiet)
