"""The shell commands and Python snippets of README.md, docs/*.md and docs/internals/*.md, and a parser for each command.

Every fenced block labelled `bash` (or `sh`, `shell`) is a list of commands; each command is parsed
by its own program's parser, never run: click's `make_context` (the console scripts of setup.cfg,
the click `main` of a `python tools/X.py` or `train/X.py`) or argparse's `parse_args` (tools whose
`main()` builds an argparse parser), DeepSpeed's launcher parser and then the script's own,
`make TARGET` against the Makefile's targets. A command whose program is not in `PROGRAMS` fails
the test: a new page's command gets a parser here before it lands.

A block that is not meant to parse is marked in the Markdown by a comment on the line before it:
`<!-- docs-test: skip REASON -->` (a command that is meant to fail, one that needs a GPU machine's
files); the test reports it as skipped with that reason. `<!-- docs-test: tutorial -->` marks the
blocks of docs/tutorial.md that the tutorial test runs, in order.
"""

from __future__ import annotations

import argparse
import configparser
import importlib
import inspect
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PAGES += sorted((REPO / "docs" / "internals").glob("*.md"))  # the maintainers' pages too
SHELL_LANGS = {"bash", "sh", "shell"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
# programs of the shell itself: nothing of ours to parse
SHELL_UTILITIES = {"cat", "cd", "cp", "echo", "export", "ls", "mkdir", "rm", "head", "tail"}
OPERATORS = {"&&", "||", ";", "|", "&"}


class DocsCommandError(Exception):
    """A documented command that its program would refuse, or one no parser is known for."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    text: str
    marker: tuple[str, str] | None  # (kind, reason) of a `docs-test:` comment just above it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(pages: list[Path] = PAGES) -> Iterator[Block]:
    for page in pages:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip().splitlines()
            marker = MARKER.fullmatch(before[-1].strip()) if before else None
            yield Block(
                page,
                text.count("\n", 0, m.start()) + 1,
                m.group(1),
                m.group(2),
                (marker.group(1), marker.group(2)) if marker else None,
            )


def commands(script: str) -> Iterator[list[str]]:
    """The simple commands of a shell script: continuations joined, comments, heredoc bodies,
    redirections and leading `VAR=value` assignments dropped, split at `&&`, `;`, `|`."""
    lines = script.replace("\\\n", " ").splitlines()
    heredoc = None
    for line in lines:
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        tokens = list(lexer)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token in OPERATORS:
                if current:
                    yield current
                current = []
            elif token in {"<<", "<<-"}:
                heredoc = tokens[i + 1]
                i += 1
            elif token in {">", ">>", "<", "2>", "&>"}:
                i += 1  # the redirection's target
            elif not current and re.fullmatch(r"[A-Za-z_]\w*=.*", token):
                pass  # VAR=value before the program
            else:
                current.append(token)
            i += 1
        if current:
            yield current


# ---------------------------------------------------------------------------------------------
# parsers


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _argparse_parser(main: Callable[[], object]) -> argparse.ArgumentParser:
    """The argparse parser a tool's `main()` builds: `main` runs until its first `parse_args`."""
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        main()
    except _Parsed as e:
        return e.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise DocsCommandError(f"{main.__module__}.main() returned without calling parse_args")


def _parse_argparse(parser: argparse.ArgumentParser, prog: str, args: list[str]) -> None:
    try:
        parser.parse_args(args)
    except SystemExit as e:  # argparse printed its error (captured by pytest)
        raise DocsCommandError(f"{prog} {shlex.join(args)}: argparse refused it") from e


def _parse_click(cmd: click.Command, prog: str, args: list[str]) -> click.Context:
    """click's own parsing (types, choices, required options) of a command or a group's
    subcommand; nothing is invoked."""
    try:
        ctx = cmd.make_context(prog, list(args))
        if isinstance(cmd, click.Group):
            rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
            name, sub, rest = cmd.resolve_command(ctx, rest)
            return _parse_click(sub, f"{prog} {name}", rest)
    except click.exceptions.Exit as e:  # --help
        raise DocsCommandError(f"{prog}: {shlex.join(args)} only prints help") from e
    except click.ClickException as e:
        raise DocsCommandError(f"{prog} {shlex.join(args)}: {e.format_message()}") from e
    return ctx


def _module_main(target: str) -> click.Command | Callable[[], object]:
    """`module` or a console script's `module:function`: that function when it is a click
    command, else the module's `main`."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if isinstance(getattr(module, attr or "main", None), click.Command):
        return getattr(module, attr or "main")
    main = getattr(module, "main", None)
    if main is None:
        raise DocsCommandError(f"{module_name} has no main(): no parser known for it")
    return main


def parse_module(module_name: str, prog: str, args: list[str]) -> None:
    """`python -m M` or `python path/M.py`: the module's click `main`, or the argparse parser
    its `main()` builds; then what VALIDATORS adds for that command."""
    main = _module_main(module_name)
    if isinstance(main, click.Command):
        ctx = _parse_click(main, prog, args)
        VALIDATORS.get(ctx.command_path.removeprefix("python "), lambda ctx: None)(ctx)
    elif "ArgumentParser(" not in Path(sys.modules[module_name.split(":")[0]].__file__).read_text():
        raise DocsCommandError(f"{prog}: its main() is neither click nor argparse; no parser known")
    else:
        _parse_argparse(_argparse_parser(main), prog, args)


def console_scripts() -> dict[str, str]:
    """setup.cfg's console scripts: name -> `module:function`."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {name.strip(): target.strip() for name, target in (line.split("=", 1) for line in lines)}


def parse_python(args: list[str]) -> None:
    if args[:1] == ["-c"] and len(args) >= 2:  # a one-liner: it must at least compile
        try:
            compile(args[1], "python -c", "exec")
        except SyntaxError as e:
            raise DocsCommandError(f"python -c {args[1]!r}: {e}") from e
        return
    if args[:1] == ["-m"] and len(args) >= 2:
        return parse_module(args[1], f"python -m {args[1]}", args[2:])
    if not args or not args[0].endswith(".py"):
        raise DocsCommandError(f"python {shlex.join(args)}: only `python SCRIPT.py` is parsed")
    script = Path(args[0])
    if not (REPO / script).is_file() or script.is_absolute():
        raise DocsCommandError(f"{script} is not a script of this repository")
    parse_module(script_module(script), f"python {script}", args[1:])


def script_module(script: Path) -> str:
    """The module a checkout script runs as: `train/pretrain.py` is `shatter.train.pretrain` (the
    checkout's pipeline/, train/ and tools/ are linked under shatter/, never packages of their own)."""
    parts = script.with_suffix("").parts
    linked = (REPO / "shatter" / parts[0]).is_symlink()
    return ".".join(("shatter", *parts) if linked else parts)


def parse_deepspeed(args: list[str]) -> None:
    from deepspeed.launcher.runner import parse_args

    try:
        launcher = parse_args(args)
    except SystemExit as e:
        raise DocsCommandError(f"deepspeed {shlex.join(args)}: the launcher refused it") from e
    parse_python([launcher.user_script, *launcher.user_args])


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, re.M))


