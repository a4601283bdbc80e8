"""`shatter-data inspect` and `verify`: human-readable stats, and integrity checks of a dataset.

verify checks what index.json promises (MosaicML streaming's `validate` spirit): every shard
exists with its recorded bytes and sha256, has the layout's schema, its recorded rows and tokens,
rows within `seq_len` that start with [CLS] and end with [SEP], `dupe_factor` maskings whose
positions are in range and whose labels are the ids at those positions, and the tokenizer's hash.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shatter.pipeline.holdout import in_band
from shatter.pipeline.masking import CLS_ID, SEP_ID
from shatter.shards import read_index, read_shard, schema, sha256_file
from shatter.shards.store import fs

MIN_VALIDATION_ROWS = 100  # fewer: the validation loss is too noisy to compare runs by


def check_table(table: pa.Table, seq_len: int, dupe_factor: int) -> list[str]:
    """Content problems of one shard's table (empty list if none)."""
    problems = []
    if table.num_rows == 0:
        return problems
    lengths = pc.list_value_length(table["input_ids"]).to_numpy()
    if lengths.max() > seq_len:
        problems.append(f"a row has {lengths.max()} ids > seq_len {seq_len}")
    ids = pc.list_flatten(table["input_ids"]).to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if (ids[starts] != CLS_ID).any() or (ids[starts + lengths - 1] != SEP_ID).any():
        problems.append("a row does not start with [CLS] and end with [SEP]")
    if not (pc.list_value_length(table["word_start"]).to_numpy() == lengths).all():
        problems.append("word_start lengths differ from input_ids lengths")
    copies = pc.list_value_length(table["mask_positions"]).to_numpy()
    if (copies != dupe_factor).any():
        problems.append(f"rows with other than dupe_factor={dupe_factor} maskings")
    per_copy = pc.list_value_length(pc.list_flatten(table["mask_positions"])).to_numpy()
    positions = (
        pc.list_flatten(pc.list_flatten(table["mask_positions"])).to_numpy().astype(np.int64)
    )
    labels = pc.list_flatten(pc.list_flatten(table["mask_labels"])).to_numpy()
    row_of_copy = np.repeat(np.arange(table.num_rows), copies)
    row_of_pos = np.repeat(row_of_copy, per_copy)
    if (positions >= lengths[row_of_pos]).any():
        problems.append("a mask position is outside its row")
    elif (ids[starts[row_of_pos] + positions] != labels).any():
        problems.append("mask_labels differ from the ids at mask_positions")
    return problems


def verify_dataset(out: str) -> list[str]:
    """Problems found, each naming its file (empty list: the dataset is sound)."""
    index = read_index(out, verify_tokenizer=False)
    problems = []
    if not fs.exists(index.tokenizer):
        problems.append(f"{index.tokenizer}: missing")
    elif sha256_file(index.tokenizer) != index.tokenizer_sha256:
        problems.append(f"{index.tokenizer}: sha256 differs from index.json")
    want_schema = schema(index.vocab_size)
    for infos in index.splits.values():
        for info in infos:
            path = index.shard_path(info)
            if not fs.exists(path):
                problems.append(f"{path}: missing")
                continue
            if fs.size(path) != info.bytes or sha256_file(path) != info.sha256:
                problems.append(
                    f"{path}: bytes/sha256 differ from index.json (corrupt or replaced)"
                )
                continue
            try:
                table = read_shard(path)
            except (pa.ArrowInvalid, OSError) as e:
                problems.append(f"{path}: unreadable Arrow IPC stream ({e})")
                continue
            if not table.schema.equals(want_schema):
                problems.append(f"{path}: schema {table.schema} differs from the layout's")
                continue
            tokens = int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)
            if table.num_rows != info.rows or tokens != info.tokens:
                problems.append(
                    f"{path}: {table.num_rows} rows / {tokens} tokens, index.json says "
                    f"{info.rows} / {info.tokens}"
                )
            problems += [
                f"{path}: {p}" for p in check_table(table, index.seq_len, index.dupe_factor)
            ]
    return problems


def validation_warnings(index: dict) -> list[str]:
    """Why a dataset's validation split is too small to be useful (empty list: it is not)."""
    config = index.get("config", {})
    val = index["splits"].get("validation", {"shards": []})
    rows, shards = sum(s["rows"] for s in val["shards"]), len(val["shards"])
    fix = (
        "pass a larger --validation-fraction (or a --validation-input)"
        if not config.get("validation_inputs")
        else "pass a larger --validation-input"
    )
    out = []
    if rows < MIN_VALIDATION_ROWS:
        out.append(
            f"the validation split has {rows} rows, fewer than {MIN_VALIDATION_ROWS}: its loss "
            f"will be noisy; {fix}"
        )
    if rows < shards:
        out.append(
            f"the validation split has {rows} rows for {shards} shards: some are empty; {fix} "
            f"or fewer --num-validation-shards"
        )
    obtained = held_out_share(index)
    asked = config.get("validation_fraction") or 0.0
    if obtained is not None and asked > 0 and not in_band(obtained, asked):
        out.append(_share_warning(index, obtained, asked))
    return out


