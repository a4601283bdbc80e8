"""The model card (README.md with Hub metadata) of a transformers export.

It states what the export is (arch, parameter count, max length and how to extend it), where it
came from when SRC was a run (the training data's index.json sha256, the steps, the final
training and validation loss from metrics.jsonl), how to load it, and how to cite the paper.
The Hub metadata carries the license (`--license`, else `other` / `unspecified`: the toolkit
cannot know the data's terms), the datasets (`--dataset`), a `model-index` when SRC is a
finetuning run with scores, and the training compute the run recorded (`gpu_hours`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

from shatter.attention import ATTENTIONS, SingleHeadPartitionAttention
from shatter.checkpoint import tokenizer_path
from shatter.hf.tokenizer import describe
from shatter.model import count_parameters
from shatter.sources import dataset_dirs

CITATION = """@inproceedings{tian2021shatter,
  title     = {Shatter: An Efficient Transformer Encoder with Single-Headed Self-Attention
               and Relative Sequence Partitioning},
  author    = {Tian, Ran and Maynez, Joshua and Parikh, Ankur P.},
  booktitle = {Findings of EMNLP},
  year      = {2021}
}"""
PIPELINE_TAGS = {
    None: "fill-mask",
    "sequence-classification": "text-classification",
    "span-extraction": "question-answering",
}


def run_facts(run: Path | None) -> dict:
    """From a pretraining run: the data's index.json sha256, the last step, the last training
    and validation losses. Missing pieces are left out."""
    facts: dict = {}
    if run is None:
        return facts
    try:
        data = json.loads((run / "config.json").read_text())["config"]["data"]["path"]
        indexes = [directory / "index.json" for directory in dataset_dirs(data)]
        facts["data_index_sha256"] = ", ".join(
            hashlib.sha256(index.read_bytes()).hexdigest() for index in indexes
        )
        facts["data"] = data if isinstance(data, str) else ", ".join(data)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return facts
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or "loss" not in rec:
            continue
        key = "validation_loss" if rec.get("split") == "validation" else "train_loss"
        facts[key] = rec["loss"]
        facts["steps"] = max(facts.get("steps", 0), int(rec.get("step", 0)))
        if isinstance(rec.get("gpu_hours"), (int, float)):
            facts["gpu_hours"] = float(rec["gpu_hours"])
    return facts


def finetune_scores(run: Path | None) -> dict | None:
    """A finetuning run's best dev scores (metrics.json): {task, metric, scores} or None."""
    try:
        summary = json.loads((run / "metrics.json").read_text())
        best = summary["best"]
        scores = {k: float(v) for k, v in best.items() if k != "step" and isinstance(v, float)}
        return {"task": str(summary["task"]), "metric": summary["main_metric"], "scores": scores}
    except (TypeError, OSError, ValueError, KeyError, AttributeError):
        return None


def model_index(name: str, result: dict | None, task_type: str) -> list[str]:
    """The Hub's `model-index` YAML lines for a finetuning run's dev scores."""
    if not result or not result["scores"]:
        return []
    metrics = [
        line
        for metric, value in result["scores"].items()
        for line in (f"    - type: {metric}", f"      value: {value:.4f}")
    ]
    return [
        "model-index:",
        f"- name: {name}",
        "  results:",
        f"  - task: {{type: {task_type}}}",
        f"    dataset: {{name: {result['task']}, type: {result['task']}, split: validation}}",
        "    metrics:",
        *["  " + m for m in metrics],
    ]


def metadata(config, report, license: str | None, datasets: tuple[str, ...], scores) -> list[str]:
    """The card's YAML front matter (the Hub's model-card metadata)."""
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {PIPELINE_TAGS[report.head]}",
        "tags:",
        *[f"- {tag}" for tag in dict.fromkeys(("shatter", config.arch))],
        f"license: {license}" if license else "license: other",
        *([] if license else ["license_name: unspecified"]),
        *(["datasets:", *[f"- {d}" for d in datasets]] if datasets else []),
        *model_index(
            f"{config.arch}-{scores['task']}" if scores else "", scores, PIPELINE_TAGS[report.head]
        ),
        "---",
    ]
    return lines


