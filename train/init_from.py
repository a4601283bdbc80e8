"""Continued pretraining: a run that starts from an export's weights (`--init-from`).

The weights come from an export (RUN/export, or `shatter-extend`'s --output, e.g. a 256-token
model stretched to 1024); the optimizer, its moments and the schedule start afresh. Before any
process group exists the export is checked against the run: the same arch and shape as
--preset, the data's vocabulary (its size, special ids and tokenizer file), a max_len at least
the training length, and no finetuning head; each mismatch is one line saying what to change.
Once the run has a checkpoint it resumes from that, and --init-from is not read again. The log
says which, and what the run took from the export and what it starts afresh (`describe`).
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import nn

from shatter.shards import Index
from shatter.shards.reader import sha256_file
from shatter.train.config import ConfigError, TrainConfig

SHAPE_FIELDS = ("arch", "hidden", "layers", "heads", "ffn", "rpe_max_distance", "rab_buckets")


def export_dir(path: str) -> Path:
    """The export that --init-from names: the directory itself, or a run directory's export/."""
    from shatter.sources import describe_non_export

    where = Path(path)
    if describe_non_export(where, "--init-from") is not None:
        if describe_non_export(where / "export", "--init-from") is None:
            return where / "export"  # a run directory: its export
        raise ConfigError(describe_non_export(where, "--init-from"))
    return where


def check(cfg: TrainConfig, index: Index, seq_len: int):
    """The checked export's ModelConfig and path; a ConfigError naming the mismatch otherwise."""
    from shatter.checkpoint import HEAD, TOKENIZER, CheckpointError, load_config
    from shatter.config import preset_config

    export = export_dir(cfg.run.init_from)
    try:
        saved = load_config(export)
    except CheckpointError as err:
        raise ConfigError(f"--init-from {export}: {err}") from None
    wanted = preset_config(cfg.model.preset, **cfg.model.overrides)
    diff = [
        f"{k} {getattr(saved, k)} (export) vs {getattr(wanted, k)}"
        for k in SHAPE_FIELDS
        if getattr(saved, k) != getattr(wanted, k)
    ]
    fix = f"pass the export's --preset {saved.arch}-SIZE (and its model overrides)"
    if diff:
        raise ConfigError(
            f"--init-from {export} is not a {cfg.model.preset} model ({', '.join(diff)}); {fix}"
        )
    if (export / HEAD).is_file():
        raise ConfigError(
            f"--init-from {export} is a finetuned model (it has {HEAD}); pass a pretraining export"
        )
    tokenizer = export / TOKENIZER
    same_tokenizer = not tokenizer.is_file() or sha256_file(str(tokenizer)) == (
        index.tokenizer_sha256 or sha256_file(str(index.tokenizer))
    )
    if saved.vocab_size != index.vocab_size or not same_tokenizer:
        raise ConfigError(
            f"--init-from {export} has another vocabulary than the data {index.path} (vocab_size "
            f"{saved.vocab_size} vs {index.vocab_size}"
            + ("" if same_tokenizer else ", another tokenizer.model")
            + "): build the data with the export's tokenizer (`shatter-data build --tokenizer "
            f"{tokenizer}`)"
        )
    if saved.max_len < seq_len:
        raise ConfigError(
            f"--init-from {export} has max_len {saved.max_len}, shorter than the training length "
            f"{seq_len}: extend it first (`shatter-extend {export} --max-len {seq_len} --output DIR`)"
        )
    return export, saved


def load_weights(model: nn.Module, export: Path) -> None:
    """Copy the export's weights into the freshly built `model` (same shapes, checked)."""
    import shatter

    source = shatter.from_pretrained(export)
    model.load_state_dict(source.state_dict())


def describe(export: Path) -> str:
    """What --init-from takes from `export`: its checkpoint (when it is a run's export), the
    model and the number of weights (every one of them: the load is strict)."""
    import safetensors

    from shatter.checkpoint import WEIGHTS, load_config
    from shatter.train.checkpoint import EXPORT_STEP

    config = load_config(export)
    with safetensors.safe_open(str(export / WEIGHTS), framework="pt") as weights:
        values = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    step = export / EXPORT_STEP  # a run's export names its checkpoint
    origin = f" ({step.read_text().strip()})" if step.is_file() else ""
    return (
        f"{export}{origin}, all {values:,} of its {config.arch} model ({config.layers} layers, "
        f"hidden {config.hidden}, max_len {config.max_len})"
    )
