"""One declaration per option (shatter/options.py): a config field's `option(...)` gives its
click option, its flag-to-field entry and its docs row; `shatter-data build`'s options are
BuildConfig's fields."""

from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from shatter.options import click_options, declared, docs_table, flag_fields, option
from shatter.pipeline.config import BuildConfig, InputSpec

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Toy:
    name: str = option(help="Required.", required=True)
    steps: int = option(3, "Steps.", min=1)
    mode: str = option("a", "A mode.", choices=("a", "b"), doc="`a` or `b`")
    fast: bool = option(True, "Go fast.")
    impl: str = option("x", "Which.", flag="--toy-impl")
    budget: float = option(1.5, "Config only.", flag="")
    plain: int = 0  # no option


def test_a_declared_field_gives_its_option_its_field_and_its_docs_row():
    @click.command()
    @click_options(Toy, defaults=True)
    def command(**kw):
        click.echo(repr(Toy(**kw)))

    assert flag_fields(Toy) == {
        "name": "name",
        "steps": "steps",
        "mode": "mode",
        "fast": "fast",
        "toy_impl": "impl",
    }
    got = command.make_context("toy", ["--name", "n", "--no-fast", "--toy-impl", "y"]).params
    assert got == {"name": "n", "steps": 3, "mode": "a", "fast": False, "toy_impl": "y"}
    for bad in (["--name", "n", "--steps", "0"], ["--name", "n", "--mode", "c"], ["--fast"]):
        with pytest.raises(click.UsageError):  # a range, a choice, a required option
            command.make_context("toy", bad)
    table = docs_table(Toy)
    assert "| `--mode` | `mode` | `a` or `b` |" in table
    assert "| `--fast`, `--no-fast` | `fast` | go fast |" in table
    assert "| (config only) | `budget` | config only |" in table and "plain" not in table

    @click.command()
    @click_options({"run": Toy}, defaults=False)
    def unset(**kw):
        pass

    params = unset.make_context("toy", ["--name", "n"]).params
    assert params["steps"] is None and params["fast"] is None  # not given: the file's value stands
    assert flag_fields({"run": Toy})["toy_impl"] == "run.impl"


def test_shatter_data_build_declares_build_configs_fields_once():
    from shatter.pipeline.cli import build

    params = {p.name: p for p in build.params}
    fields = {d.param: d for d in declared(BuildConfig)}
    assert len(fields) == 23 and set(fields) <= set(params)
    assert len(params) == 30  # and --corpus, --input, --wiki-index, --validation-input, ...
    for name, d in fields.items():
        assert d.how.required or params[name].default == d.default, name
    args = ["--input", "x", "--output", "o", "--seq-len", "64", "--no-cross-document"]
    parsed = build.make_context("build", args).params
    inputs = (InputSpec("text", "x"),)
    config = BuildConfig(inputs=inputs, **{k: parsed[k] for k in fields})
    assert config == BuildConfig(inputs, "o", seq_len=64, cross_document=False)
    # an alias is the same option; a flag's docs row names it
    given = ["--input", "x", "--output", "o", "--text-column", "body"]
    aliased = build.make_context("build", given).params
    assert aliased["text_field"] == "body"
    table = docs_table(BuildConfig)
    assert "| `--text-field`, `--text-column` | `text_field` |" in table
    assert table in (REPO / "docs" / "pipeline.md").read_text(), (
        "docs/pipeline.md's option table is not the declared one: paste the output of "
        "python -c 'from shatter.options import docs_table; from shatter.pipeline.config import "
        "BuildConfig; print(docs_table(BuildConfig))'"
    )


def test_a_repeatable_option_gives_a_tuple():
    @dataclass(frozen=True)
    class Mixed:
        data: tuple = option((), "Datasets.", multiple=True)

    @click.command()
    @click_options(Mixed, defaults=False)
    def command(**kw):
        pass

    assert command.make_context("m", ["--data", "a:3", "--data", "b:1"]).params == {
        "data": ("a:3", "b:1")
    }
    assert command.make_context("m", []).params == {"data": ()}
