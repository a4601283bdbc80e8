"""MLM evaluation of an export on a split of a shard dataset: loss and accuracy at the masked positions
(for xlnet its own objective, the permutation LM: the query stream at the targets, train/plm.py).

`python tools/evaluate.py --checkpoint EXPORT --data OUT [--split validation] [--output F.json]`

It uses the trainer's own validation stream (fixed static masks, copy 0) and evaluation sums, so
its figures compare with the `split: validation` lines of a run's metrics.jsonl. The demo uses it
to score a model extended to 512 on length-512 rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

import shatter
from pipeline.format import DatasetError, read_index, sha256_file
from shatter.checkpoint import TOKENIZER, CheckpointError
from shatter.sources import describe_non_export
from train.config import DataArgs, check_output
from train.data import validation_stream
from train.evaluate import evaluate
from train.plm import default_objective


def evaluate_export(
    checkpoint: Path,
    data: Path,
    split: str = "validation",
    batch_size: int = 8,
    max_samples: int | None = None,
) -> dict:
    """{"loss", "accuracy", "predictions", "seq_len", ...} of the export on `split` of `data`."""
    if split != "validation":
        raise click.BadParameter(
            "only the validation split has fixed masks to compare on", param_hint="--split"
        )
    problem = describe_non_export(checkpoint)
    if problem:
        raise CheckpointError(problem)
    index = read_index(data)
    index.check_files()
    rows = index.rows(split) if index.splits.get(split) else 0
    if rows == 0:
        raise DatasetError(
            f"{index.path}: the {split} split has no rows, so there is nothing to evaluate; "
            "rebuild the shards with `shatter-data build ... --validation-fraction 0.01`"
        )
    model_tokenizer = checkpoint / TOKENIZER
    if model_tokenizer.is_file() and sha256_file(model_tokenizer) != index.tokenizer_sha256:
        raise DatasetError(
            f"{index.tokenizer} (the data's tokenizer, recorded in {index.path}) differs from "
            f"{model_tokenizer} (the model's): token ids would mean other words; evaluate on data "
            f"built with `shatter-data build --tokenizer {model_tokenizer}`"
        )
    model = shatter.from_pretrained(checkpoint)
    if index.seq_len > model.config.max_len:
        raise click.ClickException(
            f"{data} has rows of length {index.seq_len}, longer than the model's max_len {model.config.max_len}: "
            f"extend it first (shatter-extend {checkpoint} --max-len {index.seq_len} --output DIR)"
        )
    objective = default_objective(model.config.arch)
    stream = validation_stream(
        index,
        DataArgs(eval_samples=max_samples, objective=objective),
        batch_size=batch_size,
        seq_len=index.seq_len,
        rank=0,
        world_size=1,
    )
    result = evaluate(model, stream, torch.device("cpu"), distributed=False)
    if result["predictions"] == 0:
        raise DatasetError(
            f"{index.path}: the {split} split has {rows} rows but no masked tokens; nothing to "
            "evaluate (rebuild the shards)"
        )
    return {
        **result,
        "split": split,
        "objective": objective,
        "seq_len": index.seq_len,
        "checkpoint": str(checkpoint),
        "data": str(data),
    }


@click.command()
@click.option(
    "--checkpoint", required=True, type=click.Path(path_type=Path), help="An export directory."
)
@click.option(
    "--data", required=True, type=click.Path(path_type=Path), help="A shard dataset (OUT)."
)
@click.option("--split", default="validation", show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--max-samples", type=int, default=None, help="Evaluate only the first N rows.")
@click.option(
    "--output", type=click.Path(path_type=Path), default=None, help="Write the result as JSON here."
)
def main(
    checkpoint: Path,
    data: Path,
    split: str,
    batch_size: int,
    max_samples: int | None,
    output: Path | None,
) -> None:
    """Masked-LM loss and accuracy of an export on a shard dataset's validation split."""
    from train.lifecycle import process_exit

    with process_exit(known=(DatasetError, FileNotFoundError, ValueError)):
        if output:
            check_output(output, directory=False)
        result = evaluate_export(checkpoint, data, split, batch_size, max_samples)
    click.echo(
        f"{split} (l={result['seq_len']}, {result['objective']}): loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f} "
        f"over {result['predictions']} masked tokens"
    )
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    from train.lifecycle import run_cli

    run_cli(main)
