"""The validation split of --validation-fraction on a corpus of a few long documents."""

from shatter.pipeline.build import build
from shatter.pipeline.config import InputSpec
from tests.pipeline.corpus import generated_documents, small_config


def test_a_few_long_documents_hold_out_their_tails_at_the_fraction_asked(tmp_path, caplog):
    """Six long documents (books) and --validation-fraction 0.05: one whole document would be
    about a sixth of the rows; the last 5% of each is held out instead, the build says so, and
    index.json's counters record how and how much."""
    docs = generated_documents(240, seed=5)
    books = tmp_path / "books"
    books.mkdir()
    for b in range(6):  # a books file is one document (of paragraphs)
        (books / f"book{b}.txt").write_text("\n\n".join(docs[b * 40 : b * 40 + 40]))
    config = small_config(
        [InputSpec("books", str(books))], tmp_path / "ds", validation_fraction=0.05
    )
    lines = []
    with caplog.at_level("WARNING"):
        index = build(config, [], report=lines.append)
    counters = index["counters"]
    assert counters["validation_hold_out"] == "document tails"
    assert 0.04 < counters["validation_fraction_obtained"] < 0.06, counters
    assert not any("asked" in w for w in counters.get("warnings", [])), counters
    said = next(line for line in lines if line.startswith("validation:"))
    assert "the last 5.0% of each document" in said and "(6 documents)" in said
    assert "--validation-input" in said
