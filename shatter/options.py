"""One declaration per command-line option: the config field, with its flag and help beside it.

A config dataclass declares an option as `name: int = option(8, "help text")`. From that one
line come the field (its type and default), the command's click option (`click_options`), the
map from the command's parameters to the fields (`flag_fields`) and a docs table row
(`docs_table`). Adding an option is adding such a field. Beam-free and torch-free: both the
data pipeline's CLI and the trainers use it.

    @dataclass(frozen=True)
    class RunArgs:
        max_steps: int = option(1000, "Optimizer steps of the run.", doc="the lr reaches 0 here")
        gpu_memory_gb: float = option(16.0, "...", flag="")  # in the config file only
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line and in the docs."""

    help: str  # the --help text
    doc: str = ""  # the docs table's last column; "" = the help text
    flag: str | None = None  # None: "--" + the field name with dashes; "": config file only
    aliases: tuple[str, ...] = ()  # further flags of the same option ("--text-column")
    choices: tuple[str, ...] = ()  # the values accepted (click.Choice)
    min: float | None = None  # a range (click.IntRange / FloatRange by the field's type)
    max: float | None = None
    min_open: bool = False  # the range excludes `min`
    file: bool = False  # a file path (click.Path(dir_okay=False))
    multiple: bool = False  # repeatable: click gives a tuple of the values, () when not given
    required: bool = False


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **how: Any) -> Any:
    """A dataclass field declared as a command-line option (`Option`'s fields as keywords)."""
    return dataclasses.field(
        default=default, default_factory=factory, metadata={"option": Option(help, **how)}
    )


@dataclass(frozen=True)
class Declared:
    """One declared option of a config: where its field is and how it is spelt."""

    param: str  # the click parameter name: the flag without dashes, "-" as "_"
    flag: str  # "--max-steps"; "" for a config-file-only field
    path: str  # the field: "run.max_steps" in a sectioned config, "max_steps" in a flat one
    type: str  # the field's annotation, e.g. "int | None"
    default: Any
    how: Option


def declared(config: type | Mapping[str, type]) -> list[Declared]:
    """The declared options of a dataclass, or of a config's sections {name: dataclass}."""
    sections = config if isinstance(config, Mapping) else {"": config}
    found = []
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            how = f.metadata.get("option")
            if how is None:
                continue
            flag = "--" + f.name.replace("_", "-") if how.flag is None else how.flag
            default = f.default if f.default_factory is MISSING else f.default_factory()
            default = None if default is MISSING else default  # a required field
            path = f"{section}.{f.name}" if section else f.name
            found.append(
                Declared(flag[2:].replace("-", "_"), flag, path, _spelt(f.type), default, how)
            )
    return found


def _spelt(annotation: Any) -> str:
    """A field's annotation as written ("int | None"), also without `from __future__ import
    annotations`."""
    if isinstance(annotation, str):
        return annotation
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def flag_fields(config: type | Mapping[str, type]) -> dict[str, str]:
    """{click parameter name: field path} of the options that have a flag."""
    return {d.param: d.path for d in declared(config) if d.flag}


def _click_type(d: Declared):
    import click

    how, number = d.how, float if "float" in d.type else int if "int" in d.type else None
    if how.choices:
        return click.Choice(list(how.choices))
    if how.file:
        return click.Path(dir_okay=False)
    if how.min is not None or how.max is not None:
        bounded = click.FloatRange if number is float else click.IntRange
        return bounded(min=how.min, max=how.max, min_open=how.min_open)
    return number


def click_options(config: type | Mapping[str, type], *, defaults: bool) -> Callable:
    """A decorator adding the config's flags to a click command, in declaration order.

    defaults=True: each option defaults to its field's default (shown in --help); False: every
    option defaults to None, "not given", so that a config file's value stands."""
    import click

    def decorate(command: Callable) -> Callable:
        for d in reversed(declared(config)):
            if not d.flag:
                continue
            is_bool = d.type.replace(" | None", "") == "bool"
            names = [f"{d.flag}/--no-{d.flag[2:]}" if is_bool else d.flag, *d.how.aliases, d.param]
            kind = {} if is_bool else {"type": _click_type(d)}
            if d.how.multiple:
                kind["multiple"] = True
            if not d.how.required:  # click takes a default of None as a value given
                kind["default"] = d.default if defaults else None
            command = click.option(
                *names,
                **kind,
                show_default=defaults,
                required=d.how.required,
                help=d.how.help,
            )(command)
        return command

    return decorate


def docs_table(config: type | Mapping[str, type]) -> str:
    """The markdown rows (header included) of the declared options: flag, field, what it does."""
    rows = ["| flag | config field | |", "|---|---|---|"]
    for d in declared(config):
        is_bool = d.type.replace(" | None", "") == "bool"
        flag = f"`{d.flag}`, `--no-{d.flag[2:]}`" if is_bool and d.flag else f"`{d.flag}`"
        flag += "".join(f", `{alias}`" for alias in d.how.aliases)
        text = d.how.doc or d.how.help[:1].lower() + d.how.help[1:].rstrip(".")
        rows.append(f"| {flag if d.flag else '(config only)'} | `{d.path}` | {text} |")
    return "\n".join(rows) + "\n"
