"""Finetuning metrics, as each benchmark defines them.

- GLUE (Wang et al., 2018): CoLA Matthews correlation; STS-B Pearson and Spearman; MRPC and QQP
  F1 of the positive class and accuracy; accuracy for SST-2, MNLI, QNLI, RTE.
- SQuAD v1.1 (Rajpurkar et al., 2016): exact match and token F1 after the official answer
  normalisation (`evaluate-v1.1.py`: lower-case, drop punctuation, drop the articles a/an/the,
  collapse whitespace), the maximum over the gold answers, averaged over questions, in percent.
- MultiRC (Khashabi et al., 2018; SuperGLUE): F1a, the binary F1 over all answer options, and EM,
  the fraction of questions whose answer options are all labelled correctly.
- BoolQ: accuracy.

sklearn and scipy compute the standard ones; only the SQuAD normalisation and the MultiRC grouping
are written here, because no maintained library ships them without a network download.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np
from scipy import stats
from sklearn import metrics as skm

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """The official SQuAD v1.1 normalisation: lower, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction: str, gold: str) -> float:
    """Token-level F1 between normalised answers (0 when they share no token, as the script does)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(predictions: Mapping[str, str], golds: Mapping[str, Sequence[str]]) -> dict:
    """EM and F1 in percent over every question in `golds`; an unanswered question scores 0."""
    if not golds:
        raise ValueError("no gold answers to score against")
    em = f1 = 0.0
    for qid, answers in golds.items():
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max(squad_exact_match(pred, a) for a in answers)
        f1 += max(squad_f1(pred, a) for a in answers)
    n = len(golds)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "examples": n}


def question_blind(
    predictions: Mapping[str, str], golds: Mapping[str, Sequence[str]], contexts: Mapping[str, str]
) -> dict:
    """SQuAD's question-blind baseline, over the questions that share their paragraph (its
    `contexts` entry) with others: `question_blind_f1`, the F1 of answering each with its
    paragraph's most frequent prediction; `shared_f1`, the model's own F1 on them; and
    `same_answer_share`, the share of them that got that same answer. A model that reads the
    questions beats the baseline; one that learned only where answers tend to sit does not.
    Empty when no paragraph has two questions (nothing to compare)."""
    by_paragraph: dict = collections.defaultdict(list)
    for qid in golds:
        by_paragraph[contexts[qid]].append(qid)
    shared = [qids for qids in by_paragraph.values() if len(qids) > 1]
    if not shared:
        return {}
    blind, own, same = {}, {}, 0
    for qids in shared:
        answers = collections.Counter(normalize_answer(predictions.get(q, "")) for q in qids)
        common = answers.most_common(1)[0][0]
        blind.update({q: common for q in qids})
        own.update({q: predictions.get(q, "") for q in qids})
        same += sum(normalize_answer(predictions.get(q, "")) == common for q in qids)
    asked = {q: golds[q] for q in blind}
    return {
        "question_blind_f1": squad_metrics(blind, asked)["f1"],
        "shared_f1": squad_metrics(own, asked)["f1"],
        "same_answer_share": same / len(blind),
    }


def accuracy(labels: Sequence[int], preds: Sequence[int]) -> dict:
    return {"accuracy": float(skm.accuracy_score(labels, preds))}


def mcc(labels: Sequence[int], preds: Sequence[int]) -> dict:
    return {"mcc": float(skm.matthews_corrcoef(labels, preds)), **accuracy(labels, preds)}


def f1_accuracy(labels: Sequence[int], preds: Sequence[int]) -> dict:
    """F1 of the positive class (label 1), as GLUE reports for MRPC and QQP, and accuracy."""
    f1 = skm.f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0)
    return {"f1": float(f1), **accuracy(labels, preds)}


def pearson_spearman(labels: Sequence[float], preds: Sequence[float]) -> dict:
    """STS-B; a constant prediction has no defined correlation and scores 0, not NaN."""
    labels, preds = np.asarray(labels, dtype=float), np.asarray(preds, dtype=float)
    if np.ptp(preds) == 0 or np.ptp(labels) == 0:
        return {"pearson": 0.0, "spearman": 0.0}
    return {
        "pearson": float(stats.pearsonr(labels, preds)[0]),
        "spearman": float(stats.spearmanr(labels, preds)[0]),
    }


def multirc_metrics(
    labels: Sequence[int], preds: Sequence[int], groups: Iterable[Hashable]
) -> dict:
    """F1a over all answer options and EM over questions (`groups` names each option's question)."""
    per_question: dict = collections.defaultdict(list)
    for label, pred, group in zip(labels, preds, groups, strict=True):
        per_question[group].append(label == pred)
    em = float(np.mean([all(v) for v in per_question.values()])) if per_question else 0.0
    f1a = skm.f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0)
    return {"f1a": float(f1a), "em": em, **accuracy(labels, preds)}


