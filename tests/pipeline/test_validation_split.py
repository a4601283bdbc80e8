"""The validation split a build holds out by document hash, against --validation-fraction."""

from shatter.pipeline.build import build
from shatter.pipeline.config import InputSpec
from tests.pipeline.corpus import generated_documents, quiet, small_config


def test_a_hold_out_of_whole_documents_far_from_the_fraction_asked_warns(tmp_path, caplog):
    """Six long documents (books) and --validation-fraction 0.05: one whole document is held out,
    about a sixth of the rows; the build warns with the share obtained and the fix, and
    index.json's counters keep the warning and the share."""
    docs = generated_documents(60, seed=5)
    books = tmp_path / "books"
    books.mkdir()
    for b in range(6):  # one document per file: no blank line inside
        (books / f"book{b}.txt").write_text(" ".join(docs[b * 10 : b * 10 + 10]).replace("\n", " "))
    config = small_config(
        [InputSpec("text", str(books))], tmp_path / "ds", validation_fraction=0.05
    )
    with caplog.at_level("WARNING"):
        index = build(config, [], report=quiet)
    share = index["counters"]["validation_fraction_obtained"]
    assert share > 0.1, share
    warning = next(w for w in index["counters"]["warnings"] if "whole document" in w)
    assert f"{share:.1%} of the rows" in warning and "asked 5.0%" in warning
    assert "--validation-input" in warning and "6 documents" in warning
    assert warning in caplog.text