def parse_make(args: list[str]) -> None:
    targets = [a for a in args if not a.startswith("-") and "=" not in a]
    for target in targets or ["setup"]:
        if target not in make_targets():
            raise DocsCommandError(f"make {target}: the Makefile has no target {target!r}")


def parse_pip(args: list[str]) -> None:
    """`pip install 'shatter[a,b]'` (or `-e '.[a,b]'`): every extra is one that setup.cfg has."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    for arg in args:
        m = re.fullmatch(r"(?:shatter-toolkit|\.)\[([\w,-]+)\]", arg)
        if m and not set(m.group(1).split(",")) <= extras:
            unknown = sorted(set(m.group(1).split(",")) - extras)
            raise DocsCommandError(f"pip install {arg}: setup.cfg has no extra {unknown}")


def parse_dask(args: list[str]) -> None:
    """`dask scheduler` / `dask worker ...` (docs/scale-out.md): dask's own click group, with the
    subcommands that distributed registers through its entry points."""
    from importlib.metadata import entry_points

    from dask import cli

    for ep in entry_points(group="dask_cli"):
        if ep.name not in cli.cli.commands:
            cli._register_command_ep(cli.cli, ep)
    if not args or args[0] not in cli.cli.commands:
        raise DocsCommandError(f"dask {shlex.join(args)}: no such dask command")
    _parse_click(cli.cli.commands[args[0]], f"dask {args[0]}", args[1:])


def parse_bash(args: list[str]) -> None:
    if not args or not (REPO / args[0]).is_file():
        raise DocsCommandError(f"bash {shlex.join(args)}: no such script in the repository")


def parse_console_script(name: str) -> Callable[[list[str]], None]:
    def parse(args: list[str]) -> None:
        parse_module(console_scripts()[name], name, args)

    return parse


def _check_beam_options(ctx: click.Context) -> None:
    from shatter.pipeline.runners import OptionError, check_options

    ours = {o.lstrip("-") for p in ctx.command.params for o in p.opts}
    try:
        check_options(list(ctx.args), ours)
    except OptionError as e:
        raise DocsCommandError(f"{ctx.command_path}: {e}") from e


def _resolve_config(resolve: Callable) -> Callable[[click.Context], None]:
    """The trainers' own validation of flags over a config file of the repository (a file the
    page writes first, e.g. by a heredoc, is left to the tutorial test)."""

    def check(ctx: click.Context) -> None:
        from shatter.train.config import ConfigError

        # the flags: what the command's main() takes as **flags (its named arguments are not)
        named = inspect.signature(ctx.command.callback).parameters
        params = {k: v for k, v in ctx.params.items() if k not in named or k == "config_file"}
        config_file = params.pop("config_file", None)
        if config_file and not (REPO / config_file).is_file():
            return
        try:
            resolve(str(REPO / config_file) if config_file else None, params)
        except ConfigError as e:
            raise DocsCommandError(f"{ctx.command_path}: {e}") from e

    return check


def _pretrain_resolve(config_file, flags):
    from shatter.train.config import resolve

    return resolve(config_file, flags)


def _finetune_resolve(config_file, flags):
    from shatter.train.finetuning.config import resolve

    return resolve(config_file, flags)


# checks beyond the parser, by command path
VALIDATORS: dict[str, Callable[[click.Context], None]] = {
    "shatter-data build": _check_beam_options,
    "train/pretrain.py": _resolve_config(_pretrain_resolve),
    "train/finetune.py": _resolve_config(_finetune_resolve),
}


def programs() -> dict[str, Callable[[list[str]], None]]:
    """Every program the docs may run, with the function that parses its arguments."""
    table: dict[str, Callable[[list[str]], None]] = {
        name: parse_console_script(name) for name in console_scripts()
    }
    for python in ("python", "python3", ".venv/bin/python"):
        table[python] = parse_python
    table.update(deepspeed=parse_deepspeed, make=parse_make, bash=parse_bash, pip=parse_pip)
    table["dask"] = parse_dask
    table.update({name: lambda args: None for name in SHELL_UTILITIES})
    return table


def parse_command(argv: list[str]) -> None:
    """Parse one documented command with its program's parser; a DocsCommandError if refused."""
    table = programs()
    if argv[0] not in table:
        raise DocsCommandError(
            f"no parser known for {argv[0]!r} (add one to tests/docs_commands.py PROGRAMS)"
        )
    table[argv[0]](argv[1:])


