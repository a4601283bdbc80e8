"""README claims a test can keep: the throughput table's two tokens/s columns are BERT with the
presets' attention dropout and without it, as the bench command beside the table measures them
(BERT's tokens/s depends on it); Shatter's one figure serves both, since its attention has no
dropout; the prose's ratio is the table's."""

import re
import shlex
from pathlib import Path

import torch

import shatter
from shatter.config import ModelConfig
from shatter.tools.bench import bench_model

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
HEADER = "| model | parameters | validation MLM loss | train tokens/s, attention dropout"


def table() -> dict[str, list[str]]:
    """The throughput table's rows by model: its cells after the model's name."""
    lines = README[README.index(HEADER) :].splitlines()[2:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[: lines.index("")]]
    return {row[0]: row[1:] for row in rows}


def bench_command() -> list[str]:
    """The bench_model command of the README's first bash block after the table."""
    after = README[README.index(HEADER) :]
    block = after[after.index("```bash\n") + 8 :].split("```")[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["python", "tools/bench/bench_model.py"], argv
    return argv[2:]


def test_the_throughput_table_states_both_attention_dropout_settings():
    header = README[README.index(HEADER) :].splitlines()[0]
    stated = [float(x) for x in re.findall(r"attention dropout ([0-9.]+)", header)]
    assert stated == [ModelConfig.attention_dropout, 0.0], header
    # the command beside it measures just these: bert at the presets' default, bert-nodrop at 0
    params = bench_model.main.make_context("bench_model", bench_command()).params
    assert params["attention_dropout"] == ModelConfig.attention_dropout
    assert params["archs"] == "bert,shatter" and params["size"] == "tiny"
    cpu = torch.device("cpu")
    bench = bench_model.contenders(("bert", "shatter"), ("lean",), cpu, 0.1)
    nodrop = {c.label: dict(c.overrides) for c in bench}["bert-nodrop"]
    assert nodrop["attention_dropout"] == 0.0


def test_the_prose_ratio_is_the_tables():
    rows = table()
    bert_nodrop, shatter_tokens = (int(rows[m][-1].replace(",", "")) for m in ("BERT", "Shatter"))
    assert f"({bert_nodrop / shatter_tokens:.2f}× Shatter)" in README


def _train_mode_output(arch: str, attention_dropout: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = shatter.build_model(f"{arch}-tiny", vocab_size=50, attention_dropout=attention_dropout)
    ids = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the same dropout draws, where both models draw the same
    with torch.no_grad():
        return model.train()(input_ids=ids)["logits"]


def test_shatter_has_one_figure_because_its_attention_has_no_dropout():
    rows = table()
    assert rows["Shatter"][-2] == rows["Shatter"][-1]
    assert rows["BERT"][-2] != rows["BERT"][-1]
    same = torch.equal(*(_train_mode_output("shatter", p) for p in (0.1, 0.0)))
    assert same, "Shatter's attention_dropout changed its train-mode output"
    assert not torch.equal(*(_train_mode_output("bert", p) for p in (0.1, 0.0)))
