"""Optional dependencies, checked before a tool does any work.

A tool that needs an extra (`pip install -e '.[demo]'` for matplotlib, say) calls `require` at the
top of its command, so that a missing module stops it in one line naming the extra to install,
not after an hour of training with a traceback. setup.cfg's [options.extras_require] is the list
of extras.
"""

from __future__ import annotations

import importlib

import click


class MissingExtra(click.ClickException):
    """A module of an optional extra is not installed; the message says which extra to install."""


def require(*modules: str, extra: str, purpose: str) -> None:
    """Stop with `MissingExtra` unless every one of `modules` imports."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise MissingExtra(
            f"{purpose} needs {', '.join(missing)} (the `{extra}` extra), which is not "
            f"installed: pip install -e '.[{extra}]' (or pip install 'shatter-toolkit[{extra}]')"
        )
