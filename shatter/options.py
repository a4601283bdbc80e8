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
from pathlib import Path
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


class ConfigError(ValueError):
    """A config file or flag that cannot describe a run; the message names the file and the key."""


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    """YAML gives lists where the dataclass wants tuples; keep everything else as written."""
    spelt = _spelt(next(f for f in dataclasses.fields(cls) if f.name == name).type)
    if isinstance(value, list) and "tuple" in spelt:
        return tuple(value)
    if spelt.startswith("Mapping") and not isinstance(value, Mapping):
        raise ConfigError(f"{where}: {name} must be a mapping, got {type(value).__name__}")
    return value


def section(cls: type, values: Mapping[str, Any], where: str) -> Any:
    """`cls(**values)`, each value coerced; an unknown key is a ConfigError naming `where`."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    return cls(**{k: _coerce(cls, k, v, where) for k, v in values.items()})


def sections_of(values: Any, where: str, known: Mapping[str, type]) -> dict[str, dict]:
    """Each known section of a parsed config as a (possibly empty) dict; unknown sections, or a
    section or top level that is not a mapping, are ConfigErrors naming `where`."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: the top level must be a mapping of sections")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(known)}")
    parts = {}
    for name in known:
        part = values.get(name) or {}
        if not isinstance(part, Mapping):
            raise ConfigError(f"{where}: section {name!r} must be a mapping")
        parts[name] = dict(part)
    return parts


def read_yaml(path: str | Path, known: Mapping[str, type]) -> dict[str, dict]:
    """The sections (`sections_of`) of YAML config file `path`; every problem a ConfigError."""
    import yaml  # the trainers' dependency (the `train` extra), not the pipeline's

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    return sections_of(values, str(path), known)


def layered(
    known: Mapping[str, type], config_file: str | Path | None, flags: Mapping[str, Any]
) -> tuple[dict[str, dict], set[str]]:
    """The one merge of every command: the dataclasses' defaults, then the YAML file, then the
    flags given (None, or () for a repeatable one, is "not given"). Returns the sections' values
    (defaults left to the dataclasses) and the `section.key`s that the file or a flag set."""
    parts = read_yaml(config_file, known) if config_file else {name: {} for name in known}
    fields_of = flag_fields(known)
    for flag, value in flags.items():
        if isinstance(value, tuple) and flag in _repeatable(known):
            value = value[0] if len(value) == 1 else value or None
        if value is None:
            continue
        if flag not in fields_of:
            raise ConfigError(f"unknown flag {flag!r}")
        name, key = fields_of[flag].split(".")
        parts[name][key] = value
    return parts, {f"{name}.{key}" for name, part in parts.items() for key in part}


def _repeatable(known: Mapping[str, type]) -> set[str]:
    return {d.param for d in declared(known) if d.how.multiple}


def built(known: Mapping[str, type], parts: Mapping[str, Mapping], where: str) -> dict[str, Any]:
    """Each section's dataclass from its values (`section`), by name."""
    return {name: section(cls, parts[name], f"{where} [{name}]") for name, cls in known.items()}


# Every command of the toolkit: `-h` beside `--help`, and `--version` (the installed
# distribution's), as `@command()` in place of `@click.command()`.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
DISTRIBUTION = "shatter-toolkit"


def command(**settings: Any) -> Callable:
    import click

    def decorate(fn: Callable) -> Any:
        versioned = click.version_option(package_name=DISTRIBUTION)(fn)
        return click.command(context_settings=HELP_OPTIONS, **settings)(versioned)

    return decorate


def group(**settings: Any) -> Callable:
    import click

    def decorate(fn: Callable) -> Any:
        versioned = click.version_option(package_name=DISTRIBUTION)(fn)
        return click.group(context_settings=HELP_OPTIONS, **settings)(versioned)

    return decorate
