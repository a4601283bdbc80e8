"""A task's data for finetuning: read both files, map labels, featurize, batch, score.

`build_task_data` returns a `ClassificationData` (GLUE, BoolQ, MultiRC, classify) or a `SpanData`
(SQuAD). Both offer the same small contract to the training loop in `train/finetune.py`:
`train_features` / `eval_features` (lists of dicts), `collate(features) -> batch dict` and
`score(outputs) -> (metrics, predictions)`, where `outputs` maps each head output name to the
per-feature arrays of the evaluation pass. Metrics follow `train/finetuning/metrics.py`; predictions are
id -> label string (or float for regression), or for SQuAD the official `{id: answer}`.
"""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shatter.options import option
from shatter.train.finetuning import metrics as M
from shatter.train.finetuning.features import (
    SpanWindow,
    Tokenizer,
    best_span,
    encode_pair,
    pad_batch,
    span_windows,
)
from shatter.train.finetuning.tasks import (
    TASKS,
    Examples,
    TaskDataError,
    TaskSpec,
    read_boolq,
    read_classify,
    read_glue,
    read_multirc,
    read_squad,
)


@dataclass(frozen=True)
class DataConfig:
    """What to read and how to cut it into model inputs."""

    task: str = option(
        help="Task (GLUE name, squad, boolq, multirc, classify).", choices=tuple(TASKS)
    )
    train_file: Path | None = option(None, "Training file in the task's official format.")
    validation_file: Path | None = option(
        None, "Validation file (default: hold out --validation-fraction of --train-file)."
    )
    validation_fraction: float = option(0.1, "Share held out when there is no --validation-file.")
    max_len: int = option(0, "Input length (default: the checkpoint's max_len).", min=0)
    text_columns: tuple[str, ...] = option(
        ("text",), "classify: one or two comma-separated text columns."
    )
    label_column: str = option("label", "classify: the label column.")
    id_column: str | None = option(
        None, "classify: an id column for predictions.json (default: row number)."
    )
    labels: tuple[str, ...] | None = option(
        None, "classify: comma-separated label set in id order; rows with other labels are skipped."
    )
    regression: bool = option(False, "classify: float labels (MSE, Pearson/Spearman).")
    doc_stride: int = option(128, "squad: tokens between the starts of context windows.", min=1)
    max_query_len: int = 64  # SQuAD: question tokens kept
    max_answer_len: int = 30  # SQuAD: longest predicted answer, in tokens
    seed: int = 0  # seeds the hold-out split


def read_examples(cfg: DataConfig, path: Path) -> Examples:
    spec = TASKS[cfg.task]
    if spec.glue is not None:
        return read_glue(spec, path)
    readers = {"squad": read_squad, "boolq": read_boolq, "multirc": read_multirc}
    if cfg.task in readers:
        return readers[cfg.task](path)
    return read_classify(path, cfg.text_columns, cfg.label_column, cfg.regression, cfg.id_column)


