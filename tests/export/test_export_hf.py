"""`shatter-export --format hf`: every arch and head loads in transformers and computes our logits.

Models are tiny presets with perturbed weights (away from the init's symmetries: zero biases,
unit LayerNorms), exported through the real command (click, in-process) and loaded back with
transformers' Auto classes from the written directory, offline.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging as pylogging
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import transformers  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import shatter  # noqa: E402
from shatter.extend import extend_model  # noqa: E402
from shatter.heads import SequenceClassificationModel, SpanExtractionModel  # noqa: E402
from shatter.hf import card, convert  # noqa: E402
from shatter.hf.cli import main  # noqa: E402
from shatter.hf.export import outputs, sample_batch as batch  # noqa: E402
from shatter.hf.remote import configuration_shatter, modeling_shatter  # noqa: E402
from shatter.tools.bench.hf_parity import fill_mask, perturbed  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A sentencepiece model trained by the pipeline's own trainer: on the real books when
    ../shared/data is there, else on generated sentences."""
    from shatter.pipeline.tokenizer import train
    from tests.conftest import SHARED_DATA

    books = sorted((SHARED_DATA / "books").glob("*.txt"))
    if books:
        lines = [x for f in books for x in f.read_text().splitlines() if x.strip()][::8]
    else:
        rng = random.Random(0)
        words = [f"w{i}x{'ab'[i % 2] * (i % 5)}" for i in range(400)]
        lines = [" ".join(rng.choices(words, k=12)) for _ in range(3000)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(train(lines, 1000))
    return path


def tiny(arch: str, tokenizer: Path, **overrides) -> shatter.ShatterForMaskedLM:
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(tokenizer)).get_piece_size()
    torch.manual_seed(0)
    return perturbed(shatter.build_model(f"{arch}-tiny", vocab_size=vocab, **overrides))


def export(model, tokenizer: Path, src: Path, out: Path, *extra: str):
    shatter.save_pretrained(model, src, tokenizer=tokenizer)
    result = CliRunner().invoke(main, [str(src), "--format", "hf", "--output", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result


def max_diff(ours, theirs, inputs) -> float:
    return (outputs(ours, inputs) - outputs(theirs, inputs)).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", shatter.ARCHS)
def test_every_arch_matches_in_transformers(arch, tokenizer_file, tmp_path):
    model = tiny(arch, tokenizer_file, max_len=64)
    out = tmp_path / "hf"
    result = export(model, tokenizer_file, tmp_path / "export", out)
    native = arch == "bert"
    assert ("native" in result.output) == native
    assert (out / "modeling_shatter.py").exists() != native
    # the fill-mask pipeline (AutoModelForMaskedLM + AutoTokenizer) agrees with our argmax
    agrees, fill = fill_mask(model, out, native)
    assert agrees
    assert (type(fill.model).__name__ == "BertForMaskedLM") == native
    embeddings = fill.model.get_input_embeddings().weight  # tied, stored once
    assert fill.model.get_output_embeddings().weight is embeddings
    assert max_diff(model, fill.model.eval(), batch(model.config.vocab_size, (24, 11))) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["shatter", "bert-rpe"])
def test_auto_model_loads_the_encoder_of_an_mlm_export_quietly(arch, tokenizer_file, tmp_path):
    """AutoModel (the encoder alone) on a masked-LM export: no load report of unexpected head
    keys, and the same hidden states as the MLM model's encoder."""
    model = tiny(arch, tokenizer_file, max_len=64)
    out = tmp_path / "hf"
    export(model, tokenizer_file, tmp_path / "export", out)
    with hf_warnings() as records:
        encoder = transformers.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    text = "\n".join(records)
    assert "UNEXPECTED" not in text and "MISSING" not in text, text
    # a head class on it reports its new head (random, for finetuning) as the FAQ says
    with hf_warnings() as records:
        transformers.AutoModelForSequenceClassification.from_pretrained(
            out, num_labels=2, trust_remote_code=True
        )
    text = "\n".join(records)
    assert "classifier.weight" in text and "MISSING" in text and "UNEXPECTED" not in text, text
    inputs = batch(model.config.vocab_size, (24, 11))
    with torch.no_grad():
        ours = model.eval().encoder(inputs["input_ids"], inputs["attention_mask"])
        theirs = encoder(**inputs).last_hidden_state
    assert (ours - theirs).abs().max().item() <= TOL


class _Collect(pylogging.Handler):
    def __init__(self, records: list):
        super().__init__()
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


@contextlib.contextmanager
def hf_warnings():
    """The messages transformers logs at warning level or above inside the block."""
    logging = transformers.utils.logging
    logging.set_verbosity_warning()
    records: list[str] = []
    handler = _Collect(records)
    logging.get_logger().addHandler(handler)
    try:
        yield records
    finally:
        logging.get_logger().removeHandler(handler)


def test_remote_code_is_our_model(tokenizer_file):
    """The carried modelling code cannot drift from ours: the same arch lists and the same
    partition of unity (the logits are compared per arch above)."""
    from shatter.attention import ATTENTIONS, SingleHeadPartitionAttention
    from shatter.partition import partition_table

    assert set(convert.REMOTE_ARCHS) == set(shatter.ARCHS)
    absolute = {a for a, cls in ATTENTIONS.items() if cls.absolute_positions}
    assert set(modeling_shatter.ABSOLUTE_POSITIONS) == absolute
    single = {a for a, cls in ATTENTIONS.items() if issubclass(cls, SingleHeadPartitionAttention)}
    assert set(modeling_shatter.SINGLE_HEAD) == single  # the archs taken in row blocks
    for n, layer, layers in ((4, 0, 2), (12, 11, 12), (16, 3, 24)):
        ours = partition_table(n, layer, layers, 300)
        assert torch.equal(modeling_shatter.partition_table(n, layer, layers, 300), ours)
    # and it needs no toolkit: it imports torch, transformers and itself only
    for module in (modeling_shatter, configuration_shatter):
        tree = ast.parse(Path(module.__file__).read_text())
        roots = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        roots |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 0
        }
        assert roots <= {"__future__", "math", "functools", "torch", "transformers"}, roots