def _share_warning(index: dict, obtained: float, asked: float) -> str:
    """Why a hold-out's share of the rows is far from --validation-fraction, and the fix."""
    counters = index.get("counters", {})
    head = (
        f"the validation split holds {obtained:.1%} of the rows, --validation-fraction asked "
        f"{asked:.1%}"
    )
    fix = "give --validation-input FILE (text you hold out)"
    if counters.get("validation_hold_out") == "document tails":
        return (
            f"{head}: the last {asked:.1%} of each document's text was held out, and the "
            f"documents are short for rows of {index.get('seq_len')} ids (a short piece still "
            f"makes a row of its own); {fix}"
        )
    documents = counters.get("documents_tokenized")
    few = f"{documents} documents" if documents else "few or long documents"
    return (
        f"{head}: the hold-out is by whole document and the corpus has {few}; {fix}, or split "
        "the documents smaller (a chapter or a few paragraphs each) so that whole documents make "
        "up the fraction"
    )


def held_out_share(index: dict) -> float | None:
    """The share of the rows in a held-out validation split (None: a --validation-input's
    split, or no rows)."""
    if index.get("config", {}).get("validation_inputs"):
        return None
    rows = {
        split: sum(s["rows"] for s in index["splits"].get(split, {"shards": []})["shards"])
        for split in ("train", "validation")
    }
    total = rows["train"] + rows["validation"]
    return rows["validation"] / total if total else None


def _histogram(lengths: np.ndarray, seq_len: int, bins: int = 8, width: int = 40) -> list[str]:
    edges = np.linspace(0, seq_len, bins + 1).astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    top = max(int(counts.max()), 1)
    return [
        f"  {lo:>5}-{hi:<5} {c:>9} {'#' * int(round(width * c / top))}"
        for lo, hi, c in zip(edges[:-1], edges[1:], counts)
    ]


def inspect_dataset(out: str, sample_rows: int = 3, split: str = "train") -> str:
    """A report: config summary, per-split stats, length histogram, decoded sample rows with masks."""
    import sentencepiece as spm

    index = read_index(out, verify_tokenizer=False)
    lines = [
        f"dataset {out}: seq_len {index.seq_len}, dupe_factor {index.dupe_factor}, "
        f"vocab {index.vocab_size}"
    ]
    total = sum(s.rows for infos in index.splits.values() for s in infos)
    for name, infos in index.splits.items():
        rows = [s.rows for s in infos]
        spread = f", shard rows {min(rows)}..{max(rows)}" if rows else ""
        share = f" ({100 * sum(rows) / total:.2f}% of rows)" if total else ""
        lines.append(
            f"  {name}: {sum(rows)} rows{share}, {sum(s.tokens for s in infos)} tokens, "
            f"{len(rows)} shards, {sum(s.bytes for s in infos)} bytes{spread}"
        )
    lines += [f"  warning: {w}" for w in validation_warnings(index.raw)]
    counters = index.raw.get("counters", {})
    if counters:
        lines.append("  counters: " + " ".join(f"{k}={v}" for k, v in counters.items()))
    paths = [index.shard_path(s) for s in index.splits.get(split, ())]
    tables = [t for t in (read_shard(p) for p in paths) if t.num_rows]
    if not tables:
        lines.append(f"  ({split} has no rows)")
        return "\n".join(lines)
    table = pa.concat_tables(tables)
    lengths = pc.list_value_length(table["input_ids"]).to_numpy()
    lines.append(f"{split} row lengths (mean {lengths.mean():.1f}):")
    lines += _histogram(lengths, index.seq_len)
    with fs.open_read(index.tokenizer) as f:
        data = f.read()
    if index.tokenizer.endswith(".json"):  # a Hugging Face tokenizer (--hf-tokenizer)
        from shatter.shards.tokenizer import load_json

        piece = load_json(data).id_to_token
    else:
        piece = spm.SentencePieceProcessor(model_proto=data).id_to_piece
    for i in range(min(sample_rows, table.num_rows)):
        row = table.slice(i, 1).to_pylist()[0]
        ids = row["input_ids"]
        lines.append(f"--- row {i} (key {row['key']:016x}, {len(ids)} ids)")
        lines.append("  text:   " + " ".join(piece(t) for t in ids))
        shown = list(ids)
        for p, new in zip(row["mask_positions"][0], row["mask_inputs"][0]):
            shown[p] = new
        marks = {p: lab for p, lab in zip(row["mask_positions"][0], row["mask_labels"][0])}
        lines.append(
            "  masked: "
            + " ".join(
                f"{piece(t)}{{{piece(marks[j])}}}" if j in marks else piece(t)
                for j, t in enumerate(shown)
            )
        )
    return "\n".join(lines)
