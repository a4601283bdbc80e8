"""`shatter-extend CHECKPOINT --max-len N --output DIR`: length extension as a command.

CHECKPOINT may be a remote export (`s3://bucket/prefix/export`, `gs://...`), read through the
node's cache, and `--output` a remote prefix, checked before any work and uploaded once the export
is complete (`shatter.remote`; credentials and endpoint from the AWS environment).

With N equal to the model's max_len it is a conversion: a DeepSpeed checkpoint (or an export)
written as an export with its weights unchanged, which is how a run's checkpoint becomes something
finetuning and train/evaluate_cli.py read.

Thin click wrapper over `shatter.sources.load_model`, `shatter.extend.extend_model` and
`shatter.sources.write_export`; see shatter/extend.py for what changes per arch. Every refusal
(N shorter than max_len, an unknown or corrupt checkpoint, no tokenizer, an occupied output)
prints one clear line, exits with status 1 and writes nothing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from shatter.options import command

try:
    import torch  # noqa: F401
except ModuleNotFoundError:  # a core install (what Beam workers get) has the pipeline only
    raise SystemExit(
        "shatter-extend needs the training stack: pip install 'shatter-toolkit[train]'"
    ) from None

from shatter.checkpoint import CheckpointError
from shatter.extend import INITS, ExtendError, extend_model


@command()
@click.argument(
    "checkpoint", callback=lambda ctx, param, value: value if "://" in value else Path(value)
)
@click.option(
    "--max-len",
    "max_len",
    type=int,
    required=True,
    help="New maximum input length N (N = the current one: a conversion to an export, unchanged).",
)
@click.option(
    "--output",
    callback=lambda ctx, param, value: value if "://" in value else Path(value),
    required=True,
    help="Export directory to write (or s3://, gs://).",
)
@click.option(
    "--init",
    type=click.Choice(INITS),
    default="random",
    show_default=True,
    help="bert/bert-rab: new position rows drawn like pretraining (random) or tiled from the learnt ones (copy).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --init random.")
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="tokenizer.model (or tokenizer.json) to bundle when the checkpoint has none (e.g. a "
    "DeepSpeed checkpoint).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty --output.")
def main(
    checkpoint: Path | str,
    max_len: int,
    output: Path | str,
    init: str,
    seed: int,
    tokenizer: Path | None,
    overwrite: bool,
) -> None:
    """Extend CHECKPOINT (an export or a DeepSpeed checkpoint directory; an export may be s3:// or
    gs://) to inputs of --max-len tokens."""
    from shatter.remote import check_output, is_remote, local_export, upload_export
    from shatter.sources import load_model, write_export

    try:
        if is_remote(output):
            check_output(output, overwrite)
        model, found_tokenizer = load_model(local_export(checkpoint))
        tokenizer = tokenizer or found_tokenizer
        if tokenizer is None or not Path(tokenizer).is_file():
            raise CheckpointError(
                f"{checkpoint}: no tokenizer.model found (nor a tokenizer.json)"
                + (f" ({tokenizer} does not exist)" if tokenizer else "")
                + "; pass --tokenizer PATH (the dataset's tokenizer file)"
            )
        if max_len == model.config.max_len:
            extended, described = (
                model,
                (
                    f"{model.config.arch}: max_len {max_len} unchanged: converted to an export "
                    "(weights copied unchanged)"
                ),
            )
        else:
            extended, report = extend_model(model, max_len, init=init, seed=seed)
            described = report.describe()
        try:
            if is_remote(output):
                with tempfile.TemporaryDirectory() as tmp:
                    upload_export(write_export(extended, Path(tokenizer), Path(tmp) / "x"), output)
            else:
                write_export(extended, Path(tokenizer), output, overwrite=overwrite)
        except OSError as e:  # written beside and swapped in: a failure changes nothing
            raise click.ClickException(
                f"cannot write {output}: {e}; {output} is unchanged"
            ) from None
    except (CheckpointError, ExtendError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(described)
    click.echo(f"wrote {output}")


if __name__ == "__main__":
    main()
