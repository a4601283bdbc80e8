"""`shatter-data build --hf-tokenizer` and `--cased`: a Hugging Face tokenizer (trained here,
offline) renumbered to the toolkit's special ids, its word starts, and the shards it gives."""

import json

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm
from click.testing import CliRunner

pytest.importorskip("tokenizers")

from tokenizers import Tokenizer  # noqa: E402

from shatter.pipeline import hf_tokenizer  # noqa: E402
from shatter.pipeline.build import TRAINING_ONLY, build  # noqa: E402
from shatter.pipeline.cli import main  # noqa: E402
from shatter.pipeline.config import InputSpec  # noqa: E402
from shatter.pipeline.inspect import inspect_dataset, verify_dataset  # noqa: E402
from tests.hf_vocab import byte_level_bpe, wordpiece  # noqa: E402
from tests.pipeline.corpus import generated_documents, quiet, small_config  # noqa: E402

ROLES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def docs():
    return generated_documents(120, seed=3)


@pytest.fixture(scope="module")
def wordpiece_json(docs, tmp_path_factory):
    return wordpiece(docs, tmp_path_factory.mktemp("wp") / "tokenizer.json")


def tokens(ids, tokenizer) -> list[str]:
    return [tokenizer.id_to_token(int(i)) for i in ids]


def test_wordpiece_moves_its_special_tokens_to_ids_0_to_4_and_keeps_every_token(
    wordpiece_json, docs
):
    original = Tokenizer.from_file(str(wordpiece_json))
    data = hf_tokenizer.prepare(str(wordpiece_json))
    ours = hf_tokenizer.load(data)
    assert tokens(range(5), ours) == ROLES
    assert set(ours.get_vocab()) == set(original.get_vocab())  # renumbered, nothing lost
    assert hf_tokenizer.prepare(str(wordpiece_json)) == data  # deterministic bytes
    again = wordpiece_json.parent / "again.json"
    again.write_bytes(data)
    assert hf_tokenizer.prepare(str(again)) == data  # a dataset's own tokenizer.json as it is
    encoder = hf_tokenizer.Encoder(data)
    for text, flagged in zip(docs[:20], encoder.encode(docs[:20])):
        ids, starts = hf_tokenizer.word_starts(flagged)
        want = original.encode(text, add_special_tokens=False).tokens
        assert tokens(ids, ours) == want  # the same segmentation, new numbers
        assert starts.tolist() == [not t.startswith("##") for t in want]  # BERT's word pieces
    assert ours.encode("ka lo").ids[0] == 2 and ours.encode("ka lo").ids[-1] == 3


def test_byte_level_bpe_gets_the_roles_it_lacks_and_word_starts_by_offsets(docs, tmp_path):
    """RoBERTa's names (<s>, </s>, <pad>, <unk>, and <mask> added last) and a GPT-2 vocabulary
    without any special token: both come out with the five roles at ids 0-4."""
    roberta = byte_level_bpe(docs, tmp_path / "roberta.json", ["<s>", "<pad>", "</s>", "<unk>"])
    tok = Tokenizer.from_file(str(roberta))
    tok.add_special_tokens(["<mask>"])
    tok.save(str(roberta))
    data = hf_tokenizer.prepare(str(roberta))
    assert tokens(range(5), hf_tokenizer.load(data)) == ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]
    gpt2 = byte_level_bpe(docs, tmp_path / "gpt2.json", [])
    ours = hf_tokenizer.load(hf_tokenizer.prepare(str(gpt2)))
    assert tokens(range(5), ours) == ROLES
    flagged = hf_tokenizer.Encoder(data).encode(["Kalo mine, rusati"])[0]
    ids, starts = hf_tokenizer.word_starts(flagged)
    words = np.cumsum(starts)
    text = "".join(tokens(ids, hf_tokenizer.load(data))).replace("\u0120", " ")
    assert text == "Kalo mine, rusati"
    # a word is the run of tokens from one start to the next: the words of the text
    pieces = ["".join(tokens(ids[words == w], hf_tokenizer.load(data))) for w in set(words)]
    assert [p.replace("\u0120", "") for p in pieces] == ["Kalo", "mine", ",", "rusati"]


