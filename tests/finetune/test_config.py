"""The finetuning config: the paper's defaults per task, YAML sections, unknown keys rejected."""

import pytest

from shatter.train.config import ConfigError
from shatter.train.finetuning.config import resolve

BASE = {"task": "sst2", "train_file": "t.tsv", "checkpoint": "ck", "output": "run"}


def test_paper_defaults():
    cfg = resolve(None, BASE)
    assert cfg.optim.lr == 5e-6  # CoLA and SST-2 (§4.2.1)
    assert resolve(None, {**BASE, "task": "mnli"}).optim.lr == 1e-5
    assert (
        cfg.run.batch_size == 16
        and cfg.run.eval_every == 1000
        and cfg.run.cls_strategy == "modified"
    )
    assert resolve(None, {**BASE, "lr": 3e-5}).optim.lr == 3e-5
    assert cfg.run.zero_stage == 0  # fp32; bf16/fp16 default to ZeRO-1, as pretraining
    assert resolve(None, {**BASE, "precision": "bf16"}).run.zero_stage == 1
    assert resolve(None, {**BASE, "precision": "bf16", "zero_stage": 0}).run.zero_stage == 0


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text(
        "data:\n  text_columns: [a, b]\n  label_column: y\noptim:\n  lr: 2.0e-5\nrun:\n  eval_every: 50\n"
    )
    cfg = resolve(str(path), {**BASE, "task": "classify", "eval_every": 10})
    assert cfg.data.text_columns == ("a", "b") and cfg.optim.lr == 2e-5 and cfg.run.eval_every == 10


def test_rejects_unknown_keys_and_bad_values(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text("run:\n  batchsize: 8\n")
    with pytest.raises(ConfigError, match=r"ft.yaml \[run\].*unknown key"):
        resolve(str(path), BASE)
    with pytest.raises(ConfigError, match="--task must be one of"):
        resolve(None, {**BASE, "task": "glue"})
    with pytest.raises(ConfigError, match="zero-stage"):
        resolve(None, {**BASE, "zero_stage": 3})


def test_yaml_problems_are_config_errors_like_pretraining(tmp_path):
    """The finetuning YAML is read by shatter.train.config.read_yaml, as the pretraining one."""
    path = tmp_path / "ft.yaml"
    path.write_text("run: 8\n")  # used to be a bare ValueError from dict(8)
    with pytest.raises(ConfigError, match=r"ft.yaml: section 'run' must be a mapping"):
        resolve(str(path), BASE)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        resolve(str(path), BASE)
    path.write_text("train:\n  lr: 1\n")
    with pytest.raises(ConfigError, match=r"unknown section\(s\) \['train'\]"):
        resolve(str(path), BASE)
    with pytest.raises(ConfigError, match="config file not found"):
        resolve(str(tmp_path / "nowhere.yaml"), BASE)


def test_each_flag_is_declared_once_on_its_config_field():
    """train/finetune.py's flags, FLAGS and docs/finetune.md's table come from the option()
    fields: a flag given on the command line lands in its field."""
    from pathlib import Path

    from shatter.options import docs_table
    from shatter.train.finetune import main
    from shatter.train.finetuning.config import FLAGS, SECTIONS

    table = docs_table(SECTIONS)
    docs = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
    assert table in docs.read_text(), (
        "docs/finetune.md's flag table is not the declared one: paste the output of python -c "
        "'from shatter.options import docs_table; from shatter.train.finetuning.config import SECTIONS; "
        "print(docs_table(SECTIONS))'"
    )
    params = {p.name: p for p in main.params}
    assert set(FLAGS) <= set(params) and FLAGS["weight_decay"] == "optim.weight_decay"
    assert all(params[name].default is None for name in FLAGS)  # unset: the config file's value
    args = ["--task", "sst2", "--train-file", "t.tsv", "--checkpoint", "ck", "--output", "run"]
    args += ["--weight-decay", "0.1", "--zero-stage", "2", "--labels", "a,b", "--no-regression"]
    parsed = main.make_context("finetune.py", args).params
    cfg = resolve(None, {k: v for k, v in parsed.items() if k in FLAGS})
    assert cfg.optim.weight_decay == 0.1 and cfg.run.zero_stage == 2
    assert cfg.data.labels == ("a", "b") and cfg.data.regression is False
    with pytest.raises(Exception, match="3 is not in the range"):
        main.make_context("finetune.py", [*args, "--zero-stage", "3"])
