"""What remote Beam workers run: a build with only the core install and the `pipeline` extra
(Beam), and what they pull in, simulated in a subprocess where every other installed module fails
to import. And the other way round: a training node (the core and the `train` extra) pulls no
Beam."""

import configparser
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
OURS = {"shatter"}  # the sdist's own package (`--setup_file`)
# what the training stack and the extras bring, named so that the test says what it guards against
MUST_BLOCK = {"pandas", "torch", "datasets", "deepspeed", "scipy", "sklearn", "safetensors"}
MUST_BLOCK |= {"tqdm", "tensorboard", "matplotlib", "dask", "distributed"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_distributions(extras: tuple[str, ...] = ("pipeline",)) -> set[str]:
    """install_requires and `extras` and, recursively, what those distributions require (extras
    honoured)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += cfg["options.extras_require"][extra].splitlines()
    todo = [(Requirement(s), "") for s in (x.strip() for x in lines) if s and s[0] != "#"]
    seen: set[tuple[str, tuple]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        key = (_norm(req.name), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        for sub in dist.requires or ():
            for e in sorted(req.extras) or [""]:
                todo.append((Requirement(sub), e))
    return {name for name, _ in seen}


def blocked_modules() -> set[str]:
    """Top-level modules of installed distributions outside the core (stdlib and ours excepted)."""
    core = core_distributions() | {"pip", "setuptools"}
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if not any(_norm(d) in core for d in dists)
        and module not in sys.stdlib_module_names
        and module not in OURS
        and not module.startswith("_")
    }


RUN = textwrap.dedent(
    """
    import json, sys

    BLOCKED = set(json.loads(sys.argv[1]))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (not in the core install)")
            return None

    sys.meta_path.insert(0, Blocker())
    try:
        import pandas  # noqa: F401
    except ImportError:
        pass
    else:
        sys.exit("the blocker let pandas through")
    from shatter.pipeline.cli import entry

    sys.argv = ["shatter-data", *sys.argv[2:]]
    entry()
    """
)


def test_a_training_node_pulls_no_beam():
    """`pip install '.[train,s3]'`: Beam (and its protobuf and numpy bounds) is not among what it
    requires, whatever the depth."""
    closure = core_distributions(("train", "s3"))
    assert {"torch", "deepspeed", "s3fs", "fsspec"} <= closure
    assert "apache-beam" not in closure and "apache-beam" in core_distributions()


def test_shatter_data_without_beam_is_one_line():
    """On a training node's install, `shatter-data` names the extra to install."""
    run = "import sys; sys.modules['apache_beam'] = None; from shatter.pipeline.cli import entry; entry()"
    done = subprocess.run(
        [sys.executable, "-c", run, "inspect", "x"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "shatter-data: error: shatter-data needs Apache Beam (the `pipeline` extra), which is not "
        "installed: pip install 'shatter-toolkit[pipeline]'"
    ], done.stderr


@pytest.mark.slow
def test_a_build_needs_only_the_core_install(corpus_dir, tmp_path):
    blocked = blocked_modules()
    installed = set(metadata.packages_distributions())
    assert MUST_BLOCK & installed <= blocked  # whichever of them this environment has
    import json

    out = tmp_path / "core"
    args = ["--input", str(corpus_dir / "a.txt"), "--output", str(out), "--seq-len", "32"]
    args += ["--vocab-size", "200", "--num-shards", "1", "--tokenizer-sample", "2000"]
    proc = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(sorted(blocked)), "build", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "index.json").exists()
    verify = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(sorted(blocked)), "verify", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stderr[-3000:]
