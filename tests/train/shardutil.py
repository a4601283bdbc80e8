"""Small shard datasets in the DESIGN.md layout, written with pyarrow, for the loader's unit tests.

End-to-end tests use datasets built by the real `shatter-data build` instead: `build_books`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import sentencepiece as spm

from shatter.shards import build_index, write_index

MASK = 4
SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": MASK}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# sentencepiece trainer arguments that put [PAD] and [UNK] at the format's ids, and no BOS/EOS
SENTENCEPIECE_SPECIALS = dict(
    pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]"
)


@functools.cache
def tokenizer_model(vocab: int) -> bytes:
    """A sentencepiece model of exactly `vocab` pieces with the format's special ids: a
    character model of "abc" (4 pieces with its word boundary) and placeholder symbols."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["abc"] * 10),
        model_writer=out,
        vocab_size=vocab,
        model_type="char",
        **SENTENCEPIECE_SPECIALS,
        control_symbols=["[CLS]", "[SEP]", "[MASK]"],
        user_defined_symbols=[f"<w{i}>" for i in range(vocab - len(SPECIAL_IDS) - 4)],
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return out.getvalue()


def _rows(rng, n, seq_len, vocab, dupe_factor, min_len):
    for _ in range(n):
        length = int(rng.integers(min_len, seq_len + 1))
        ids = [2] + rng.integers(5, vocab, length - 2).tolist() + [3]
        word_start = [True] + (rng.random(length - 2) < 0.6).tolist() + [True]
        positions, labels, inputs = [], [], []
        for _ in range(dupe_factor):
            k = max(1, round(0.15 * (length - 2)))
            pos = np.sort(rng.choice(np.arange(1, length - 1), k, replace=False)).tolist()
            positions.append(pos)
            labels.append([ids[p] for p in pos])
            inputs.append([MASK] * k)
        yield ids, positions, labels, inputs, word_start


def write_dataset(
    root: Path,
    *,
    shards=(3, 2),
    seq_len=32,
    dupe_factor=2,
    vocab=100,
    seed=0,
    min_len=6,
    val_rows=(5,),
) -> Path:
    """A dataset with train shards of the given row counts and validation shards of `val_rows`."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (root / "tokenizer.model").write_bytes(tokenizer_model(vocab))
    l16 = pa.list_(pa.uint16())
    schema = pa.schema(
        [
            ("input_ids", l16),
            ("mask_positions", pa.list_(l16)),
            ("mask_labels", pa.list_(l16)),
            ("mask_inputs", pa.list_(l16)),
            ("word_start", pa.list_(pa.bool_())),
        ]
    )
    splits = {}
    for split, counts in (("train", shards), ("validation", val_rows)):
        entries = []
        for i, n in enumerate(counts):
            name = f"{split}-{i:05d}-of-{len(counts):05d}.arrow"
            cols = list(zip(*_rows(rng, n, seq_len, vocab, dupe_factor, min_len)))
            table = pa.table([pa.array(c, t.type) for c, t in zip(cols, schema)], schema=schema)
            options = ipc.IpcWriteOptions(compression="zstd")
            with ipc.new_stream(str(root / name), schema, options=options) as writer:
                for batch in table.to_batches(max_chunksize=max(1, n // 2)):
                    writer.write_batch(batch)
            entries.append(
                {
                    "file": name,
                    "rows": n,
                    "tokens": 0,
                    "bytes": (root / name).stat().st_size,
                    "sha256": _sha(root / name),
                }
            )
        splits[split] = entries
    index = build_index(
        splits,
        seq_len=seq_len,
        dupe_factor=dupe_factor,
        tokenizer_sha256=_sha(root / "tokenizer.model"),
        vocab_size=vocab,
        special_ids=SPECIAL_IDS,
    )
    write_index(str(root), index)
    return root


BIN = Path(sys.executable).parent


def build_books(shared_data: Path, out: Path, *flags: str) -> Path:
    """Gutenberg books of ../shared/data through the real `shatter-data build`; `flags` win."""
    cmd = [str(BIN / "shatter-data"), "build", "--corpus", "books"]
    cmd += ["--input", str(shared_data / "books"), "--output", str(out)]
    cmd += ["--validation-fraction", "0.05", "--seed", "0", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
