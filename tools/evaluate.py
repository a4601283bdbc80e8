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
from pipeline.format import DatasetError, read_index
from train.config import DataArgs
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
    model = shatter.from_pretrained(checkpoint)
    index = read_index(data)
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
    try:
        result = evaluate_export(checkpoint, data, split, batch_size, max_samples)
    except (DatasetError, FileNotFoundError, ValueError) as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"{split} (l={result['seq_len']}, {result['objective']}): loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f} "
        f"over {result['predictions']} masked tokens"
    )
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
