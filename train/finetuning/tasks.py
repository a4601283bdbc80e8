"""Finetuning tasks: what each one reads, and the examples it yields.

Every reader goes through `datasets` and returns `Examples`: a `datasets.Dataset` with the
columns `id`, `text_a`, `text_b` ("" for single-sentence tasks), `label` (a string, a float for
regression, or for SQuAD the JSON list of gold answers), `group` (MultiRC's question, else the id)
and, for SQuAD, `answer_start`; plus a counter of skipped rows, by reason, which the caller
reports. Formats, as distributed:

- GLUE (Wang et al., 2018) TSVs: `quoting=QUOTE_NONE`, as GLUE's own loader reads them, because
  quotes in these files are literal text (a quoted CSV reader swallows whole lines of SST-2 and
  MNLI). CoLA's train/dev files have no header. Lines with the wrong number of fields are skipped
  and counted (physical lines minus parsed rows).
- SQuAD v1.1 JSON (Rajpurkar et al., 2016): `{"data": [{"title", "paragraphs": [{"context",
  "qas": [{"id", "question", "answers": [{"text", "answer_start"}]}]}]}]}`.
- SuperGLUE (Wang et al., 2019) JSONL: BoolQ `{question, passage, idx, label}`; MultiRC
  `{idx, passage: {text, questions: [{idx, question, answers: [{idx, text, label}]}]}}`, which
  becomes one binary example per answer option, grouped by question for EM.
- `classify`: any CSV/TSV or JSON/JSONL file (compressed or not), `--text-columns a[,b]`,
  `--label-column c`.
"""

from __future__ import annotations

import bz2
import collections
import csv
import gzip
import json
import lzma
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets

COLUMNS = ("id", "text_a", "text_b", "label", "group", "answer_start")


class TaskDataError(ValueError):
    """A data file that cannot be read as the task's format; the message names the file."""


@dataclass(frozen=True)
class GlueFormat:
    """Where one GLUE task keeps its fields in the distributed TSV."""

    text_a: str  # column of the first sentence
    text_b: str | None  # column of the second sentence, None for single-sentence tasks
    label: str  # column of the gold label
    header: tuple[str, ...] | None = None  # column names when the file has no header row


@dataclass(frozen=True)
class TaskSpec:
    """A task: its kind, its label set in id order, and how its files are read."""

    name: str
    kind: str  # "classification", "regression" or "span"
    labels: tuple[str, ...] | None  # label strings by id; None: taken from the data
    glue: GlueFormat | None = None  # set for the GLUE TSV tasks


_COLA = GlueFormat(
    "sentence", None, "label", header=("source", "label", "original_label", "sentence")
)
TASKS: dict[str, TaskSpec] = {
    "cola": TaskSpec("cola", "classification", ("0", "1"), _COLA),
    "sst2": TaskSpec("sst2", "classification", ("0", "1"), GlueFormat("sentence", None, "label")),
    "mrpc": TaskSpec(
        "mrpc", "classification", ("0", "1"), GlueFormat("#1 String", "#2 String", "Quality")
    ),
    "qqp": TaskSpec(
        "qqp", "classification", ("0", "1"), GlueFormat("question1", "question2", "is_duplicate")
    ),
    "stsb": TaskSpec("stsb", "regression", None, GlueFormat("sentence1", "sentence2", "score")),
    "mnli": TaskSpec(
        "mnli",
        "classification",
        ("entailment", "neutral", "contradiction"),
        GlueFormat("sentence1", "sentence2", "gold_label"),
    ),
    "qnli": TaskSpec(
        "qnli",
        "classification",
        ("entailment", "not_entailment"),
        GlueFormat("question", "sentence", "label"),
    ),
    "rte": TaskSpec(
        "rte",
        "classification",
        ("entailment", "not_entailment"),
        GlueFormat("sentence1", "sentence2", "label"),
    ),
    "squad": TaskSpec("squad", "span", None),
    "boolq": TaskSpec("boolq", "classification", ("false", "true")),
    "multirc": TaskSpec("multirc", "classification", ("0", "1")),
    "classify": TaskSpec("classify", "classification", None),
}


@dataclass
class Examples:
    """The examples of one file, the rows skipped while reading it, by reason, and the rows kept
    after a repair, by what was repaired."""

    dataset: datasets.Dataset
    skipped: collections.Counter = field(default_factory=collections.Counter)
    corrected: collections.Counter = field(default_factory=collections.Counter)


def _text(value) -> str:
    """pandas infers numbers in a column of strings; the task wants the text as written."""
    return "" if value is None else str(value).strip()


