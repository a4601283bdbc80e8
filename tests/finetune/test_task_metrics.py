"""Metric functions against cases worked out by hand."""

import math

import pytest

from shatter.train.finetuning import metrics as m


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple,  a pear!  ", "apple pear"),
        ("Theatre", "theatre"),  # 'the' only as a whole word
        ("U.S.A.", "usa"),
        ("a", ""),
    ],
)
def test_squad_normalisation(raw, normalised):
    assert m.normalize_answer(raw) == normalised


def test_squad_em_and_f1_by_hand():
    # 'the big red dog' vs 'big dog': normalised 'big red dog' vs 'big dog': 2 common tokens,
    # precision 2/3, recall 2/2 -> F1 = 0.8.
    assert m.squad_f1("the big red dog", "Big dog.") == pytest.approx(0.8)
    assert m.squad_exact_match("The Big Dog", "big dog!") == 1.0
    assert m.squad_f1("cat", "dog") == 0.0


def test_squad_metrics_max_over_golds_and_missing_predictions():
    golds = {"q1": ["Denver Broncos", "the Broncos"], "q2": ["1990"], "q3": ["blue whale"]}
    preds = {"q1": "Broncos", "q2": "in 1990"}  # q3 unanswered
    got = m.squad_metrics(preds, golds)
    # q1: EM 1 against 'the Broncos'; q2: EM 0, F1 2*(1/2*1)/(1/2+1) = 2/3; q3: 0.
    assert got["exact_match"] == pytest.approx(100 / 3)
    assert got["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)


def test_mcc_by_hand():
    labels, preds = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]
    tp, tn, fp, fn = 2, 1, 1, 1
    want = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert m.mcc(labels, preds)["mcc"] == pytest.approx(want)


def test_f1_accuracy_by_hand():
    got = m.f1_accuracy([1, 1, 0, 0], [1, 0, 1, 0])
    assert got == {"f1": pytest.approx(0.5), "accuracy": pytest.approx(0.5)}


def test_pearson_spearman_by_hand():
    got = m.pearson_spearman([1.0, 2.0, 3.0, 4.0], [1.0, 4.0, 9.0, 16.0])
    assert got["spearman"] == pytest.approx(1.0)
    assert 0.9 < got["pearson"] < 1.0
    assert m.pearson_spearman([1.0, 2.0], [3.0, 3.0]) == {"pearson": 0.0, "spearman": 0.0}


def test_multirc_f1a_and_em_by_hand():
    labels = [1, 0, 1, 1, 0]
    preds = [1, 0, 0, 1, 0]
    groups = ["q1", "q1", "q2", "q2", "q3"]
    got = m.multirc_metrics(labels, preds, groups)
    # F1a: tp 2, fp 0, fn 1 -> 0.8; EM: q1 and q3 all right, q2 not -> 2/3.
    assert got["f1a"] == pytest.approx(0.8)
    assert got["em"] == pytest.approx(2 / 3)


def test_every_task_has_a_main_metric_its_scorer_reports():
    for task, fn in m.CLASSIFICATION_METRICS.items():
        if task == "multirc":
            out = fn([0, 1], [0, 1], ["a", "b"])
        elif task == "stsb":
            out = fn([0.0, 1.0, 2.0], [0.0, 1.0, 2.5])
        else:
            out = fn([0, 1], [0, 1])
        assert m.MAIN_METRIC[task] in out, task


def _paragraphs(answer_of):
    """Two paragraphs of three questions each; `answer_of(qid, gold)` is the prediction."""
    golds = {f"p{p}q{q}": [f"answer{p}{q}"] for p in range(2) for q in range(3)}
    contexts = {qid: f"paragraph {qid[1]}" for qid in golds}
    return {qid: answer_of(qid, g[0]) for qid, g in golds.items()}, golds, contexts


def test_a_question_blind_span_model_is_warned_of():
    """Every question of a paragraph answered the same (one right, two wrong): F1 no better than
    the question-blind baseline, so the run learned nothing from the questions."""
    preds, golds, contexts = _paragraphs(lambda qid, gold: f"answer{qid[1]}0")
    scores = {**m.squad_metrics(preds, golds), **m.question_blind(preds, golds, contexts)}
    assert scores["same_answer_share"] == 1.0
    assert scores["question_blind_f1"] == pytest.approx(scores["f1"]) == scores["shared_f1"]
    warning = m.learned_nothing({**scores, "step": 7}, "f1")
    assert warning and "answering every question of a paragraph the same" in warning
    assert "100% of those questions" in warning and "step 7" in warning


def test_a_span_model_that_reads_the_questions_is_not_warned_of():
    preds, golds, contexts = _paragraphs(lambda qid, gold: gold)
    scores = {**m.squad_metrics(preds, golds), **m.question_blind(preds, golds, contexts)}
    assert scores["f1"] == 100.0 and scores["question_blind_f1"] < 50.0
    assert scores["same_answer_share"] == pytest.approx(1 / 3)
    assert m.learned_nothing({**scores, "step": 1}, "f1") is None


def test_the_learned_nothing_warning_names_at_most_ten_labels():
    per_class = {f"{i / 7:.4f}": {"predicted": 0} for i in range(1381)}
    best = {"accuracy": 0.001, "majority_accuracy": 0.002, "step": 3, "per_class": per_class}
    warning = m.learned_nothing(best, "accuracy")
    assert "and 1371 more" in warning and len(warning) < 500, len(warning)
    assert "\n" not in warning and warning.endswith("add --regression")


@pytest.mark.parametrize(
    "labels, hint",
    [(("1", "2", "3", "4", "5"), True), (("0", "1"), False), (("neg", "neutral", "pos"), False)],
    ids=["stars", "glue-binary", "words"],
)
def test_numeric_classes_that_learned_nothing_point_at_regression(labels, hint):
    """More than two labels, all numbers: perhaps a score read as classes, so the warning names
    --regression; GLUE's 0/1 and named classes do not get that hint."""
    per_class = {label: {"predicted": 0 if label != labels[0] else 9} for label in labels}
    best = {"accuracy": 0.2, "majority_accuracy": 0.2, "step": 5, "per_class": per_class}
    warning = m.learned_nothing(best, "accuracy")
    assert "learned nothing" in warning and ("--regression" in warning) == hint, warning


def test_a_regression_no_better_than_its_training_mean_is_warned_of():
    """A constant prediction (the training mean) correlates 0 with the gold scores; a best
    Spearman less than REGRESSION_MARGIN above that learned nothing."""
    assert m.pearson_spearman([1.0, 3.0, 2.0], [2.0, 2.0, 2.0])["spearman"] == 0.0
    best = {"spearman": 0.05, "pearson": 0.1, "mean_spearman": 0.0, "step": 4}
    warning = m.learned_nothing(best, "spearman")
    assert "less than 0.1 above always predicting the training set's mean score" in warning
    assert "the model learned nothing" in warning and "--lr" in warning
    assert m.learned_nothing({**best, "spearman": 0.6}, "spearman") is None


def test_one_question_per_paragraph_has_no_question_blind_baseline():
    """Each paragraph asked once: answering blind is answering, so there is nothing to compare
    and no warning (the F1 alone says how it did)."""
    golds = {f"q{i}": [f"word{i}"] for i in range(4)}
    contexts = {q: f"paragraph {q}" for q in golds}
    preds = {q: "nothing" for q in golds}
    assert m.question_blind(preds, golds, contexts) == {}
    scores = {**m.squad_metrics(preds, golds), "step": 1}
    assert m.learned_nothing(scores, "f1") is None
