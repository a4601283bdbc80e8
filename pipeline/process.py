"""Two process-level workarounds of the `shatter-data` program, each for a measured cost of the
libraries it runs on; `shatter.pipeline.cli.entry` applies both. Nothing else in the project does this.

1. A build runs as if pandas were not installed (`hide_pandas`).
   Why: `apache_beam.typehints` imports pandas whenever it is importable, for its pandas batch
   converters (`typehints/__init__.py`, apache-beam 2.77.0 with pandas 3.1.1); that is a quarter of
   Beam's import time, 0.5 s of every build, and the build uses no converter. The core install
   (tests/pipeline/test_core_install.py) has no pandas, so on the runners the build is tested on
   there (`RUNNERS_WITHOUT_PANDAS`) the driver already runs this way. Workers that start their own
   interpreter (Dask's, `multi_processing`'s) import what they have.
   Remove when: Beam imports pandas lazily, or the build stops supporting installs with pandas.

2. The program ends with `os._exit` after the exit handlers (`exit_without_teardown`).
   Why: CPython 3.11's interpreter teardown frees every module and object one by one, half a
   second after a build that has nothing left to do. Exit handlers (logging's, Beam's, temporary
   directories') still run, stdout and stderr are flushed, the exit status is the command's;
   with a thread still running the exit is the interpreter's own (a thread may hold a file).
   Remove when: the teardown of a process that imported Beam costs little.
"""

from __future__ import annotations

import atexit
import importlib.abc
import os
import sys
import threading
from collections.abc import Callable

from shatter.pipeline.config import DASK_RUNNERS, SWITCHING_RUNNERS

# the runners (None: the in-process default) on which the build is tested with a driver that has no
# pandas (the core install: tests/pipeline/test_core_install.py)
RUNNERS_WITHOUT_PANDAS = (None, *SWITCHING_RUNNERS, *DASK_RUNNERS)


def runner_named(args: list[str]) -> str | None:
    """The `--runner` of a build's arguments (None: the default)."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith("--runner="):
            return arg.split("=", 1)[1]
        if arg == "--runner" and i + 1 < len(args):
            return args[i + 1]
    return None


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """Imports of pandas fail as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} (shatter-data build)", name=name)
        return None


def hide_pandas(args: list[str]) -> None:
    """Workaround 1 (module docstring) for a build with arguments `args` on a tested runner."""
    if "pandas" not in sys.modules and runner_named(args) in RUNNERS_WITHOUT_PANDAS:
        sys.meta_path.insert(0, _WithoutPandas())


def _exit_status(code) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, a message is 1 (printed)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_without_teardown(main: Callable[[], None]) -> None:
    """Workaround 2 (module docstring): run the standalone click command `main` (it ends in
    SystemExit, or an exception: a traceback and the normal exit), then the exit handlers, then
    end the process."""
    status = 0
    try:
        main()
    except SystemExit as e:
        status = _exit_status(e.code)
        if threading.active_count() > 1:
            raise
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # its reader is gone (`| head`), or it is closed
            pass
    os._exit(status)
