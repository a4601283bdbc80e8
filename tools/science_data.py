"""The GPU lane's science dataset (.ci/gpu/run.sh science): built here, carried to the GPU machine
in the ignored folder .science/ (the working tree that travels holds at most 64 MiB).

    python tools/science_data.py [--output .science]      # also `make science-data`

`shatter-data build` of the real Wikipedia sample (a checkout's sample data when present, else the
demo's registry sample: tools/demo.py fetches it) and the Gutenberg books beside it when present:
OUTPUT/l128 for pretraining (vocabulary 8000, dynamic masking at train time, so one static
masking per row), and OUTPUT/l256, the same held-out documents with the same tokenizer, for the
evaluation after `shatter-extend` to twice the length.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SHATTER_SHARED_DATA", REPO.parent / "shared" / "data"))
LENGTHS = (128, 256)  # l_train and the extension's 2 l_train (tools/reproduce.py's gpu-small)
VOCAB = 8000
MAX_MIB = 32  # of the 64 MiB a call carries, with the checkout and .whl/ beside it


def inputs(cache: Path) -> list[str]:
    """CORPUS=PATH items: the wiki sample (shared, or the demo's), the books when present."""
    wiki = SHARED / "wiki" / "enwiki-sample-pages-articles.xml.bz2"
    if not wiki.is_file():
        from shatter.tools.demo import WIKI_SAMPLE, fetch_sample

        wiki = fetch_sample(WIKI_SAMPLE, cache)
    items = [f"wiki={wiki}"]
    if (SHARED / "books").is_dir():
        items.append(f"books={SHARED / 'books'}")
    return items


def build(out: Path, seq_len: int, items: list[str], extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "shatter.pipeline.cli", "build", "--output", str(out)]
    for item in items:
        cmd += ["--input", item]
    cmd += ["--seq-len", str(seq_len), "--dupe-factor", "1", "--validation-fraction", "0.05"]
    cmd += ["--seed", "0", "--num-shards", "4", "--overwrite", "--progress-seconds", "0", *extra]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise click.ClickException(f"shatter-data build into {out} failed: {tail}")


@click.command()
@click.option(
    "--output", type=click.Path(path_type=Path), default=REPO / ".science", show_default=True
)
@click.option(
    "--cache",
    type=click.Path(path_type=Path),
    default=REPO / ".cache" / "samples",
    show_default=True,
)
def main(output: Path, cache: Path) -> None:
    """Build the science step's dataset at l = 128 and 256 (see module doc)."""
    items = inputs(cache)
    first = output / f"l{LENGTHS[0]}"
    build(first, LENGTHS[0], items, ["--vocab-size", str(VOCAB)])
    tokenizer = ["--tokenizer", str(first / "tokenizer.model")]
    for length in LENGTHS[1:]:
        build(output / f"l{length}", length, items, tokenizer)
    mib = sum(p.stat().st_size for p in output.rglob("*") if p.is_file()) / 2**20
    if mib > MAX_MIB:
        shutil.rmtree(output)
        raise click.ClickException(f"{output} is {mib:.0f} MiB, over {MAX_MIB}: fewer inputs")
    click.echo(f"{output}: {', '.join(items)} at l = {LENGTHS}, {mib:.1f} MiB")


if __name__ == "__main__":
    main()
