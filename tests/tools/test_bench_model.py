"""tools/bench/bench_model.py runs end to end on the CPU: every contender, both timings, the memory."""

import pytest
from click.testing import CliRunner

from shatter.tools.bench.bench_model import main


@pytest.mark.slow  # ~14 s on the loaded 2-core box
def test_bench_model_runs_every_cpu_impl_and_prints_markdown():
    args = "--size tiny --layers 1 --lengths 16 --batch-tokens 32 --vocab-size 50 --repeats 1 --warmup 0"
    result = CliRunner().invoke(
        main, [*args.split(), "--archs", "bert,shatter,bert-rab,xlnet", "--markdown"]
    )
    assert result.exit_code == 0, result.output
    labels = (
        "bert-nodrop",
        "shatter[chunked]",
        "shatter[lean]",
        "shatter[naive]",
        "bert-rab",
        "xlnet",
    )
    for label in labels:
        assert f"| {label} |" in result.output
    assert "attention fwd+bwd s (ratio to bert)" in result.output
    assert "train tokens/s (ratio to bert)" in result.output  # the README's column
    assert "load average before: " in result.output
    assert "| bert | " in result.output and "(1.00)" in result.output


def test_bench_model_rejects_an_impl_the_device_cannot_run():
    result = CliRunner().invoke(main, ["--impls", "triton", "--lengths", "16"])
    assert result.exit_code != 0
    assert "do not run on cpu" in result.output
