"""Docs that cannot drift: every shell command of README.md and docs/*.md is parsed by its own
program's parser (tests/docs_commands.py), every `--flag` the prose names is an option of some
documented program, and every Python snippet runs."""

import os

import pytest

from tests.docs_commands import (
    REPO,
    SHELL_LANGS,
    SHELL_UTILITIES,
    DocsCommandError,
    blocks,
    commands,
    inline_flags,
    known_options,
    parse_command,
    programs,
)

SHELL_BLOCKS = [b for b in blocks() if b.lang in SHELL_LANGS]
PYTHON_BLOCKS = [b for b in blocks() if b.lang == "python"]


def _skip_marked(block):
    if block.marker and block.marker[0] == "skip":
        pytest.skip(f"{block.where}: {block.marker[1] or 'marked docs-test: skip'}")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where for b in SHELL_BLOCKS])
def test_shell_block_parses(block):
    _skip_marked(block)
    failures = []
    for argv in commands(block.text):
        try:
            parse_command(argv)
        except DocsCommandError as e:
            failures.append(str(e))
    assert not failures, f"{block.where}: " + "\n".join(failures)


def test_command_blocks_are_labelled():
    """A fence without a language is read as output; one that holds commands must say `bash`."""
    ours = set(programs()) - SHELL_UTILITIES

    def runs_ours(text: str) -> bool:
        for line in text.splitlines():
            try:
                if any(argv[0] in ours for argv in commands(line)):
                    return True
            except ValueError:  # output text that shlex cannot split: not a command
                pass
        return False

    unlabelled = [b.where for b in blocks() if not b.lang and runs_ours(b.text)]
    assert not unlabelled, f"label these command blocks ```bash: {unlabelled}"


def test_every_page_command_is_seen():
    """The extraction itself: the README's shell blocks give the commands a user types."""
    readme = [
        argv[0] for b in SHELL_BLOCKS if b.page.name == "README.md" for argv in commands(b.text)
    ]
    assert {"make", "shatter-data", "deepspeed", "python", "shatter-extend"} <= set(readme)


def test_commands_split_like_the_shell():
    script = (
        "A=1 python x.py --a 'b c' \\\n  --d && make demo  # note\ncat > f <<'E'\nbody --x\nE\n"
    )
    assert list(commands(script)) == [
        ["python", "x.py", "--a", "b c", "--d"],
        ["make", "demo"],
        ["cat"],
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["shatter-data", "build", "--input", "x", "--output", "y", "--batch-chars", "9"],
        ["shatter-data", "build", "--input", "x"],  # no --output
        ["shatter-data", "build", "--input", "x", "--output", "y", "--direct_num_worker", "2"],
        ["python", "train/pretrain.py", "--precision", "fp8"],
        ["deepspeed", "--num_gpus", "two", "train/pretrain.py"],
        ["python", "tools/bench/bench_pipeline.py", "--no-such-flag"],
        ["make", "tutorials"],
        ["pip", "install", "shatter-toolkit[trian]"],
        ["python", "-c", "import (x"],
        ["python", "train/pretrain.py", "--preset", "shatter-tiny", "--max-steps", "0"],
        ["frobnicate", "--x"],
    ],
)
def test_a_wrong_command_is_refused(argv):
    """Each kind of parser fails on an unknown flag, a bad value or a missing required option."""
    with pytest.raises(DocsCommandError):
        parse_command(argv)


def test_prose_flags_exist():
    known = known_options()
    # `--s3_*` in prose names a family of options: its prefix must begin one of them
    unknown = [
        f"{where}: {flag}"
        for where, flag in inline_flags()
        if flag not in known and not (flag.endswith("_") and any(k.startswith(flag) for k in known))
    ]
    assert not unknown, "flags the docs name that no documented program has:\n" + "\n".join(unknown)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch):
    _skip_marked(block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    code = compile(block.text, f"{block.where} (python block)", "exec")
    exec(code, {"__name__": "__docs__", "REPO": REPO, "os": os})


def test_the_benchmarks_page_stays_a_page_of_current_tables():
    """One current table per question: a page a reader finishes (at most 500 lines), without
    run logs of work still to do."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 500, "docs/benchmarks.md: condense, history stays in git"
    assert "pending" not in text.lower()
