"""`make demo`: the whole job end to end on a real Wikipedia sample, on CPU, with no user data.

It is a thin script over the commands a user runs, in order:
1. fetch a real Wikipedia XML dump sample from the package registry (the gensim wheel ships one;
   the wheel is downloaded, not installed, and the file's sha256 is checked);
2. `shatter-data build --corpus wiki` (8k vocabulary, length 128), plus a length-512 validation
   set with the same tokenizer for step 4;
3. `deepspeed --num_gpus 2 train/pretrain.py` with the tiny Shatter preset (two CPU ranks);
4. `shatter-extend --max-len 512`, then the extended model's validation MLM loss on length-512
   rows (`train/evaluate_cli.py`);
5. a summary table and where the outputs are.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import click

from shatter.shards import sha256_file
from shatter.train.plot_metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The sample has ~100 articles: hold out 5% of them (by document hash, so the length-128 and
# length-512 datasets hold out the same documents) to have a validation split at all.
HOLDOUT = ["--validation-fraction", 0.05, "--seed", 0]


@dataclass(frozen=True)
class RegistrySample:
    """A file inside a wheel on PyPI: fetched at run time, never committed (it is CC BY-SA text)."""

    requirement: str  # what `pip download` asks for
    member: str  # the path of the file inside the wheel
    sha256: str  # of the file itself, the same in every platform's wheel


WIKI_SAMPLE = RegistrySample(
    requirement="gensim==4.4.0",
    member="gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    sha256="a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
)


def fetch_sample(sample: RegistrySample, cache: Path) -> Path:
    """Return the cached sample, downloading its wheel with pip and extracting one file if needed."""
    target = cache / Path(sample.member).name
    if target.exists() and sha256_file(target) == sample.sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-q",
            "-d",
            tmp,
            sample.requirement,
        ]
        if subprocess.run(cmd).returncode != 0:
            raise click.ClickException(
                f"could not download {sample.requirement} from the package registry"
            )
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if not wheels:
            raise click.ClickException(f"pip download {sample.requirement} gave no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                data = wheel.read(sample.member)
            except KeyError:
                raise click.ClickException(f"{wheels[0]} has no {sample.member}") from None
        if hashlib.sha256(data).hexdigest() != sample.sha256:
            raise click.ClickException(f"{sample.member} from {wheels[0]} fails its sha256 check")
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(target)
    return target


def run_stage(name: str, cmd: list[str], timings: dict[str, float]) -> None:
    """Run one user-facing command, streaming its output; stop the demo if it fails."""
    click.secho(f"\n==> {name}: {' '.join(map(str, cmd))}", bold=True)
    start = time.perf_counter()
    result = subprocess.run([str(c) for c in cmd], cwd=REPO)
    timings[name] = time.perf_counter() - start
    if result.returncode != 0:
        raise click.ClickException(
            f"stage '{name}' failed (exit {result.returncode}); its output is above"
        )


@click.command()
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    default=REPO / "runs" / "demo",
    show_default=True,
    help="Where the dataset, the run and the extended model go.",
)
@click.option(
    "--cache",
    type=click.Path(path_type=Path),
    default=REPO / ".cache",
    show_default=True,
    help="Where the downloaded sample is kept between runs.",
)
@click.option("--steps", type=int, default=2000, show_default=True, help="Pretraining steps.")
@click.option("--preset", default="shatter-tiny", show_default=True)
@click.option(
    "--fresh/--resume",
    default=True,
    show_default=True,
    help="--fresh deletes the previous demo outputs; --resume continues a killed run.",
)
@click.option(
    "--master-port",
    type=int,
    default=None,
    help="The launcher's rendezvous port (default: one free now, never the shared 29500).",
)
@click.option(
    "--fetch-to",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Only fetch the sample (checked, cached) and copy it to this file (docs/tutorial.md).",
)
def main(
    workdir: Path,
    cache: Path,
    steps: int,
    preset: str,
    fresh: bool,
    master_port: int | None,
    fetch_to: Path | None,
) -> None:
    """Run the shatter pipeline end to end on a real Wikipedia sample, on CPU."""
    if fetch_to is not None:
        fetch_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fetch_sample(WIKI_SAMPLE, cache / "samples"), fetch_to)
        click.echo(f"sample: {fetch_to} (a {WIKI_SAMPLE.requirement} test file, sha256 ok)")
        return
    if fresh and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data, data512 = workdir / "data-128", workdir / "data-512"
    run, extended = workdir / "run", workdir / "extended-512"
    timings: dict[str, float] = {}
    env_bin = lambda name: str(BIN / name)  # noqa: E731 -- the venv's console scripts

    start = time.perf_counter()
    dump = fetch_sample(WIKI_SAMPLE, cache / "samples")
    timings["fetch sample"] = time.perf_counter() - start
    click.echo(f"sample: {dump} (sha256 ok)")

    if not (data / "index.json").exists():
        run_stage(
            "build data",
            [
                env_bin("shatter-data"),
                "build",
                "--corpus",
                "wiki",
                "--input",
                dump,
                "--output",
                data,
                "--vocab-size",
                8000,
                "--seq-len",
                128,
                *HOLDOUT,
            ],
            timings,
        )
    if not (data512 / "index.json").exists():
        run_stage(
            "build 512 data",
            [
                env_bin("shatter-data"),
                "build",
                "--corpus",
                "wiki",
                "--input",
                dump,
                "--output",
                data512,
                "--tokenizer",
                data / "tokenizer.model",
                "--seq-len",
                512,
                *HOLDOUT,
            ],
            timings,
        )
    # imported here, not at the top: they import torch, 2 CPU-s a sample fetch (--fetch-to) skips
    from shatter.accelerator import say_deepspeed_accelerator
    from shatter.tools.reproduce import free_port

    say_deepspeed_accelerator()  # the launcher and each rank then print no guess about it

    run_stage(
        "pretrain",
        [
            env_bin("deepspeed"),
            "--num_gpus",
            2,
            "--master_port",  # a job beside this one on the launcher's default would join it
            master_port or free_port(),
            "--log_level",  # the launcher's INFO lines (its command, the world) left out
            "warning",
            "train/pretrain.py",
            "--data",
            data,
            "--output",
            run,
            "--preset",
            preset,
            "--config",
            "configs/cpu-tiny.yaml",
            "--max-steps",
            steps,
        ],
        timings,
    )
    if extended.exists():
        shutil.rmtree(extended)
    run_stage(
        "extend",
        [env_bin("shatter-extend"), run / "export", "--max-len", 512, "--output", extended],
        timings,
    )
    eval_json = workdir / "eval-512.json"
    run_stage(
        "evaluate 512",
        [
            sys.executable,
            "train/evaluate_cli.py",
            "--checkpoint",
            extended,
            "--data",
            data512,
            "--split",
            "validation",
            "--output",
            eval_json,
        ],
        timings,
    )
    summarise(data, data512, run, extended, eval_json, timings)


def summarise(
    data: Path, data512: Path, run: Path, extended: Path, eval_json: Path, timings: dict[str, float]
) -> None:
    index = json.loads((data / "index.json").read_text())
    counters = index["counters"]
    shards = sum(len(s["shards"]) for s in index["splits"].values())
    train, val = read_metrics(run)  # (step, loss) pairs
    final = json.loads(eval_json.read_text())
    rows = [
        (
            "documents read -> tokenized",
            f"{counters['documents_read']} -> {counters['documents_tokenized']}",
        ),
        (
            "skipped (redirects, disambiguation, other namespaces)",
            sum(v for k, v in counters.items() if k.startswith("skipped_")),
        ),
        ("tokens", counters["document_tokens"]),
        ("rows (train + validation)", counters["rows"]),
        ("shards (train + validation)", shards),
        ("pretraining steps", train[-1][0] if train else 0),
        ("train loss, first -> last", f"{train[0][1]:.3f} -> {train[-1][1]:.3f}" if train else "-"),
        (
            "validation loss, first -> last (l=128)",
            f"{val[0][1]:.3f} -> {val[-1][1]:.3f}" if val else "-",
        ),
        ("validation loss after extension (l=512)", f"{final['loss']:.3f}"),
    ] + [(f"wall time: {name}", f"{secs:.0f} s") for name, secs in timings.items()]
    width = max(len(k) for k, _ in rows)
    click.secho("\nshatter demo summary", bold=True)
    for key, value in rows:
        click.echo(f"  {key:<{width}}  {value}")
    click.echo(
        f"\noutputs:\n  dataset        {data}\n  512 dataset    {data512}\n  run            {run}"
        f"\n  export         {run / 'export'}\n  extended (512) {extended}"
    )


if __name__ == "__main__":
    main()