def whole_partition_attention(att, x, mask):
    """The single-head attention as the paper writes it, all n parts' A ⊙ N at once
    ([B, n, L, L]): the reference the remote code's row blocks must equal."""
    ms = modeling_shatter
    B, L, d = x.shape
    Q, V = att.query(x), ms._heads(att.value(x), att.n)
    N = ms.toeplitz(ms.partition_table(att.n, att.layer, att.layers, L), L).to(x.dtype)
    Z = (Q / math.sqrt(d)) @ x.transpose(-1, -2)
    R = getattr(att, "partition_embeddings", None)
    if R is not None:  # + B_ij = sum_h (Q R^T)_ih N[h, i, j]
        Z = Z + torch.einsum("bih,hij->bij", Q @ R.t(), N)
    A = ms.activate(Z, mask, att.sigmoid)[:, None] * N[None]  # A ⊙ N[h]
    context = ms._merge(A @ V)
    if att.partition_value:  # + A_part V_part
        context = context + A.sum(-1).transpose(1, 2) @ torch.nn.functional.linear(
            R, att.value.weight
        )
    return context


@pytest.mark.parametrize("arch", modeling_shatter.SINGLE_HEAD)
def test_row_blocks_equal_the_whole_formula_and_hold_no_score_matrix(arch, monkeypatch):
    """The remote code's single-head attention, taken in blocks of 32 query rows (three blocks,
    the last one short), gives the values and gradients of the formula with all of A ⊙ N (in
    float64, so that only a different formula, not a summation order, can differ), and no
    tensor of its forward or backward holds a whole [B, L, L] score matrix."""
    config = configuration_shatter.ShatterConfig(
        arch=arch, hidden_size=16, num_attention_heads=4, num_hidden_layers=2
    )
    torch.manual_seed(0)
    att = modeling_shatter.SingleHeadAttention(config, layer=1).double()
    for p in att.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 80, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[1, 50:] = False
    monkeypatch.setattr(modeling_shatter, "BLOCK_VALUES", 1)
    assert modeling_shatter.block_rows(2, 4, 80) == 32
    weights = torch.randn(2, 80, 16, dtype=torch.float64)
    results = {}
    for name, attend in (("whole", whole_partition_attention), ("blocks", None)):
        with Shapes() as seen:
            out = att(x, mask) if attend is None else attend(att, x, mask)
            (out * weights).sum().backward()
        grads = [x.grad.clone(), *(p.grad.clone() for p in att.parameters())]
        results[name] = (seen.shapes, [out.detach(), *grads])
        x.grad = None
        att.zero_grad()
    for ref, blocked in zip(results["whole"][1], results["blocks"][1]):
        torch.testing.assert_close(blocked, ref, rtol=1e-10, atol=1e-10)
    largest = max(results["blocks"][0], key=math.prod)
    assert math.prod(largest) < 2 * 80 * 80, largest


