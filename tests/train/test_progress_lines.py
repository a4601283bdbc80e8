"""An evaluation in a log (stderr not a terminal) shows a plain progress line every
LINE_EVERY_S seconds, no carriage returns; finetuning's predict goes through it."""

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
