"""`shatter-export SRC --format hf --output DIR`: a model as a Hugging Face transformers directory.

Thin click wrapper over `shatter.hf.export.export_hf` (what SRC may be, what DIR holds and how
its logits are checked: see there and docs/export.md). Every refusal (an arch without a
converter, a tokenizer that is not sentencepiece, an occupied output, a transformers too old)
prints one line naming the problem and the fix, exits with status 1 and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import click

from shatter.options import command

try:
    import torch  # noqa: F401
except ModuleNotFoundError:  # a core install (what Beam workers get) has the pipeline only
    raise SystemExit(
        "shatter-export needs the training stack and transformers: pip install 'shatter-toolkit[train,hf]'"
    ) from None

from shatter.checkpoint import CheckpointError

FORMATS = ("hf",)


@command()
@click.argument("src", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="hf",
    show_default=True,
    help="hf: a Hugging Face transformers directory (from_pretrained).",
)
@click.option(
    "--output", type=click.Path(path_type=Path), required=True, help="Directory to write."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty --output.")
@click.option(
    "--license",
    "license_id",
    help="The model card's license, a Hub license id (e.g. apache-2.0); unset: 'other'.",
)
@click.option(
    "--dataset",
    "datasets",
    multiple=True,
    help="A Hub dataset id the model was trained on, for the card (repeatable).",
)
@click.option(
    "--push-to-hub",
    "repo",
    metavar="REPO",
    help="Then upload DIR to this Hub repository (created if missing; needs a login).",
)
def main(src, fmt, output, overwrite, license_id, datasets, repo) -> None:
    """Export SRC (an export, a training run or a finetuning run) for transformers."""
    from shatter.hf.export import ConvertError, ExportError, TokenizerError, export_hf, push_to_hub

    try:
        report = export_hf(src, output, overwrite, license_id, tuple(datasets))
    except (ExportError, ConvertError, TokenizerError, CheckpointError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e}; {output} is unchanged") from None
    click.echo(report.describe())
    click.echo(f"wrote {output}")
    if repo:
        try:
            click.echo(f"pushed to {push_to_hub(output, repo)}")
        except ExportError as e:
            raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