def finetune_run(run: Path, model, tokenizer: Path, labels) -> Path:
    """A finetuning run's layout: RUN/config.json (with the labels) and RUN/best/."""
    shatter.save_pretrained(model, run / "best", tokenizer=tokenizer)
    (run / "config.json").write_text(json.dumps({"config": {}, "labels": labels}))
    return run


@pytest.mark.slow
def test_a_finetuning_run_exports_with_its_labels(tokenizer_file, tmp_path, monkeypatch):
    """A real (two-step) train/finetune.py run: its best/ model, labels from the task's data."""
    # the one-process run sets RANK, WORLD_SIZE, ... (train/engine.py): gone after this test,
    # or accelerate (the Trainer test) would take the process for a multi-CPU job
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so that teardown restores the key's absence
        monkeypatch.delenv(key)
    import csv

    from shatter.train.finetune import main as finetune
    from tests.finetune.data import sentiment_rows

    export = tmp_path / "export"
    shatter.save_pretrained(
        tiny("shatter", tokenizer_file, max_len=64), export, tokenizer=tokenizer_file
    )
    files = {}
    for split, (n, seed) in {"train": (16, 0), "dev": (8, 1)}.items():
        files[split] = tmp_path / f"{split}.csv"
        with open(files[split], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["id", "review", "sentiment"])
            w.writeheader()
            w.writerows(sentiment_rows(n, seed))
    args = ["--task", "classify", "--checkpoint", export, "--train-file", files["train"]]
    args += ["--validation-file", files["dev"], "--text-columns", "review"]
    args += ["--label-column", "sentiment", "--output", tmp_path / "run", "--max-steps", 2]
    args += ["--eval-every", 2, "--batch-size", 8]
    done = CliRunner().invoke(finetune, [str(a) for a in args])
    assert done.exit_code == 0, done.output
    result = CliRunner().invoke(main, [str(tmp_path / "run"), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", trust_remote_code=True
    )
    assert (
        hf.config.id2label == {0: "neg", 1: "pos"} and hf.config.classifier_strategy == "modified"
    )
    ours = shatter.from_pretrained(tmp_path / "run" / "best")
    assert max_diff(ours, hf.eval(), batch(ours.config.vocab_size, (30, 13))) <= TOL


@pytest.mark.parametrize(
    "arch, head, native",
    [
        ("bert", "modified", False),
        ("bert", "cls", True),
        ("shatter", "span", False),
        ("bert", "span", True),
    ],
)
def test_finetuned_heads_match(arch, head, native, tokenizer_file, tmp_path):
    backbone = tiny(arch, tokenizer_file, max_len=64)
    if head == "span":
        model, labels, auto = SpanExtractionModel(backbone), None, "AutoModelForQuestionAnswering"
    else:
        model = SequenceClassificationModel(backbone, 3, strategy=head)
        labels, auto = (
            ["entailment", "neutral", "contradiction"],
            "AutoModelForSequenceClassification",
        )
    model = perturbed(model, seed=2)
    run = finetune_run(tmp_path / "run", model, tokenizer_file, labels)
    result = CliRunner().invoke(main, [str(run), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = getattr(transformers, auto).from_pretrained(tmp_path / "hf", trust_remote_code=not native)
    assert type(hf).__name__.startswith("Bert") == native
    if labels:
        assert hf.config.id2label == dict(enumerate(labels))
        assert hf.config.label2id["neutral"] == 1
    assert max_diff(model, hf.eval(), batch(backbone.config.vocab_size, (30, 13))) <= TOL
    if not native:  # AutoModel: the encoder alone, the head's weights left out quietly
        with hf_warnings() as records:
            transformers.AutoModel.from_pretrained(tmp_path / "hf", trust_remote_code=True)
        assert not any("UNEXPECTED" in r or "MISSING" in r for r in records), records


@pytest.mark.slow
def test_an_extended_export_matches_at_1024(tokenizer_file, tmp_path):
    model, _ = extend_model(tiny("shatter", tokenizer_file, max_len=64), 1024)
    out = tmp_path / "hf"
    export(model.eval(), tokenizer_file, tmp_path / "export", out)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)
    assert hf.config.max_position_embeddings == 1024
    inputs = batch(model.config.vocab_size, (1024, 700))
    assert max_diff(model, hf.eval(), inputs) <= TOL
    with Shapes() as seen:
        hf(**inputs)
        hf.train()
        hf(**inputs, labels=inputs["input_ids"]).loss.backward()  # finetuning's path too
    assert seen.shapes, "nothing traced"
    n, rows = model.config.heads, inputs["input_ids"].shape[0]
    whole = [s for s in seen.shapes if s[-2:] == (1024, 1024) or math.prod(s) >= n * rows * 1024**2]
    assert not whole, f"a whole score matrix ([L, L], [B, n, L, L], [B, L, n·L]): {whole[:3]}"


class Shapes(TorchDispatchMode):
    """The shapes of every tensor an op creates."""

    def __enter__(self):
        self.shapes = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_tokenizer_ids_equal_ours_on_real_text(shared_data, tokenizer_file, tmp_path):
    """AutoTokenizer gives a fast tokenizer whose ids are our sentencepiece encoding with our
    [CLS]/[SEP] conventions: single texts as the pipeline encodes them, pairs as the
    finetuning features build them. Unigram segmentations of equal score may be tied
    differently (a run of dashes in the wiki sample); any other difference fails."""
    import bz2

    from shatter.pipeline.tokenizer import load
    from shatter.train.finetuning.features import Tokenizer

    export(tiny("bert", tokenizer_file), tokenizer_file, tmp_path / "e", tmp_path / "hf")
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert fast.is_fast and fast.mask_token_id == 4 and fast.pad_token_id == 0
    sp, features = load(tokenizer_file.read_bytes()), Tokenizer(tokenizer_file)
    wiki = bz2.open(shared_data / "wiki" / "enwiki-sample-pages-articles.xml.bz2", "rt")
    books = (shared_data / "books" / "hamlet_gut.txt").read_text().splitlines()
    lines = [x for x in wiki.read().splitlines()[:2000] + books[:2000] if x.strip()]
    ours = sp.encode(lines)
    theirs = fast(lines, add_special_tokens=False)["input_ids"]
    differ = [(a, b) for a, b in zip(ours, theirs) if a != b]
    for a, b in differ:  # only ties: the same total log-probability
        assert sum(map(sp.get_score, a)) == pytest.approx(sum(map(sp.get_score, b)), abs=1e-4)
    assert len(differ) <= len(lines) // 1000
    a, b = lines[10], lines[11]
    pair = fast(a, b)["input_ids"]
    ids_a, ids_b = features.encode([a, b])
    assert pair == [2, *ids_a, 3, *ids_b, 3]
    assert fast(a)["input_ids"] == [2, *sp.encode(a), 3]


@pytest.mark.slow
def test_trainer_round_trip(tokenizer_file, tmp_path):
    """Load the export, finetune it one step with transformers' Trainer on CPU, save, reload."""
    from datasets import Dataset

    export(
        tiny("shatter", tokenizer_file, max_len=64), tokenizer_file, tmp_path / "e", tmp_path / "hf"
    )
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", num_labels=2, trust_remote_code=True
    )
    texts = ["a fine play", "a dull play", "the king is dead", "long live the king"]
    data = Dataset.from_dict({"text": texts, "label": [1, 0, 0, 1]}).map(
        lambda r: tok(r["text"], truncation=True), batched=True
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        max_steps=1,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
    )
    before = model.classifier.weight.detach().clone()
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=transformers.DataCollatorWithPadding(tok),
    )
    trainer.train()
    assert not torch.equal(model.classifier.weight, before)
    trainer.save_model(str(tmp_path / "tuned"))
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "tuned", trust_remote_code=True
    )
    inputs = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = model.eval()(**inputs).logits, reloaded.eval()(**inputs).logits
    assert torch.equal(a, b)