def longer_inputs(config, report) -> str:
    """What an input longer than max_len does in transformers, up to the card's extend command:
    relative positions run it (memory linear in the length for the single-head archs, whose
    remote code takes attention in row blocks); the remote code's absolute table refuses it in
    one line; a native BertFor* is transformers' own code, which fails with torch's shape error
    (its tokenizer warns first), as every BERT on the Hub does."""
    n = config.max_len
    if config.arch not in ("bert", "bert-rab"):
        single_head = issubclass(ATTENTIONS[config.arch], SingleHeadPartitionAttention)
        memory = (
            "memory grows linearly with the length (attention is taken in blocks of rows) and "
            "time as its square"
            if single_head
            else "memory grows as the length squared"
        )
        return (
            f"Inputs longer than {n} tokens run: this arch has no absolute position embeddings "
            "(its positions are functions of the distance j - i), so any length is well "
            f"defined; {memory}. They are lengths it was not trained at (the tokenizer, whose "
            f"`model_max_length` is {n}, warns and `truncation=True` cuts there): the paper "
            "extends a model to twice its pretraining length by finetuning it at that length. "
            "To train or finetune at a longer length, extend it with no new weights: "
        )
    if not report.native:
        return (
            f"Inputs longer than {n} tokens are refused in one line (truncate them with the "
            "tokenizer's `truncation=True`); extending adds rows to the absolute position table: "
        )
    return (
        f"Inputs longer than {n} tokens fail, as in any BERT of transformers (this is its own "
        f"`{report.hf_class}`, with no code of ours to check them): the tokenizer warns "
        "`Token indices sequence length is longer than the specified maximum sequence length` "
        f"and the model stops with torch's `The expanded size of the tensor (L) must match the "
        f"existing size ({n})`. Truncate them with the tokenizer's `truncation=True`; extending "
        "adds rows to the absolute position table: "
    )


def model_card(
    model: nn.Module, source, report, license: str | None = None, datasets: tuple[str, ...] = ()
) -> str:
    config = model.config
    facts = run_facts(source.run)
    scores = finetune_scores(source.run) if report.head else None
    remote = "" if report.native else ", trust_remote_code=True"
    meta = metadata(config, report, license, datasets, scores)
    rows = [
        ("arch", f"`{config.arch}`"),
        ("class", f"`{report.hf_class}`" + ("" if report.native else " (remote code)")),
        ("parameters", f"{count_parameters(model, exclude_word_embeddings=False):,}"),
        ("hidden / layers / heads or parts", f"{config.hidden} / {config.layers} / {config.heads}"),
        ("vocabulary", f"{config.vocab_size} ({describe(tokenizer_path(source.export))})"),
        ("max length", f"{config.max_len} tokens"),
        ("max logit difference to the toolkit's model", f"{report.max_abs_diff:.1e} (fp32)"),
    ]
    names = {
        "data_index_sha256": "training data (index.json sha256)",
        "steps": "training steps",
        "train_loss": "final training loss",
        "validation_loss": "final validation loss",
        "gpu_hours": "training compute (GPU-hours, start-up and lost work included)",
    }
    rows += [(names[k], _fmt(k, facts[k])) for k in names if k in facts]
    auto = {
        None: "AutoModelForMaskedLM",
        "sequence-classification": "AutoModelForSequenceClassification",
        "span-extraction": "AutoModelForQuestionAnswering",
    }[report.head]
    body = [
        f"# {config.arch} encoder ({report.head or 'masked LM'})",
        "",
        "Trained with the `shatter` toolkit and exported with `shatter-export --format hf`; the "
        "export was checked to give the toolkit's logits.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "## Use",
        "",
        "```python",
        f"from transformers import AutoTokenizer, {auto}",
        "",
        f"tokenizer = AutoTokenizer.from_pretrained(PATH{remote})",
        f"model = {auto}.from_pretrained(PATH{remote})",
        "```",
        "",
        longer_inputs(config, report)
        + "`shatter-extend EXPORT --max-len 1024 --output EXT` on the toolkit export, then "
        "export EXT again.",
        "",
        "## License",
        "",
        f"`{license}`."
        if license
        else "Not set at export (`shatter-export --license ID`): "
        "fill in the `license` field above with the terms of the training data and your release.",
        "",
        "## Citation",
        "",
        "```bibtex",
        CITATION,
        "```",
        "",
    ]
    return "\n".join(meta + [""] + body)


def _fmt(key: str, value) -> str:
    if key == "data_index_sha256":
        return f"`{value}`"
    if key == "gpu_hours":
        return f"{value:.2f}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
