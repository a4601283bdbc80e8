"""An index whose vocabulary disagrees with its tokenizer, or a model's vocab_size set smaller
than the data's, stops the trainer at start-up in one line naming index.json, the sizes and the
fix, not as an IndexError at the first id past the embedding (on a GPU, a device-side assert)."""

import json
from pathlib import Path

import pytest

from shatter.shards import DatasetError
from shatter.train.config import ConfigError, resolve
from shatter.train.pretrain import start_up_checks
from tests.train.shardutil import write_dataset


@pytest.fixture
def data(tmp_path) -> Path:
    return write_dataset(tmp_path / "data", shards=(4,), seq_len=32, vocab=100)


def _flags(data: Path, tmp_path: Path, **more) -> dict:
    return {"data": (str(data),), "output": str(tmp_path / "run"), "preset": "bert-tiny", **more}


def test_the_data_and_its_tokenizer_agree(data, tmp_path):
    index, _, _ = start_up_checks(resolve(None, _flags(data, tmp_path)))
    assert index.vocab_size == 100


@pytest.mark.parametrize("edited", [60, 150])
def test_an_edited_vocab_size_is_refused_in_one_line(data, tmp_path, edited):
    raw = json.loads((data / "index.json").read_text())
    raw["tokenizer"]["vocab_size"] = edited
    (data / "index.json").write_text(json.dumps(raw))
    with pytest.raises(DatasetError) as refused:
        start_up_checks(resolve(None, _flags(data, tmp_path)))
    line = str(refused.value)
    assert "\n" not in line and str(data / "index.json") in line
    assert f"vocab_size {edited} is not its tokenizer's 100" in line
    assert "rebuild the data" in line and "tokenizer file" in line


def test_a_model_vocab_size_below_the_data_is_refused_in_one_line(data, tmp_path):
    (tmp_path / "run.yaml").write_text("model:\n  overrides:\n    vocab_size: 64\n")
    with pytest.raises(ConfigError) as refused:
        start_up_checks(resolve(str(tmp_path / "run.yaml"), _flags(data, tmp_path)))
    line = str(refused.value)
    assert "\n" not in line and "vocab_size 64" in line and "100" in line
    assert str(data / "index.json") in line


def test_a_tokenizer_json_is_sized_as_the_tokenizers_package_sizes_it():
    tokenizers = pytest.importorskip("tokenizers")
    from shatter.shards.tokenizer import file_vocab_size, vocab_size

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "a": 5, "b": 6}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.add_special_tokens(["<extra>"])  # an added token: id 7, past the model's
    pieces = [(p, 0.0) for p in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]]
    unigram = tokenizers.Tokenizer(tokenizers.models.Unigram(pieces, unk_id=1))
    for tokenizer, size in ((word_level, 8), (unigram, 7)):
        assert file_vocab_size(tokenizer.to_str().encode(), "tokenizer.json") == size
        assert vocab_size(tokenizer) == size


def test_an_unreadable_tokenizer_is_named_in_one_line(data, tmp_path):
    from shatter.shards import read_index

    (data / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    index = read_index(str(data), verify_tokenizer=False)
    with pytest.raises(DatasetError, match=r"tokenizer.model: not a sentencepiece model \(the"):
        index.check_vocabulary()