def _split(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    if not 0 < fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {fraction}")
    order = list(range(len(examples.dataset)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, int(round(fraction * len(order))))
    evaluation = examples.dataset.select(sorted(order[:n_eval]))
    train = examples.dataset.select(sorted(order[n_eval:]))
    return Examples(train, examples.skipped, examples.corrected), Examples(evaluation)


def _tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in batch.items()}


@dataclass
class ClassificationData:
    """Sequence (pair) classification or regression; MultiRC groups options by question."""

    task: str
    labels: tuple[str, ...] | None  # None for regression
    train_features: list[dict]
    eval_features: list[dict]
    skipped: dict[str, dict] = field(default_factory=dict)

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def main_metric(self) -> str:
        if self.task == "classify":
            return "spearman" if self.labels is None else "accuracy"
        return M.MAIN_METRIC[self.task]

    def collate(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = _tensors(pad_batch([f["input_ids"] for f in features]))
        dtype = torch.float32 if self.labels is None else torch.long
        batch["labels"] = torch.tensor([f["label"] for f in features], dtype=dtype)
        return batch

    def score(self, outputs: dict[str, list[np.ndarray]]) -> tuple[dict, dict]:
        logits = np.stack(outputs["logits"])
        gold = [f["label"] for f in self.eval_features]
        ids = [f["id"] for f in self.eval_features]
        if self.labels is None:
            preds = logits.reshape(len(gold), -1)[:, 0]
            scores = M.pearson_spearman(gold, preds)
            # always predicting the training set's mean: a constant, which correlates with nothing
            scores[f"mean_{self.main_metric}"] = 0.0
            return scores, {i: float(p) for i, p in zip(ids, preds)}
        preds = logits.argmax(-1).tolist()
        if self.task == "multirc":
            groups = [f["group"] for f in self.eval_features]

            def scorer(g, p):
                return M.multirc_metrics(g, p, groups)
        else:
            scorer = M.CLASSIFICATION_METRICS.get(self.task, M.accuracy)
        scores = scorer(gold, preds)
        # the score of always predicting the training set's most frequent class
        counts = collections.Counter(f["label"] for f in self.train_features)
        majority = counts.most_common(1)[0][0]
        main = self.main_metric
        scores[f"majority_{main}"] = scorer(gold, [majority] * len(gold))[main]
        scores.update(M.class_report(gold, preds, self.labels))
        return scores, {i: self.labels[p] for i, p in zip(ids, preds)}


@dataclass
class SpanData:
    """SQuAD v1.1: one feature per context window; answers decoded per question."""

    train_features: list[dict]
    eval_features: list[dict]
    eval_examples: list[dict]  # id, context, golds of each validation question
    eval_windows: list[SpanWindow]
    max_answer_len: int
    skipped: dict[str, dict] = field(default_factory=dict)
    corrected: dict[str, dict] = field(default_factory=dict)  # rows kept after a repair
    num_labels: int = 2
    main_metric: str = "f1"

    def collate(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = _tensors(pad_batch([f["input_ids"] for f in features]))
        for key in ("start_positions", "end_positions"):
            batch[key] = torch.tensor([f[key] for f in features], dtype=torch.long)
        return batch

    def score(self, outputs: dict[str, list[np.ndarray]]) -> tuple[dict, dict]:
        by_example = collections.defaultdict(list)
        for k, w in enumerate(self.eval_windows):
            by_example[w.example].append(k)
        predictions = {}
        for e, example in enumerate(self.eval_examples):
            ks = by_example[e]
            predictions[example["id"]] = best_span(
                [self.eval_windows[k] for k in ks],
                [outputs["start_logits"][k] for k in ks],
                [outputs["end_logits"][k] for k in ks],
                example["context"],
                self.max_answer_len,
            )
        golds = {x["id"]: x["golds"] for x in self.eval_examples}
        contexts = {x["id"]: x["context"] for x in self.eval_examples}
        scores = M.squad_metrics(predictions, golds)
        return {**scores, **M.question_blind(predictions, golds, contexts)}, predictions


def _label_set(cfg: DataConfig, spec: TaskSpec, train: Examples) -> tuple[str, ...] | None:
    if spec.kind == "regression" or cfg.regression:
        return None
    if spec.labels is not None:
        return spec.labels
    labels = cfg.labels or tuple(sorted(set(train.dataset["label"])))
    if len(labels) < 2:
        raise TaskDataError(f"{cfg.train_file}: needs at least two labels, found {list(labels)}")
    if not cfg.labels and looks_like_scores(labels, len(train.dataset)):
        shown = ", ".join(labels[:: max(1, len(labels) // 4)][:4])
        raise TaskDataError(
            f"{cfg.train_file}: its {len(labels)} labels all read as numbers ({len(labels)} "
            f"distinct in {len(train.dataset)} rows: {shown}, ...): a score, not classes; add "
            "--regression (or name the classes with --labels)"
        )
    return labels


NUMERIC_CLASSES = 10  # this many distinct numbers or fewer are classes (1-5 stars), never a score


def looks_like_scores(labels: Sequence[str], rows: int) -> bool:
    """Labels that are a regression target read as classes: all parse as floats, more than
    NUMERIC_CLASSES distinct, and either some are fractional (STS-B's 3.8, 2.25) or they are
    mostly distinct (at least half as many as `rows`)."""
    if len(labels) <= NUMERIC_CLASSES or not M.all_numbers(labels):
        return False
    fractional = any(not float(x).is_integer() for x in labels)
    return fractional or len(labels) >= rows / 2


def _classification_features(
    examples: Examples, labels, tokenizer: Tokenizer, max_len: int, skipped: collections.Counter
) -> list[dict]:
    d = examples.dataset
    ids_a = tokenizer.encode(d["text_a"])
    has_b = any(d["text_b"])
    ids_b = tokenizer.encode(d["text_b"]) if has_b else [[]] * len(d)
    index = {label: i for i, label in enumerate(labels)} if labels else None
    features = []
    for i, (rid, label, group) in enumerate(zip(d["id"], d["label"], d["group"])):
        if index is not None:
            if label not in index:
                skipped[f"label not in {list(labels)}"] += 1
                continue
            label = index[label]
        features.append(
            {
                "id": rid,
                "input_ids": encode_pair(ids_a[i], ids_b[i], max_len),
                "label": label,
                "group": group,
            }
        )
    return features


def _span_features(examples: Examples, tokenizer: Tokenizer, cfg: DataConfig, train: bool):
    d = examples.dataset
    windows, records = [], []
    for e, (qid, question, context, label, start) in enumerate(
        zip(d["id"], d["text_a"], d["text_b"], d["label"], d["answer_start"])
    ):
        golds = json.loads(label)
        answer = (start, start + len(golds[0])) if train else None
        windows += span_windows(
            tokenizer, question, context, e, cfg.max_len, cfg.doc_stride, cfg.max_query_len, answer
        )
        records.append({"id": qid, "context": context, "golds": golds})
    features = [
        {
            "input_ids": w.input_ids,
            "start_positions": w.start_position,
            "end_positions": w.end_position,
        }
        for w in windows
    ]
    return features, windows, records


def build_task_data(cfg: DataConfig, tokenizer: Tokenizer):
    """Read, split if needed, featurize. Skips are counted per file and returned for the report."""
    if cfg.task not in TASKS:
        raise TaskDataError(f"unknown task {cfg.task!r}; choose one of {sorted(TASKS)}")
    spec = TASKS[cfg.task]
    train = read_examples(cfg, cfg.train_file)
    if cfg.validation_file is None:
        train, evaluation = _split(train, cfg.validation_fraction, cfg.seed)
    else:
        evaluation = read_examples(cfg, cfg.validation_file)
    for name, ex in (("train", train), ("validation", evaluation)):
        if len(ex.dataset) == 0:
            raise TaskDataError(
                f"no usable {name} examples for task {cfg.task!r} (skipped: {dict(ex.skipped)})"
            )
    skipped = {"train": train.skipped, "validation": evaluation.skipped}
    corrected = {"train": dict(train.corrected), "validation": dict(evaluation.corrected)}
    if spec.kind == "span":
        train_features, _, _ = _span_features(train, tokenizer, cfg, train=True)
        eval_features, windows, records = _span_features(evaluation, tokenizer, cfg, train=False)
        return SpanData(
            train_features,
            eval_features,
            records,
            windows,
            cfg.max_answer_len,
            {k: dict(v) for k, v in skipped.items()},
            corrected=corrected,
        )
    labels = _label_set(cfg, spec, train)
    train_features = _classification_features(
        train, labels, tokenizer, cfg.max_len, skipped["train"]
    )
    eval_features = _classification_features(
        evaluation, labels, tokenizer, cfg.max_len, skipped["validation"]
    )
    if not train_features or not eval_features:
        raise TaskDataError(f"no examples left after label mapping (skipped: {skipped})")
    return ClassificationData(
        cfg.task, labels, train_features, eval_features, {k: dict(v) for k, v in skipped.items()}
    )
