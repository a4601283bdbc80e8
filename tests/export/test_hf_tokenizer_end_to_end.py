"""A dataset's own tokenizer from the build to transformers: a WordPiece tokenizer.json (trained
here by `tokenizers`, offline) builds shards, trains BERT on CPU, exports, and loads with
`AutoTokenizer` giving the ids the model was trained on; finetuning and evaluation use it. A
cased sentencepiece build keeps case in the export, in transformers and in finetuning."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")

import transformers  # noqa: E402

import shatter  # noqa: E402
from shatter.hf.cli import main as export_main  # noqa: E402
from shatter.pipeline import hf_tokenizer  # noqa: E402
from shatter.pipeline.build import build  # noqa: E402
from shatter.pipeline.config import InputSpec  # noqa: E402
from shatter.train.evaluate_cli import evaluate_export  # noqa: E402
from tests.hf_vocab import wordpiece  # noqa: E402
from tests.pipeline.corpus import generated_documents, quiet, small_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def hf_export(src: Path, out: Path) -> None:
    result = CliRunner().invoke(export_main, [str(src), "--format", "hf", "--output", str(out)])
    assert result.exit_code == 0, result.output


def shard_ids(data: Path) -> collections.Counter:
    """Every id of every row of every shard, [CLS] and [SEP] left out."""
    counts = collections.Counter()
    for path in sorted(data.glob("*.arrow")):
        with pa.ipc.open_stream(str(path)) as reader:
            for ids in reader.read_all()["input_ids"].to_pylist():
                counts.update(i for i in ids if i not in (2, 3))
    return counts


def finetune(export: Path, tmp_path: Path) -> Path:
    from shatter.train.finetune import main as finetune_main

    rows = "".join(
        json.dumps({"text": t, "label": ["neg", "pos"][i % 2]}) + "\n"
        for i, t in enumerate(generated_documents(24, seed=9))
    )
    (tmp_path / "task.jsonl").write_text(rows)
    out = tmp_path / "finetuned"
    args = ["--task", "classify", "--checkpoint", export, "--train-file", tmp_path / "task.jsonl"]
    args += ["--validation-file", tmp_path / "task.jsonl", "--text-columns", "text"]
    args += ["--label-column", "label", "--output", out, "--max-steps", "2", "--eval-every", "2"]
    result = CliRunner().invoke(finetune_main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_a_wordpiece_dataset_trains_bert_exports_and_auto_tokenizer_gives_its_ids(tmp_path):
    docs = generated_documents(160, seed=5)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    vocab = wordpiece(docs, tmp_path / "tokenizer.json")
    data, run = tmp_path / "data", tmp_path / "run"
    config = small_config(
        [InputSpec("text", str(tmp_path / "c.jsonl"))], data, hf_tokenizer=str(vocab)
    )
    build(config, [], report=quiet)
    cmd = [sys.executable, "train/pretrain.py", "--data", data, "--output", run]
    cmd += ["--preset", "bert-tiny", "--config", "configs/cpu-tiny.yaml", "--max-steps", "3"]
    cmd += ["--save-every", "3", "--eval-every", "3", "--micro-batch", "8", "--warmup-steps", "1"]
    done = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    export = run / "export"
    assert (export / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    assert not (export / "tokenizer.model").exists()
    hf_export(run, tmp_path / "hf")

    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (fast.pad_token_id, fast.unk_token_id, fast.cls_token_id) == (0, 1, 2)
    assert (fast.sep_token_id, fast.mask_token_id) == (3, 4)
    encoder = hf_tokenizer.Encoder((data / "tokenizer.json").read_bytes())
    ours = [hf_tokenizer.word_starts(a)[0].tolist() for a in encoder.encode(docs)]
    assert fast(docs, add_special_tokens=False)["input_ids"] == ours
    assert fast(docs[0][:40])["input_ids"] == [2, *encoder.tokenizer.encode(docs[0][:40]).ids[1:]]
    # the shards hold exactly the ids of the documents: the model trained on these ids
    assert shard_ids(data) == collections.Counter(i for ids in ours for i in ids)
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert hf_model.config.vocab_size == encoder.vocab_size

    result = evaluate_export(export, data)  # the data's tokenizer is the model's
    assert np.isfinite(result["loss"])
    best = finetune(export, tmp_path) / "best"
    assert (best / "tokenizer.json").is_file() and not (best / "tokenizer.model").exists()


@pytest.mark.slow
def test_a_cased_sentencepiece_build_keeps_case_end_to_end(tmp_path):
    """--cased: the shards tell "Kalo" from "kalo", and so do the export's tokenizer in
    transformers and the finetuning features (which no longer lower-case its text)."""
    import sentencepiece as spm

    from shatter.train.finetuning.features import Tokenizer

    docs = generated_documents(200, seed=6)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = tmp_path / "data"
    config = small_config([InputSpec("text", str(tmp_path / "c.jsonl"))], data, cased=True)
    build(config, [], report=quiet)
    sp = spm.SentencePieceProcessor(model_file=str(data / "tokenizer.model"))
    upper = {i for i in range(sp.get_piece_size()) if any(c.isupper() for c in sp.id_to_piece(i))}
    assert upper & set(shard_ids(data))  # capitalised pieces in the rows
    model = shatter.build_model("bert-tiny", vocab_size=sp.get_piece_size(), max_len=64)
    shatter.save_pretrained(model, tmp_path / "export", tokenizer=data / "tokenizer.model")
    hf_export(tmp_path / "export", tmp_path / "hf")
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Kalo mine Rusati. kalo MINE rusati."
    assert fast(text, add_special_tokens=False)["input_ids"] == sp.encode(text)
    assert fast("Kalo")["input_ids"] != fast("kalo")["input_ids"]
    features = Tokenizer(tmp_path / "export" / "tokenizer.model")
    assert features.encode([text]) == [sp.encode(text)]
    ids, begins, ends = features.encode_with_offsets(text)
    assert ids == sp.encode(text) and text[begins[0] : ends[0]] == "Kalo"[: ends[0] - begins[0]]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "sentencepiece unigram, cased" in card


@pytest.mark.parametrize("cased", [False, True])
def test_a_sentencepiece_bpe_model_converts_to_the_same_ids(cased, tmp_path):
    """`--tokenizer-model-type bpe`: its tokenizer.json (BPE, merges ranked by the merged piece's
    score) encodes as sentencepiece does, unknown characters and case included."""
    from shatter.hf.tokenizer import save_tokenizer
    from shatter.pipeline.tokenizer import load, train

    lines = [x for d in generated_documents(300, seed=11) for x in d.split("\n")]
    model = tmp_path / "tokenizer.model"
    model.write_bytes(train(lines, 400, "bpe", cased=cased))
    save_tokenizer(model, tmp_path / "hf", 64)
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = generated_documents(100, seed=12) + ["Hello  World, çà  va? 123 ka-lo!", " KALO mine"]
    sp = load(model.read_bytes())
    assert fast(texts, add_special_tokens=False)["input_ids"] == sp.encode(texts)
    assert fast(texts[0])["input_ids"] == [2, *sp.encode(texts[0]), 3]