def _click_options(cmd: click.Command) -> set[str]:
    names = {o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    for sub in getattr(cmd, "commands", {}).values():
        names |= _click_options(sub)
    return names


def known_options() -> set[str]:
    """Every option any documented program declares: ours (click and argparse), Beam's pipeline
    options and the DeepSpeed launcher's. A `--flag` in a page's prose must be one of them."""
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser
    from deepspeed.launcher.runner import parse_args

    import shatter.pipeline.store  # noqa: F401  (registers --store_retry_seconds with Beam's options)
    from shatter.pipeline.runners import _import_runner_options

    names: set[str] = set()
    modules = [*console_scripts().values()]
    modules += [
        "shatter." + ".".join(p.relative_to(REPO).with_suffix("").parts)
        for p in (REPO / "tools").rglob("*.py")
        if p.stem != "__init__"
    ]
    modules += ["shatter.train.pretrain", "shatter.train.finetune"]
    for target in modules:
        module = importlib.import_module(target.split(":")[0])
        main = _module_main(target) if hasattr(module, "main") or ":" in target else None
        if isinstance(main, click.Command):
            names |= _click_options(main)
        elif main is not None and "ArgumentParser(" in Path(module.__file__).read_text():
            parser = _argparse_parser(main)
            names |= {o for a in parser._actions for o in a.option_strings}
    _import_runner_options("DaskRunner")
    beam = _BeamArgumentParser(allow_abbrev=False)
    for cls in PipelineOptions.__subclasses__():
        cls._add_argparse_args(beam)
    names |= {o for a in beam._actions for o in a.option_strings}
    original = sys.argv
    try:
        sys.argv = ["deepspeed"]
        launcher = _argparse_parser(lambda: parse_args(["x.py"]))
    finally:
        sys.argv = original
    names |= {o for a in launcher._actions for o in a.option_strings}
    return names


INLINE_FLAG = re.compile(r"(?<![\w`])`(--[a-z][\w-]*)")


def inline_flags(pages: list[Path] = PAGES) -> Iterator[tuple[str, str]]:
    """(where, flag) for each inline code span of the prose that begins with `--flag`."""
    for page in pages:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
        for m in INLINE_FLAG.finditer(text):
            where = f"{page.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            yield where, m.group(1).split("=")[0]
