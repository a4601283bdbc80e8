"""The build's bad inputs through the real CLI: each failure exits 1 with one line naming the cause,
and loses nothing; each questionable request is warned about and recorded."""

import hashlib
import json

import pytest
from click.testing import CliRunner

from shatter import shards
from shatter.pipeline.cli import main

from .corpus import generated_documents


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("shatter-data: error:")]


def _sha256_tree(root) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _build(out, inputs, *extra, tokenizer=None, sharding=("--num-shards", "2")):
    args = ["build", "--output", str(out), "--seq-len", "32", *sharding]
    for path in inputs:
        args += ["--input", str(path)]
    if tokenizer:
        args += ["--tokenizer", str(tokenizer)]
    else:
        args += ["--vocab-size", "200", "--tokenizer-sample", "2000"]
    return CliRunner().invoke(main, args + list(extra))


@pytest.fixture
def good(built, corpus_dir, tmp_path):
    """A finished dataset, with a file of the user's beside the build's."""
    out = tmp_path / "ds"
    result = _build(out, [corpus_dir / "a.txt"], tokenizer=built[0] / "tokenizer.model")
    assert result.exit_code == 0, result.output
    (out / "NOTES.md").write_text("kept by the user\n")
    return out


@pytest.mark.slow
def test_a_failed_overwrite_leaves_the_old_dataset_byte_identical(good, tmp_path):
    before = _sha256_tree(good)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 64)  # skipped as binary: no text to train on
    result = _build(good, [binary], "--overwrite", "--on-error", "stop")
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = _error_lines(result.output)
    assert "no text to train the tokenizer on in " in line and "binary.txt" in line
    assert _sha256_tree(good) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt", "ds"]  # nothing left over


@pytest.mark.slow
def test_a_failed_overwrite_during_the_build_pipeline_keeps_the_old_dataset(good, built, tmp_path):
    """A worker's error in the build pipeline itself (a truncated dump with --on-error stop)."""
    import bz2

    page = "<page><title>T</title><ns>0</ns><id>1</id><revision><text>%s</text></revision></page>"
    data = bz2.compress(
        (
            "<mediawiki>" + "".join(page % d for d in generated_documents(100)) + "</mediawiki>"
        ).encode()
    )
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(data[: len(data) // 2])
    before = _sha256_tree(good)
    result = _build(
        good,
        [f"wiki={dump}"],
        "--overwrite",
        "--on-error",
        "stop",
        tokenizer=built[0] / "tokenizer.model",
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = _error_lines(result.output)
    assert "dump.xml.bz2" in line and "truncated" in line
    assert _sha256_tree(good) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "dump.xml.bz2"]


@pytest.mark.slow
def test_a_successful_overwrite_replaces_the_build_and_keeps_other_files(
    good, built, corpus_dir, tmp_path
):
    old = shards.read_index(str(good)).raw
    refused = _build(good, [corpus_dir / "b.txt"], tokenizer=built[0] / "tokenizer.model")
    assert refused.exit_code == 1 and "--overwrite" in _error_lines(refused.output)[0]
    result = _build(
        good, [corpus_dir / "b.txt"], "--overwrite", tokenizer=built[0] / "tokenizer.model"
    )
    assert result.exit_code == 0, result.output
    new = shards.read_index(str(good)).raw
    assert new["config"]["inputs"][0]["path"].endswith("b.txt") and new != old
    assert (good / "NOTES.md").read_text() == "kept by the user\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # the old copy is gone
    listed = {s["file"] for split in new["splits"].values() for s in split["shards"]}
    on_disk = {p.name for p in good.iterdir() if p.suffix == ".arrow"}
    assert listed == on_disk  # no shard of the old build left


@pytest.mark.slow
def test_a_vocabulary_larger_than_the_corpus_supports_is_warned_and_recorded(corpus_dir, tmp_path):
    out = tmp_path / "v"
    result = _build(out, [corpus_dir / "a.txt"], "--vocab-size", "5000")
    assert result.exit_code == 0, result.output
    index = json.loads((out / "index.json").read_text())
    got = index["tokenizer"]["vocab_size"]
    assert got < 5000 and index["config"]["requested_vocab_size"] == 5000
    warning = next(line for line in result.output.splitlines() if "--vocab-size 5000" in line)
    assert f"vocabulary of {got} pieces" in warning


@pytest.mark.slow
def test_validation_fraction_holds_out_the_tails_of_a_small_corpus(built, tmp_path):
    """Three documents and the default 0.5%: by hash alone, almost surely none would be held out,
    and one whole document would be a third; with a given tokenizer, the build counts them as it
    goes and builds again with each document's tail held out."""
    docs = tmp_path / "three.txt"
    docs.write_text("\n\n".join(d.replace("\n", " ") for d in generated_documents(3, seed=5)))
    out = tmp_path / "three"
    tiny_shards = ("--shard-size-mb", "0.0003")  # by size: the two builds' shard counts differ
    result = _build(out, [docs], tokenizer=built[0] / "tokenizer.model", sharding=tiny_shards)
    assert result.exit_code == 0, result.output
    index = shards.read_index(str(out))
    listed = {s["file"] for split in index.raw["splits"].values() for s in split["shards"]}
    assert {p.name for p in out.glob("*.arrow")} == listed  # no shard of the first build left
    assert index.rows("validation") > 0 and index.rows("train") > 0
    assert index.raw["counters"]["validation_hold_out"] == "document tails"
    assert "the last 0.5% of each document's text" in result.output
    assert "building again with that hold-out" in result.output
    assert any("validation split has" in line for line in result.output.splitlines())
    shown = CliRunner().invoke(main, ["inspect", str(out), "--rows", "0"])
    assert shown.exit_code == 0, shown.output
    assert "validation:" in shown.output and "% of rows" in shown.output
    assert "warning: the validation split has" in shown.output
    # one document: its tail too
    one = tmp_path / "one.txt"
    one.write_text(generated_documents(1, seed=5)[0].replace("\n", " "))
    result = _build(tmp_path / "one", [one], tokenizer=built[0] / "tokenizer.model")
    assert result.exit_code == 0, result.output
    assert shards.read_index(str(tmp_path / "one")).rows("validation") == 1


@pytest.mark.slow
@pytest.mark.shared_data
def test_books_get_a_validation_split(shared_data, built, tmp_path):
    """The eight real books: the default --validation-fraction used to hold out none of them."""
    out = tmp_path / "books"
    result = _build(out, [f"books={shared_data / 'books'}"], tokenizer=built[0] / "tokenizer.model")
    assert result.exit_code == 0, result.output
    index = shards.read_index(str(out))
    assert index.rows("validation") > 0 and index.rows("train") > index.rows("validation")


def test_a_text_file_read_as_a_wiki_dump_is_named_in_one_line(corpus_dir, tmp_path):
    result = _build(tmp_path / "w", [corpus_dir / "a.txt"], "--corpus", "wiki")
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = _error_lines(result.output)
    assert "no documents found in" in line and "a.txt (read as wiki)" in line
    assert "is --corpus right" in line and "counters above" not in result.output
    assert "(no counters yet)" not in result.output
