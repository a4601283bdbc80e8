"""index.json's `config` records the options a build used: a given tokenizer's build has none
of the options of training one (its size and case are the tokenizer's own)."""

import json

from shatter.pipeline.build import TRAINING_ONLY, build
from shatter.pipeline.config import InputSpec
from tests.pipeline.corpus import generated_documents, quiet, small_config


def test_a_given_tokenizer_s_index_records_no_training_option(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(generated_documents(80, seed=4)) + "\n")
    inputs = [InputSpec("text", str(tmp_path / "corpus.txt"))]
    trained = build(small_config(inputs, tmp_path / "trained"), [], report=quiet)
    assert trained["config"]["vocab_size"] == 300 and trained["config"]["cased"] is False
    given = small_config(
        inputs, tmp_path / "given", tokenizer=str(tmp_path / "trained" / "tokenizer.model")
    )
    index = build(given, [], report=quiet)
    assert not set(TRAINING_ONLY) & set(index["config"]), index["config"]
    on_disk = json.loads((tmp_path / "given" / "index.json").read_text())
    assert "vocab_size" not in on_disk["config"] and on_disk["tokenizer"]["vocab_size"] > 0