def class_report(labels: Sequence[int], preds: Sequence[int], names: Sequence[str]) -> dict:
    """Per-class precision, recall, support (gold count) and predicted count, and the confusion
    matrix (rows: gold class, columns: predicted class, in label-id order): a class the model
    never predicts shows as a column of zeros."""
    ids = list(range(len(names)))
    p, r, _, support = skm.precision_recall_fscore_support(
        labels, preds, labels=ids, zero_division=0.0
    )
    confusion = skm.confusion_matrix(labels, preds, labels=ids)
    per_class = {
        name: {
            "precision": float(p[i]),
            "recall": float(r[i]),
            "support": int(support[i]),
            "predicted": int(confusion[:, i].sum()),
        }
        for i, name in enumerate(names)
    }
    return {"per_class": per_class, "confusion": confusion.tolist()}


MAX_NAMED = 10  # the labels a learned-nothing warning names at most
SPAN_MARGIN = 1.0  # F1 points (of 100) a span model must beat its question-blind baseline by
# correlation a regression model must beat a constant prediction's (0) by: below it, the
# predictions barely track the scores (real STS-B models reach 0.8 and more)
REGRESSION_MARGIN = 0.1
ADVICE = "raise --lr (docs/finetune.md: the lr rule for small models) or train longer"


def learned_nothing(best: Mapping, main: str) -> str | None:
    """A warning when the best evaluation's `main` score is no better than a prediction that
    ignores the input: always the training set's majority class (its `majority_{main}`), its
    mean score for regression (`mean_{main}`), or for span tasks the same answer for every
    question of a paragraph (`question_blind_{main}`); else None."""
    if f"question_blind_{main}" in best:
        return _span_learned_nothing(best, main)
    if f"mean_{main}" in best:
        baseline, what = best[f"mean_{main}"], "the training set's mean score"
        compared, margin = f"less than {REGRESSION_MARGIN:g} above", REGRESSION_MARGIN
    elif f"majority_{main}" in best:
        baseline, what = best[f"majority_{main}"], "the majority class"
        compared, margin = "no better than", 1e-9
    else:
        return None
    if best[main] > baseline + margin:
        return None
    per_class = best.get("per_class", {})
    never = [k for k, v in per_class.items() if v["predicted"] == 0]
    named = ", ".join(never[:MAX_NAMED]) + (
        f" and {len(never) - MAX_NAMED} more" if len(never) > MAX_NAMED else ""
    )
    scores = len(per_class) > 2 and all_numbers(per_class)
    return (
        f"warning: the best {main} {best[main]:.4f} (step {best['step']}) is {compared} "
        f"always predicting {what} ({baseline:.4f}): the model learned nothing"
        + (f" (never predicted: {named})" if never else "")
        + f"; {ADVICE}"
        + ("; if the labels are scores, not classes, add --regression" if scores else "")
    )


def all_numbers(labels: Iterable[str]) -> bool:
    """Every label reads as a number (a float)."""
    try:
        [float(x) for x in labels]
    except ValueError:
        return False
    return True


def _span_learned_nothing(best: Mapping, main: str) -> str | None:
    baseline, own = best[f"question_blind_{main}"], best[f"shared_{main}"]
    if own >= baseline + SPAN_MARGIN:
        return None
    return (
        f"warning: the best {main} {best[main]:.1f} (step {best['step']}; {own:.1f} on the "
        f"questions that share a paragraph) is no better than answering every question of a "
        f"paragraph the same ({baseline:.1f}; {best.get('same_answer_share', 0.0):.0%} of those "
        "questions got their paragraph's common answer): the model learned nothing from the "
        f"questions; {ADVICE}"
    )


# Which function scores each classification-style task, and which of its numbers picks the best
# checkpoint. SQuAD is scored by `squad_metrics` (main: f1).
CLASSIFICATION_METRICS: dict[str, Callable[..., dict]] = {
    "cola": mcc,
    "sst2": accuracy,
    "mrpc": f1_accuracy,
    "qqp": f1_accuracy,
    "stsb": pearson_spearman,
    "mnli": accuracy,
    "qnli": accuracy,
    "rte": accuracy,
    "boolq": accuracy,
    "multirc": multirc_metrics,
}

MAIN_METRIC: dict[str, str] = {
    "cola": "mcc",
    "sst2": "accuracy",
    "mrpc": "f1",
    "qqp": "f1",
    "stsb": "spearman",
    "mnli": "accuracy",
    "qnli": "accuracy",
    "rte": "accuracy",
    "boolq": "accuracy",
    "multirc": "f1a",
    "squad": "f1",
}
