"""README claims a test can keep: the throughput table says its attention-dropout setting, the
presets' default that its runs used, since BERT's tokens/s depends on it."""

import re
from pathlib import Path

from shatter.config import ModelConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_throughput_table_states_its_attention_dropout():
    caption = README[: README.index("| model | parameters | validation MLM loss | tokens/s |")]
    stated = re.search(r"attention dropout ([0-9.]+)", caption.split("**What it gives**")[1])
    assert stated, "the table's caption must state the attention dropout its runs used"
    assert float(stated.group(1)) == ModelConfig.attention_dropout
    assert "attention_dropout: 0" in README  # and says what changes without it
