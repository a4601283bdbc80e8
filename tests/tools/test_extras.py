"""A tool that needs an optional extra stops before any work, in one line naming the extra."""

import subprocess
import sys
from pathlib import Path

import pytest

from shatter.extras import MissingExtra, require

REPO = Path(__file__).resolve().parents[2]

WITHOUT_MATPLOTLIB = """
import runpy, sys
sys.modules["matplotlib"] = None  # as if the `demo` extra were not installed
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_require_names_every_missing_module_and_the_extra():
    require("json", extra="demo", purpose="x")  # present: nothing
    with pytest.raises(MissingExtra) as err:
        require("json", "no_such_module_a", "no_such_module_b", extra="demo", purpose="the plot")
    assert err.value.message == (
        "the plot needs no_such_module_a, no_such_module_b (the `demo` extra), which is not "
        "installed: pip install -e '.[demo]' (or pip install 'shatter-toolkit[demo]')"
    )


@pytest.mark.parametrize(
    "script,args,purpose",
    [
        ("train/plot_metrics.py", ["{tmp}", "-o", "{tmp}/c.png"], "plot_metrics needs"),
        ("tools/reproduce.py", ["ablation", "--output", "{tmp}/study"], "ablation study's figure"),
    ],
)
def test_a_tool_without_its_extra_stops_before_any_work(tmp_path, script, args, purpose):
    """Run as a user runs them (scripts), matplotlib unimportable: exit 1, one line naming the
    `demo` extra, and nothing written (the ablation has built no data and trained nothing)."""
    argv = [str(REPO / script), *(a.format(tmp=tmp_path) for a in args)]
    code = WITHOUT_MATPLOTLIB.format(argv=argv)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert purpose in done.stderr and "pip install -e '.[demo]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "study").exists() and not (tmp_path / "c.png").exists()
