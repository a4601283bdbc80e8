"""MLM evaluation of an export on a split of a shard dataset: loss and accuracy at the masked positions
(for xlnet its own objective, the permutation LM: the query stream at the targets, train/plm.py).

`shatter-evaluate --checkpoint EXPORT --data OUT [--split validation] [--seq-len L] [--output F.json]`

`--seq-len L` cuts the data's rows to L as the trainer does at L (`shatter.train.loader`'s one
cut), so one build at the longest length scores a model at every shorter one.

EXPORT and OUT may be remote (`s3://`, `gs://`): both are read through the node's cache.

It uses the trainer's own validation stream (fixed static masks, copy 0) and evaluation sums, so
its figures compare with the `split: validation` lines of a run's metrics.jsonl. The demo uses it
to score a model extended to 512 on length-512 rows.

`--data` may be repeated (with one `--output` per `--data`, in the same order) to score one model
on several datasets, e.g. at several lengths, in one process: torch is imported and the model
loaded once, and each dataset gets the result a call with it alone gives. tools/reproduce.py's
extension study scores each model at all its lengths so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import torch

from shatter.options import command
from shatter.shards import DatasetError, Index, read_index, sha256_file
from shatter.shards.store import open_store
from shatter.sources import open_export
from shatter.train.config import DataArgs, check_output
from shatter.train.evaluate import default_device, evaluate
from shatter.train.loader import validation_stream
from shatter.train.loader.order import cut_factor
from shatter.train.plm import default_objective


def evaluate_export(
    checkpoint: Path,
    data: Path,
    split: str = "validation",
    batch_size: int = 8,
    max_samples: int | None = None,
    seq_len: int | None = None,
) -> dict:
    """{"loss", "accuracy", "predictions", "seq_len", ...} of the export on `split` of `data`
    (its rows cut to `seq_len` as training cuts them; default: their stored length)."""
    (result,) = evaluate_exports(checkpoint, [data], split, batch_size, max_samples, seq_len)
    return result


def evaluate_exports(
    checkpoint: Path,
    datas: list[Path],
    split: str = "validation",
    batch_size: int = 8,
    max_samples: int | None = None,
    seq_len: int | None = None,
) -> Iterator[dict]:
    """`evaluate_export`'s result on each of `datas` in turn, the model loaded once. Every dataset
    is checked before the first is evaluated, so a bad one refuses the call before any result
    exists; each result is yielded as soon as it is computed, so a caller can keep it."""
    if split != "validation":
        raise click.BadParameter(
            "only the validation split has fixed masks to compare on", param_hint="--split"
        )
    export = open_export(checkpoint, tokenizer=False)
    indexes = [checked_index(export.tokenizer, data, split) for data in datas]
    model = export.model.to(default_device())
    for data, index in zip(datas, indexes):
        check_length(model, checkpoint, data, index, seq_len)
    for data, index in zip(datas, indexes):
        # each dataset from the RNG state right after the load, as in a process of its own
        with torch.random.fork_rng(devices=[]):
            result = score(model, index, split, batch_size, max_samples, seq_len)
        yield {**result, "checkpoint": str(checkpoint), "data": str(data)}


def checked_index(model_tokenizer: Path | None, data: Path, split: str) -> Index:
    """`data`'s index once its files, its `split` rows and its tokenizer (the model's) check out.
    A remote `data` is checked first (credentials, bucket, prefix: `shatter.shards.store`)."""
    open_store(str(data), None, DataArgs.cache_limit_gb, DataArgs.store_retry_seconds)
    index = read_index(data)
    index.check_files()
    rows = index.rows(split) if index.splits.get(split) else 0
    if rows == 0:
        raise DatasetError(
            f"{index.path}: the {split} split has no rows, so there is nothing to evaluate; "
            "rebuild the shards with `shatter-data build ... --validation-fraction 0.01`"
        )
    if model_tokenizer and sha256_file(model_tokenizer) != index.tokenizer_sha256:
        raise DatasetError(
            f"{index.tokenizer} (the data's tokenizer, recorded in {index.path}) differs from "
            f"{model_tokenizer} (the model's): token ids would mean other words; evaluate on data "
            f"built with `shatter-data build "
            f"--{'hf-' if model_tokenizer.suffix == '.json' else ''}tokenizer {model_tokenizer}`"
        )
    return index


def check_length(model, checkpoint: Path, data: Path, index: Index, seq_len: int | None) -> None:
    """Refuse rows longer than the model's positions (the fix: extend it, or cut the rows), and
    a --seq-len longer than the data's rows."""
    if seq_len is not None and seq_len > index.seq_len:
        raise click.ClickException(
            f"--seq-len {seq_len} is longer than the rows of {data} ({index.seq_len}): give "
            f"--seq-len {index.seq_len} or less (rows are cut, as training cuts them)"
        )
    length = seq_len or index.seq_len
    if length > model.config.max_len:
        raise click.ClickException(
            f"{data} has rows of length {length}, longer than the model's max_len {model.config.max_len}: "
            f"extend it first (shatter-extend {checkpoint} --max-len {length} --output DIR), "
            f"or cut the rows with --seq-len {model.config.max_len}"
        )


