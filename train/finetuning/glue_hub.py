"""GLUE as TSVs in the distribution's layout, from rows in the Hub's `nyu-mll/glue` schema.

`write_task` reads a task from the Hub through `datasets` (online); `write_split` writes any rows
of that schema (the Hub's, or a test's) as the file `train/finetuning/tasks.py` reads: the columns
and label strings of the GLUE distribution, tabs and line breaks in the text made spaces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

NLI = ("entailment", "not_entailment")
# task: (header or None, Hub text columns, label strings by id or None for a score, Hub splits)
FORMATS = {
    "cola": (None, ("sentence",), ("0", "1"), {"train": "train", "dev": "validation"}),
    "sst2": ("sentence\tlabel", ("sentence",), ("0", "1"), {"train": "train", "dev": "validation"}),
    "mrpc": (
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
        ("sentence1", "sentence2"),
        ("0", "1"),
        {"train": "train", "dev": "validation"},
    ),
    "qqp": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
        ("question1", "question2"),
        ("0", "1"),
        {"train": "train", "dev": "validation"},
    ),
    "stsb": (
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
        ("sentence1", "sentence2"),
        None,
        {"train": "train", "dev": "validation"},
    ),
    "mnli": (
        "index\tsentence1\tsentence2\tgold_label",
        ("premise", "hypothesis"),
        ("entailment", "neutral", "contradiction"),
        {
            "train": "train",
            "dev_matched": "validation_matched",
            "dev_mismatched": "validation_mismatched",
        },
    ),
    "qnli": ("index\tquestion\tsentence\tlabel", ("question", "sentence"), NLI, {"train": "train", "dev": "validation"}),
    "rte": ("index\tsentence1\tsentence2\tlabel", ("sentence1", "sentence2"), NLI, {"train": "train", "dev": "validation"}),
}  # fmt: skip


def _clean(text: str) -> str:
    return " ".join(str(text).replace("\t", " ").split())


def _line(task: str, i: int, texts: list[str], label: str) -> str:
    if task == "cola":
        return f"hub\t{label}\t\t{texts[0]}"
    if task == "sst2":
        return f"{texts[0]}\t{label}"
    if task == "mrpc":
        return f"{label}\t{i}a\t{i}b\t{texts[0]}\t{texts[1]}"
    if task == "qqp":
        return f"{i}\t{i}a\t{i}b\t{texts[0]}\t{texts[1]}\t{label}"
    if task == "stsb":
        return f"{i}\tg\tf\ty\t{i}\ts\ts\t{texts[0]}\t{texts[1]}\t{label}"
    return f"{i}\t{texts[0]}\t{texts[1]}\t{label}"  # mnli, qnli, rte


def write_split(task: str, path: Path, rows: Iterable[Mapping]) -> Path:
    """Rows of the Hub's schema (text columns, an int `label` or a float score) as GLUE's TSV."""
    header, columns, labels, _ = FORMATS[task]
    lines = [] if header is None else [header]
    for i, r in enumerate(rows):
        label = f"{float(r['label']):.3f}" if labels is None else labels[int(r["label"])]
        lines.append(_line(task, i, [_clean(r[c]) for c in columns], label))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def write_task(task: str, folder: Path) -> None:
    """The Hub's `nyu-mll/glue` task as GLUE TSVs in `folder` (skipped when already there)."""
    import datasets

    for name, split in FORMATS[task][3].items():
        path = folder / f"{name}.tsv"
        if not path.is_file():
            write_split(task, path, datasets.load_dataset("nyu-mll/glue", task, split=split))