def _open_text(path: Path):
    opener = {".bz2": bz2.open, ".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    return opener(path, "rt", encoding="utf-8", newline="")


def _count_lines(path: Path) -> int:
    with _open_text(path) as f:
        return sum(1 for _ in f)


def _build(rows: list[dict], skipped: collections.Counter) -> Examples:
    columns = {c: [r.get(c) for r in rows] for c in COLUMNS}
    columns["text_b"] = [t or "" for t in columns["text_b"]]
    columns["group"] = [g if g is not None else i for g, i in zip(columns["group"], columns["id"])]
    columns["answer_start"] = [a if a is not None else -1 for a in columns["answer_start"]]
    if not (rows and isinstance(rows[0]["label"], float)):  # regression keeps float labels
        columns["label"] = [str(x) for x in columns["label"]]
    return Examples(datasets.Dataset.from_dict(columns), skipped)


def _check_json(path: Path) -> None:
    """A JSON file parses (JSONL: every line does); else a TaskDataError naming the position."""
    with _open_text(path) as f:
        text = f.read()
    try:
        json.loads(text)
        return
    except json.JSONDecodeError as whole:
        if ".jsonl" not in path.suffixes:
            raise TaskDataError(
                f"{path}: not valid JSON at line {whole.lineno} column {whole.colno} "
                f"(character {whole.pos}): {whole.msg}; the file is truncated or damaged"
            ) from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(
                    f"{path}: line {number} is not valid JSON (column {e.colno}): {e.msg}; "
                    "the file is truncated or damaged"
                ) from None


def _quietly(loader, *args, **kwargs) -> datasets.Dataset:
    """`loader(*args, **kwargs)`, its "Generating train split" bar shown on a terminal only: in a
    log it is a line of carriage-return redraws."""
    shown = datasets.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        return loader(*args, **kwargs)
    finally:
        if shown:
            datasets.enable_progress_bars()


def _load(loader, path: Path, **kwargs) -> datasets.Dataset:
    """`loader` (datasets' from_csv or from_json) on `path`, with the cause of every failure
    named: no file, an empty file, a header without rows, a JSON parse error and its position."""
    if not path.is_file():
        raise TaskDataError(f"{path}: no such file")
    with _open_text(path) as f:
        lines = [line for line in (f.readline() for _ in range(2)) if line.strip()]
    if not lines:
        raise TaskDataError(f"{path}: the file is empty (0 bytes or only blank lines)")
    if loader is not datasets.Dataset.from_json and len(lines) == 1:
        if kwargs.get("header", "infer") is not None:
            raise TaskDataError(
                f"{path}: only a header line ({lines[0].strip()[:80]!r}), no data rows"
            )
    try:
        data = _quietly(loader, str(path), **kwargs)
    except Exception as e:  # datasets wraps parser errors in several types; name the file
        if loader is datasets.Dataset.from_json:
            _check_json(path)  # a parse error: its position, said plainly
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise TaskDataError(f"{path}: cannot be read ({type(cause).__name__}: {first})") from None
    if len(data) == 0:
        raise TaskDataError(f"{path}: no data rows")
    return data


def _need_columns(path: Path, have, need) -> None:
    missing = [c for c in need if c not in have]
    if missing:
        raise TaskDataError(f"{path}: missing column(s) {missing}; found {list(have)}")


def read_glue(spec: TaskSpec, path: Path) -> Examples:
    """A GLUE TSV as distributed (train.tsv, dev.tsv, dev_matched.tsv, ...)."""
    fmt = spec.glue
    kwargs = dict(sep="\t", quoting=csv.QUOTE_NONE, keep_default_na=False)
    kwargs["on_bad_lines"] = "skip"  # counted below: physical lines minus parsed rows
    if fmt.header:
        kwargs.update(header=None, names=list(fmt.header))
    raw = _load(datasets.Dataset.from_csv, path, **kwargs)
    need = [fmt.text_a, fmt.label] + ([fmt.text_b] if fmt.text_b else [])
    _need_columns(path, raw.column_names, need)
    skipped = collections.Counter()
    bad_lines = _count_lines(path) - (0 if fmt.header else 1) - len(raw)
    if bad_lines:
        skipped["malformed line (wrong number of tab-separated fields)"] += bad_lines
    rows = []
    for i, r in enumerate(raw.to_list()):
        a, b = _text(r[fmt.text_a]), _text(r[fmt.text_b]) if fmt.text_b else ""
        label = _text(r[fmt.label])
        if not a or (fmt.text_b and not b):
            skipped["empty text"] += 1
            continue
        if spec.kind == "regression":
            try:
                label = float(label)
            except (TypeError, ValueError):
                skipped["unparseable regression label"] += 1
                continue
        elif label not in spec.labels:
            skipped[f"label not in {list(spec.labels)}"] += 1
            continue
        rows.append(
            {
                "id": str(r.get("index") or r.get("id") or i),
                "text_a": a,
                "text_b": b,
                "label": label,
            }
        )
    return _build(rows, skipped)


def read_squad(path: Path) -> Examples:
    """SQuAD v1.1 JSON: one example per question; `label` is the JSON list of gold answers."""
    raw = _load(datasets.Dataset.from_json, path, field="data")
    _need_columns(path, raw.column_names, ["paragraphs"])
    skipped, corrected, rows = collections.Counter(), collections.Counter(), []
    for article in raw.to_list():
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                answers = [a for a in qa.get("answers") or [] if a.get("text")]
                if not answers or not qa.get("question", "").strip():
                    skipped["question without answer or text"] += 1
                    continue
                first = answers[0]
                start = first.get("answer_start", -1)
                if context[start : start + len(first["text"])] != first["text"]:
                    start = context.find(first["text"])  # a shifted offset: trust the text
                    if start < 0:
                        skipped["answer text not found in context"] += 1
                        continue
                    corrected["answer_start (the answer text found elsewhere)"] += 1
                rows.append(
                    {
                        "id": qa["id"],
                        "text_a": qa["question"],
                        "text_b": context,
                        "label": json.dumps([a["text"] for a in answers]),
                        "answer_start": start,
                    }
                )
    examples = _build(rows, skipped)
    examples.corrected = corrected
    return examples


def read_boolq(path: Path) -> Examples:
    raw = _load(datasets.Dataset.from_json, path)
    _need_columns(path, raw.column_names, ["question", "passage", "label"])
    skipped, rows = collections.Counter(), []
    for i, r in enumerate(raw.to_list()):
        if r["label"] is None or not r["question"] or not r["passage"]:
            skipped["missing question, passage or label"] += 1
            continue
        rid = r.get("idx", i)
        rows.append(
            {
                "id": str(i if rid is None else rid),
                "text_a": r["question"],
                "text_b": r["passage"],
                "label": str(bool(r["label"])).lower(),
            }
        )
    return _build(rows, skipped)


def read_multirc(path: Path) -> Examples:
    """One binary example per answer option: (passage, question + answer), grouped by question."""
    raw = _load(datasets.Dataset.from_json, path)
    _need_columns(path, raw.column_names, ["passage"])
    skipped, rows = collections.Counter(), []
    for i, r in enumerate(raw.to_list()):
        p_idx = r.get("idx", i)
        passage = r["passage"]
        for question in passage.get("questions") or []:
            group = f"{p_idx}-{question['idx']}"
            for answer in question.get("answers") or []:
                if answer.get("label") is None or not answer.get("text"):
                    skipped["answer option without label or text"] += 1
                    continue
                rows.append(
                    {
                        "id": f"{group}-{answer['idx']}",
                        "text_a": passage["text"],
                        "text_b": f"{question['question']} {answer['text']}",
                        "label": str(int(answer["label"])),
                        "group": group,
                    }
                )
    if not rows:
        raise TaskDataError(f"{path}: no labelled MultiRC answer options found")
    return _build(rows, skipped)


def read_classify(
    path: Path,
    text_columns: tuple[str, ...],
    label_column: str,
    regression: bool = False,
    id_column: str | None = None,
) -> Examples:
    """Any CSV/TSV or JSON/JSONL table; rows with empty text or label are skipped and counted."""
    if not 1 <= len(text_columns) <= 2:
        raise TaskDataError(f"--text-columns takes one or two columns, got {list(text_columns)}")
    suffixes = [s for s in path.suffixes if s not in (".bz2", ".gz", ".xz")]
    kind = suffixes[-1] if suffixes else ""
    if kind in (".json", ".jsonl"):
        raw = _load(datasets.Dataset.from_json, path)
    elif kind in (".csv", ".tsv"):
        kwargs = dict(keep_default_na=False)
        if kind == ".tsv":
            kwargs.update(sep="\t", quoting=csv.QUOTE_NONE)
        raw = _load(datasets.Dataset.from_csv, path, **kwargs)
    else:
        raise TaskDataError(
            f"{path}: expected a .csv, .tsv, .json or .jsonl file (optionally .bz2/.gz/.xz)"
        )
    _need_columns(
        path, raw.column_names, [*text_columns, label_column] + ([id_column] if id_column else [])
    )
    skipped, rows = collections.Counter(), []
    texts = [raw[c] for c in text_columns]
    ids = raw[id_column] if id_column else None
    for i, label in enumerate(raw[label_column]):
        parts = [_text(t[i]) for t in texts]
        if not all(parts):
            skipped["empty text"] += 1
            continue
        if label is None or str(label).strip() == "":
            skipped["empty label"] += 1
            continue
        if regression:
            try:
                label = float(label)
            except ValueError:
                skipped["unparseable regression label"] += 1
                continue
        else:
            label = str(label).strip()
        rid = str(ids[i]) if ids is not None else str(i)
        rows.append(
            {
                "id": rid,
                "text_a": parts[0],
                "text_b": parts[1] if len(parts) > 1 else "",
                "label": label,
            }
        )
    return _build(rows, skipped)