def refused(result, out: Path, *words: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists() or out.name == "taken"


def test_bad_input_gets_one_line(tokenizer_file, tmp_path, monkeypatch):
    src = tmp_path / "export"
    shatter.save_pretrained(tiny("bert", tokenizer_file), src, tokenizer=tokenizer_file)
    run = lambda *a: CliRunner().invoke(main, [*map(str, a)])  # noqa: E731
    out = tmp_path / "hf"
    # an output directory that exists: refused, untouched; --overwrite replaces it
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    refused(run(src, "--output", taken), taken, "already exists", "--overwrite")
    assert (taken / "keep.txt").read_text() == "x"
    assert run(src, "--output", taken, "--overwrite").exit_code == 0
    assert not (taken / "keep.txt").exists() and (taken / "tokenizer.json").exists()
    # an arch without a converter
    monkeypatch.setattr(convert, "REMOTE_ARCHS", ("shatter",))
    refused(run(src, "--output", out), out, "'bert' has no transformers converter")
    monkeypatch.undo()
    # a transformers too old for the classes used
    # (the module object in sys.modules: transformers' lazy import may have replaced it)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    refused(run(src, "--output", out), out, "too old", "pip install -U")
    monkeypatch.undo()
    # a tokenizer that is not sentencepiece
    (src / "tokenizer.model").write_text("not a model")
    refused(run(src, "--output", out), out, "is not a sentencepiece model", "shatter-data build")
    # not an export at all
    refused(run(tmp_path / "nothing", "--output", out), out, "no such directory")


def test_a_run_gets_a_model_card_with_its_data_and_losses(tokenizer_file, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    (data / "index.json").write_text('{"format": "shatter-shards"}')
    shatter.save_pretrained(tiny("bert", tokenizer_file), run / "export", tokenizer=tokenizer_file)
    (run / "config.json").write_text(json.dumps({"config": {"data": {"path": str(data)}}}))
    metrics = [
        {"step": 10, "loss": 7.5, "lr": 1e-4, "gpu_hours": 0.5},
        {"step": 20, "loss": 6.25, "lr": 1e-4, "gpu_hours": 1.25},
        {"step": 20, "split": "validation", "loss": 6.5, "accuracy": 0.1},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    args = [str(run), "--output", str(tmp_path / "hf"), "--license", "apache-2.0"]
    result = CliRunner().invoke(main, [*args, "--dataset", "wikimedia/wikipedia"])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "hf" / "README.md").read_text()
    import hashlib

    import yaml

    digest = hashlib.sha256((data / "index.json").read_bytes()).hexdigest()
    for fact in (digest, "| training steps | 20 |", "6.2500", "6.5000", "pipeline_tag: fill-mask"):
        assert fact in card
    assert "GPU-hours, start-up and lost work included) | 1.25 |" in card
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0" and meta["datasets"] == ["wikimedia/wikipedia"]
    assert "@inproceedings{tian2021shatter" in card and "shatter-extend" in card
    # without --license the field is still set (a null license reads as none on the Hub)
    CliRunner().invoke(main, [str(run), "--output", str(tmp_path / "hf2")])
    meta = yaml.safe_load((tmp_path / "hf2" / "README.md").read_text().split("---")[1])
    assert meta["license"] == "other" and meta["license_name"] == "unspecified"


def test_a_finetuning_card_has_its_scores_as_model_index():
    scores = {"task": "rte", "metric": "accuracy", "scores": {"accuracy": 0.625, "loss": 0.7}}
    import yaml

    meta = yaml.safe_load("\n".join(card.model_index("shatter-rte", scores, "text-classification")))
    result = meta["model-index"][0]["results"][0]
    assert result["task"]["type"] == "text-classification"
    assert result["dataset"]["name"] == "rte"
    assert {"type": "accuracy", "value": 0.625} in result["metrics"]


def test_push_to_hub_offline_is_one_line_after_the_export(tokenizer_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "hf"
    shatter.save_pretrained(tiny("bert", tokenizer_file), tmp_path / "e", tokenizer=tokenizer_file)
    result = CliRunner().invoke(
        main, [str(tmp_path / "e"), "--output", str(out), "--push-to-hub", "you/model"]
    )
    assert result.exit_code == 1 and (out / "README.md").is_file()
    error = result.output.strip().splitlines()[-1]
    assert (
        "cannot push" in error and "HF_HUB_OFFLINE" in error and "huggingface-cli upload" in error
    )


def test_longer_inputs_work_with_relative_positions_and_are_one_line_with_absolute(
    tokenizer_file, tmp_path
):
    """Past max_position_embeddings: a Shatter export (relative positions) runs, as the card
    says; bert-rab's absolute table refuses in one line that says how to go longer."""
    for arch in ("shatter", "bert-rab"):
        model = tiny(arch, tokenizer_file, max_len=16)
        out = tmp_path / arch
        export(model, tokenizer_file, tmp_path / f"{arch}-export", out)
        loaded = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)
        inputs = batch(model.config.vocab_size, (40,))
        if arch == "shatter":
            with torch.no_grad():
                assert loaded.eval()(**inputs).logits.shape[1] == 40
            card = (out / "README.md").read_text()
            assert "longer than 16 tokens run" in card and "grows linearly" in card, card
            continue
        with pytest.raises(ValueError, match="exceeds max_position_embeddings 16") as refused:
            loaded(**inputs)
        assert "\n" not in str(refused.value) and "truncation=True" in str(refused.value)


def test_a_native_bert_export_fails_past_its_length_as_the_card_and_docs_say(
    tokenizer_file, tmp_path
):
    """A bert export is transformers' own BertForMaskedLM, with no code of ours to check the
    length: past max_position_embeddings its tokenizer warns and the forward stops with torch's
    shape error naming both lengths, the very texts the card and export.md quote; truncation=True
    runs."""
    model = tiny("bert", tokenizer_file, max_len=16)
    out = tmp_path / "hf"
    export(model, tokenizer_file, tmp_path / "export", out)
    loaded = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = " ".join(["the cat sat on the mat"] * 10)
    with hf_warnings() as records:
        inputs = tokenizer(text, return_tensors="pt")
    length = inputs["input_ids"].shape[1]
    assert length > 16
    warned = "Token indices sequence length is longer than the specified maximum sequence length"
    assert any(warned in r and f"({length} > 16)" in r for r in records), records
    with pytest.raises(RuntimeError) as failed, torch.no_grad():
        loaded(**inputs)
    said = "The expanded size of the tensor"
    assert f"{said} ({length}) must match the existing size (16)" in str(failed.value)
    card = (out / "README.md").read_text()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    for page in (card, " ".join(docs.split())):
        assert warned in page and said in page and "truncation=True" in page
    truncated = tokenizer(text, truncation=True, return_tensors="pt")
    with torch.no_grad():
        assert loaded(**truncated).logits.shape[1] == 16


def test_auto_model_on_a_native_bert_export_has_no_random_pooler_when_asked(
    tokenizer_file, tmp_path
):
    """A bert export is transformers' own BertForMaskedLM, and the toolkit's masked LM has no
    pooler to export: AutoModel's BertModel reports the pooler missing (random) beside the
    masked-LM head's keys it leaves out; with add_pooling_layer=False (the FAQ's advice) the
    head's keys alone, nothing random; AutoModelForSequenceClassification starts the pooler at
    random with its classifier, as the FAQ says."""
    model = tiny("bert", tokenizer_file, max_len=64)
    assert not any("pooler" in name for name in model.state_dict())
    out = tmp_path / "hf"
    export(model, tokenizer_file, tmp_path / "export", out)
    said = {}
    for pooler in (True, False):
        with hf_warnings() as records:
            transformers.AutoModel.from_pretrained(out, add_pooling_layer=pooler)
        said[pooler] = "\n".join(records)
    assert "pooler" in said[True] and "MISSING" in said[True], said[True]
    assert "pooler" not in said[False] and "MISSING" not in said[False], said[False]
    assert "UNEXPECTED" in said[False], said[False]
    with hf_warnings() as records:
        transformers.AutoModelForSequenceClassification.from_pretrained(out, num_labels=2)
    text = "\n".join(records)
    assert "bert.pooler.dense.weight" in text and "classifier.weight" in text, text
    faq = (Path(__file__).resolve().parents[2] / "docs" / "faq.md").read_text()
    faq = " ".join(faq.split())
    for advice in ("add_pooling_layer=False", "last_hidden_state[:, 0]", "no trained pooler"):
        assert advice in faq, advice