def score(
    model,
    index: Index,
    split: str,
    batch_size: int,
    max_samples: int | None,
    seq_len: int | None = None,
) -> dict:
    """The model on a fresh validation stream of `index` (its rows cut to `seq_len`), on the
    model's device (a GPU when there is one): nothing carries over from another dataset scored
    by the same process."""
    objective = default_objective(model.config.arch)
    length = seq_len or index.seq_len
    stream = validation_stream(
        index,
        DataArgs(eval_samples=max_samples, objective=objective),
        batch_size=batch_size,
        seq_len=length,
        rank=0,
        world_size=1,
    )
    from shatter.train.metrics import counted

    rows = index.rows(split) * cut_factor(index.seq_len, length)  # a cut row is k pieces
    rows = rows if max_samples is None else min(rows, max_samples)
    # a bar on a terminal's stderr (the result line stays on stdout), a line every 30 s in a log
    stream = counted(stream, -(-rows // batch_size), f"evaluate {split}")
    device = next(model.parameters()).device
    result = evaluate(model, stream, device, distributed=False)
    if result["predictions"] == 0:
        raise DatasetError(
            f"{index.path}: the {split} split has {index.rows(split)} rows but no masked tokens; "
            "nothing to evaluate (rebuild the shards)"
        )
    return {
        **result,
        "split": split,
        "objective": objective,
        "seq_len": length,
        "device": device.type,
    }


@command()
@click.option(
    "--checkpoint",
    required=True,
    callback=lambda ctx, param, value: value if "://" in value else Path(value),
    help="An export directory (or s3://, gs://: copied once into the node's cache).",
)
@click.option(
    "--data",
    "datas",
    required=True,
    multiple=True,
    callback=lambda ctx, param, values: tuple(v if "://" in v else Path(v) for v in values),
    help="A shard dataset (OUT, or s3://, gs://: read through the node's shard cache); repeat "
    "it to score the model on several in one process.",
)
@click.option("--split", default="validation", show_default=True)
@click.option("--batch-size", default=8, show_default=True)
@click.option("--max-samples", type=int, default=None, help="Evaluate only the first N rows.")
@click.option(
    "--seq-len",
    type=click.IntRange(min=8),
    default=None,
    help="Cut the data's rows to this length, as training at it does (default: the rows' own).",
)
@click.option(
    "--output",
    "outputs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Write the result as JSON here (with several --data: one --output each, in order).",
)
def main(
    checkpoint: Path,
    datas: tuple[Path, ...],
    split: str,
    batch_size: int,
    max_samples: int | None,
    seq_len: int | None,
    outputs: tuple[Path, ...],
) -> None:
    """Masked-LM loss and accuracy of an export on a shard dataset's validation split."""
    from shatter.train.lifecycle import process_exit

    if outputs and len(outputs) != len(datas):
        raise click.BadParameter(
            f"{len(outputs)} --output for {len(datas)} --data: give one --output per --data, "
            "in the same order (or none)",
            param_hint="--output",
        )
    with process_exit(known=(DatasetError, FileNotFoundError, ValueError)):
        for output in outputs:
            check_output(output, directory=False)
        results = evaluate_exports(checkpoint, list(datas), split, batch_size, max_samples, seq_len)
        for i, result in enumerate(results):
            report(result, outputs[i] if outputs else None, several=len(datas) > 1)


def report(result: dict, output: Path | None, several: bool) -> None:
    """The result's line (naming its data when there are several) and its JSON file, written as
    soon as it is known: a later dataset's failure keeps it."""
    click.echo(
        f"{result['split']} (l={result['seq_len']}, {result['objective']}): loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f} "
        f"over {result['predictions']} masked tokens" + (f" on {result['data']}" if several else "")
    )
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    from shatter.train.lifecycle import run_cli

    run_cli(main)
