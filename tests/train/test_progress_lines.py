"""An evaluation in a log (stderr not a terminal) shows a plain progress line every
LINE_EVERY_S seconds, no carriage returns; on a terminal a bar, and RUN/train.log gets the lines
either way; finetuning's predict goes through it."""

import io
import logging
import sys
import warnings

import torch

from shatter.train import metrics
from shatter.train.finetuning.loop import predict


def test_a_piped_evaluation_prints_a_line_every_interval(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "LINE_EVERY_S", 0.0)
    assert list(metrics.counted(iter(range(3)), 3, "evaluate validation")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "evaluate validation: 3/3 batches" in err and "\r" not in err, err
    assert list(metrics.counted(range(3), 3, "quiet", show=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_shows_and_train_log_gets_the_lines(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(sys, "stderr", Terminal())
    handler = logging.FileHandler(tmp_path / "train.log")
    level = metrics.log.level
    metrics.log.addHandler(handler)
    metrics.log.setLevel(logging.INFO)
    try:
        assert list(metrics.counted(range(3), 3, "evaluate")) == [0, 1, 2]
    finally:
        metrics.log.removeHandler(handler)
        metrics.log.setLevel(level)
        handler.close()
    assert "evaluate: 3/3 batches" in (tmp_path / "train.log").read_text()
    shown = sys.stderr.getvalue()
    assert "\r" in shown and "batches," not in shown, shown  # the bar, not the lines


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask):
        return {"logits": input_ids.float()[:, :2] + self.w}


class Data:
    eval_features = [{"input_ids": [i, i + 1]} for i in range(5)]

    @staticmethod
    def collate(chunk):
        ids = torch.tensor([f["input_ids"] for f in chunk])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_finetuning_evaluation_shows_progress_in_a_log(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "LINE_EVERY_S", 0.0)
    outputs = predict(Logits(), Data(), batch_size=2, show=True)
    assert len(outputs["logits"]) == 5
    assert "evaluate: 3/3 batches" in capsys.readouterr().err


def test_a_second_run_in_one_process_logs_to_its_own_train_log(tmp_path):
    """Two runs in one process (an API caller's, the in-process tests'): each run's lines go
    to its own RUN/train.log, none to the first's; the same run again keeps its one handler."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    before = list(metrics.log.handlers)
    state = metrics.log.level, metrics.log.propagate, warnings.showwarning
    try:
        metrics.log_to_run(first, 0)
        metrics.log.info("line of a")
        metrics.log_to_run(second, 0)
        metrics.log_to_run(second, 0)
        metrics.log.info("line of b")
        ours = [h for h in metrics.log.handlers if getattr(h, "shatter_run", False)]
        assert len(ours) == 1
    finally:
        for handler in set(metrics.log.handlers) - set(before):
            metrics.log.removeHandler(handler)
            handler.close()
        metrics.log.level, metrics.log.propagate, warnings.showwarning = state
    a, b = ((d / metrics.LOG_FILE).read_text() for d in (first, second))
    assert "line of a" in a and "line of b" not in a and "line of b" in b, (a, b)
