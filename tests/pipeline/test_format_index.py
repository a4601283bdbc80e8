"""index.json's one builder (shatter/shards/index.py): what it records, read back as written."""

import hashlib

from shatter.shards import INDEX_FILE, ShardInfo, build_index, read_index, write_index


def test_build_index_records_shards_totals_and_tokenizer_and_reads_back(tmp_path):
    model = b"a tokenizer's bytes"
    (tmp_path / "tokenizer.model").write_bytes(model)
    for name in ("train-00000-of-00002.arrow", "train-00001-of-00002.arrow"):
        (tmp_path / name).write_bytes(b"x")
    a = ShardInfo("train-00000-of-00002.arrow", rows=3, tokens=30, bytes=1, sha256="0" * 64)
    b = {**a.__dict__, "file": "train-00001-of-00002.arrow", "rows": 2, "tokens": 7}
    b |= {"split": "train", "shard": 1}  # a manifest record's other fields are not recorded
    index = build_index(
        {"train": [a, b], "validation": []},
        seq_len=16,
        dupe_factor=2,
        tokenizer_sha256=hashlib.sha256(model).hexdigest(),
        vocab_size=50,
        special_ids={"[PAD]": 0},
    )
    train = index["splits"]["train"]
    assert (train["rows"], train["tokens"]) == (5, 37)
    assert train["shards"][1] == {k: b[k] for k in ("file", "rows", "tokens", "bytes", "sha256")}
    assert "record_batch_rows" not in index and "counters_unavailable" not in index
    write_index(str(tmp_path), index)
    read = read_index(str(tmp_path))
    assert (read.seq_len, read.dupe_factor, read.vocab_size) == (16, 2, 50)
    assert [s.rows for s in read.shards("train")] == [3, 2] and (tmp_path / INDEX_FILE).exists()
    with_rows = build_index(
        {"train": [a]},
        seq_len=16,
        dupe_factor=2,
        tokenizer_sha256="",
        vocab_size=50,
        special_ids={},
        counters_unavailable=("documents_read",),
        record_batch_rows=8,
    )
    assert with_rows["record_batch_rows"] == 8
    assert with_rows["counters_unavailable"] == ["documents_read"]