def test_a_tokenizer_that_keeps_the_text_whole_gets_word_starts_from_whitespace(tmp_path):
    """sentencepiece's Metaspace without splitting gives every token word id 0: the starts come
    from the whitespace before each token (a lone '▁' starts the word after it)."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=False)
    specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.UnigramTrainer(vocab_size=60, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(["kalo mine rusati vobe"] * 20, trainer)
    tok.save(str(tmp_path / "unigram.json"))
    encoder = hf_tokenizer.Encoder(hf_tokenizer.prepare(str(tmp_path / "unigram.json")))
    text = "kalo  minevobe rusati"
    ids, starts = hf_tokenizer.word_starts(encoder.encode([text])[0])
    words = np.cumsum(starts)
    pieces = ["".join(tokens(ids[words == w], encoder.tokenizer)) for w in sorted(set(words))]
    assert [p.strip("\u2581") for p in pieces] == ["kalo", "minevobe", "rusati"]


def test_a_hub_name_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "a.txt").write_text("kalo mine\n")
    result = CliRunner().invoke(
        main,
        ["build", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
         "--hf-tokenizer", "no-such-org/no-such-tokenizer"],
    )  # fmt: skip
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "no-such-org/no-such-tokenizer" in line, line
    assert "cannot fetch it from the Hugging Face Hub" in line and "local directory" in line
    missing = CliRunner().invoke(
        main,
        ["build", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"),
         "--hf-tokenizer", str(tmp_path / "none" / "tokenizer.json")],
    )  # fmt: skip
    assert missing.exit_code == 1 and "no such file or directory" in missing.output


def read_table(path) -> pa.Table:
    with pa.ipc.open_stream(str(path)) as reader:
        return reader.read_all()


@pytest.mark.slow
def test_a_wordpiece_build_masks_whole_words_and_rebuilds_byte_identically(
    wordpiece_json, docs, tmp_path
):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    def run(out):
        config = small_config(
            [InputSpec("text", str(corpus))], out, hf_tokenizer=str(wordpiece_json), whole_word=True
        )
        return build(config, [], report=quiet)

    index = run(tmp_path / "ds")
    assert index["tokenizer"]["file"] == "tokenizer.json"
    assert index["tokenizer"]["special_ids"] == {t: i for i, t in enumerate(ROLES)}
    tok = Tokenizer.from_file(str(tmp_path / "ds" / "tokenizer.json"))
    assert index["tokenizer"]["vocab_size"] == tok.get_vocab_size()
    # config: no option of training a sentencepiece model (no vocab_size 32000, no cased False)
    assert not set(TRAINING_ONLY) & set(index["config"]), index["config"]
    assert index["config"]["hf_tokenizer"] == str(wordpiece_json)
    continued = 0
    for shard in index["splits"]["train"]["shards"]:
        table = read_table(tmp_path / "ds" / shard["file"]).to_pylist()
        for row in table:
            ids, starts = row["input_ids"], row["word_start"]
            assert starts == [not t.startswith("##") for t in tokens(ids, tok)]
            for positions in row["mask_positions"]:
                masked = set(positions)
                for p in masked:  # a masked piece's whole word is masked
                    if not starts[p] and ids[p - 1] not in (2, 3):
                        assert p - 1 in masked
                        continued += 1
                    if p + 1 < len(ids) and not starts[p + 1]:
                        assert p + 1 in masked
    assert continued > 20
    assert verify_dataset(str(tmp_path / "ds")) == []
    report = inspect_dataset(str(tmp_path / "ds"), sample_rows=1)
    assert "text:   [CLS] " in report and " ##" in report  # the rows decoded by tokenizer.json
    assert run(tmp_path / "again")["splits"] == index["splits"]
    for name in ["tokenizer.json"] + [
        s["file"] for split in index["splits"].values() for s in split["shards"]
    ]:
        assert (tmp_path / "ds" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_cased_trains_a_sentencepiece_model_that_keeps_case(corpus_dir, tmp_path):
    out = tmp_path / "cased"
    index = build(
        small_config([InputSpec("text", str(corpus_dir))], out, cased=True), [], report=quiet
    )
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(5)] == ROLES
    assert sp.encode("Kalo") != sp.encode("kalo")
    assert any(c.isupper() for i in range(sp.get_piece_size()) for c in sp.id_to_piece(i))
    assert index["config"]["cased"] is True
    with pytest.raises(ValueError, match="--cased applies to the sentencepiece model"):
        small_config([InputSpec("text", str(corpus_dir))], out, cased=True, tokenizer="x.model")
