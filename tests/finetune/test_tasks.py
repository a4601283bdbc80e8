"""Readers of the official formats, on files written here in those formats."""

import json

import pytest

from shatter.train.finetuning.data import looks_like_scores
from shatter.train.finetuning.tasks import (
    TASKS,
    TaskDataError,
    read_boolq,
    read_classify,
    read_glue,
    read_multirc,
    read_squad,
)


def test_glue_tsv_keeps_quotes_literal_and_counts_malformed_lines(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text(
        "sentence\tlabel\n"
        '"a quoted start and no closing quote\t1\n'  # a csv reader would swallow the next lines
        "plain text\t0\n"
        "a line with\ttoo many\tfields\n"
        "\t1\n"  # empty sentence
        "unknown label\t7\n"
        'it\'s "fine" really\t1\n'
    )
    ex = read_glue(TASKS["sst2"], path)
    assert ex.dataset["text_a"] == [
        '"a quoted start and no closing quote',
        "plain text",
        'it\'s "fine" really',
    ]
    assert ex.dataset["label"] == ["1", "0", "1"]
    assert sum(ex.skipped.values()) == 3
    assert ex.skipped["malformed line (wrong number of tab-separated fields)"] == 1


def test_cola_has_no_header(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(
        "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n"
    )
    ex = read_glue(TASKS["cola"], path)
    assert ex.dataset["text_a"] == ["Our friends won't buy this analysis.", "They drank the pub."]
    assert ex.dataset["label"] == ["1", "0"]


def test_stsb_and_mnli_columns(tmp_path):
    sts = tmp_path / "sts.tsv"
    sts.write_text(
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
        "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking off.\t5.000\n"
    )
    ex = read_glue(TASKS["stsb"], sts)
    assert ex.dataset["label"] == [5.0] and ex.dataset["text_b"] == ["An air plane is taking off."]
    mnli = tmp_path / "dev_matched.tsv"
    mnli.write_text(
        "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse"
        "\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
        "0\t1\t1e\tgov\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tThe cat sat.\tA cat sat.\tentailment\tentailment\n"
        "1\t2\t2n\tgov\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tNo.\tYes.\tneutral\t-\n"
    )
    ex = read_glue(TASKS["mnli"], mnli)
    assert ex.dataset["label"] == ["entailment"] and ex.skipped  # '-' (no gold label) is counted


def test_missing_column_names_the_file(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text("text\tlabel\nhello\t1\n")
    with pytest.raises(TaskDataError, match="dev.tsv.*missing column"):
        read_glue(TASKS["sst2"], path)


def test_squad_reader(tmp_path):
    context = "Denver won the game in 2016."
    data = {
        "version": "1.1",
        "data": [
            {
                "title": "t",
                "paragraphs": [
                    {
                        "context": context,
                        "qas": [
                            {
                                "id": "a",
                                "question": "Who won?",
                                "answers": [{"text": "Denver", "answer_start": 0}],
                            },
                            {
                                "id": "b",
                                "question": "When?",
                                "answers": [{"text": "2016", "answer_start": 3}],
                            },  # shifted
                            {
                                "id": "c",
                                "question": "Why?",
                                "answers": [{"text": "luck", "answer_start": 0}],
                            },
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(data))
    ex = read_squad(path)
    assert ex.dataset["id"] == ["a", "b"]
    assert ex.dataset["answer_start"] == [0, context.index("2016")]
    assert json.loads(ex.dataset["label"][0]) == ["Denver"]
    assert ex.skipped["answer text not found in context"] == 1
    assert sum(ex.skipped.values()) == 1, "a row kept after correcting its offset is not skipped"
    assert ex.corrected == {"answer_start (the answer text found elsewhere)": 1}


def test_boolq_and_multirc(tmp_path, write_jsonl):
    boolq = write_jsonl(
        tmp_path / "val.jsonl",
        [
            {"question": "is it", "passage": "it is", "idx": 0, "label": True},
            {"question": "is it not", "passage": "it is", "idx": 1, "label": False},
        ],
    )
    ex = read_boolq(boolq)
    assert ex.dataset["label"] == ["true", "false"]
    multirc = write_jsonl(
        tmp_path / "mrc.jsonl",
        [
            {
                "idx": 7,
                "version": 1.1,
                "passage": {
                    "text": "P.",
                    "questions": [
                        {
                            "idx": 0,
                            "question": "Q0?",
                            "answers": [
                                {"idx": 0, "text": "A", "label": 1},
                                {"idx": 1, "text": "B", "label": 0},
                            ],
                        },
                        {
                            "idx": 1,
                            "question": "Q1?",
                            "answers": [{"idx": 2, "text": "C", "label": 0}],
                        },
                    ],
                },
            }
        ],
    )
    ex = read_multirc(multirc)
    assert ex.dataset["id"] == ["7-0-0", "7-0-1", "7-1-2"]
    assert ex.dataset["group"] == ["7-0", "7-0", "7-1"]
    assert ex.dataset["text_b"][0] == "Q0? A" and ex.dataset["label"] == ["1", "0", "0"]


def test_classify_csv_and_jsonl(tmp_path, write_jsonl):
    csv_path = tmp_path / "reviews.csv"
    csv_path.write_text(
        'text,title,label\n"Great, really",t1,pos\n,t2,neg\n"Bad",t3,\n"Meh",t4,neg\n'
    )
    ex = read_classify(csv_path, ("text",), "label")
    assert ex.dataset["text_a"] == ["Great, really", "Meh"] and ex.dataset["label"] == [
        "pos",
        "neg",
    ]
    assert ex.skipped == {"empty text": 1, "empty label": 1}
    pair = read_classify(csv_path, ("text", "title"), "label")
    assert pair.dataset["text_b"] == ["t1", "t4"]
    jl = write_jsonl(tmp_path / "scores.jsonl", [{"a": "x", "y": 0.5}, {"a": "z", "y": "n/a"}])
    reg = read_classify(jl, ("a",), "y", regression=True)
    assert reg.dataset["label"] == [0.5] and reg.skipped["unparseable regression label"] == 1
    with pytest.raises(TaskDataError, match="scores.jsonl.*missing column"):
        read_classify(jl, ("a",), "label")


def test_real_rotten_tomatoes_reads(shared_data):
    ex = read_classify(
        shared_data / "finetune" / "rotten_tomatoes_corpus.csv.bz2", ("text",), "category"
    )
    assert set(ex.dataset["label"]) == {"fresh", "rotten", "plot"}
    assert len(ex.dataset) > 5000


@pytest.mark.parametrize(
    "labels, rows, scores",
    [
        ([f"{i * 0.37:.2f}" for i in range(30)], 30, True),  # every row its own float
        ([f"{i * 0.2:.1f}" for i in range(26)], 400, True),  # STS-B-like steps: fractional
        ([str(i) for i in range(1381)], 1500, True),  # integers, mostly distinct
        ([str(i) for i in range(1, 6)], 400, False),  # 1-5 stars
        ([f"{i * 0.5:.1f}" for i in range(1, 11)], 400, False),  # ten half-stars: still classes
        ([str(i) for i in range(40)], 4000, False),  # 40 integer class ids
        ([f"c{i}" for i in range(40)], 40, False),  # names, not numbers
    ],
    ids=["distinct", "fractional", "integers", "stars", "half-stars", "ids", "names"],
)
def test_which_numeric_labels_look_like_a_score(labels, rows, scores):
    assert looks_like_scores(labels, rows) == scores
