"""The export format: `model.safetensors` + `config.json` (+ `tokenizer.model`, + `head.json`).

- `config.json` is exactly the `ModelConfig` dataclass (docs/model.md, Exports); loading rejects unknown keys.
- `model.safetensors` holds the state dict, tied weights stored once (safetensors `save_model`).
- `head.json` is written only for a finetuning head (shatter/heads.py):
  `{"head": "sequence-classification", "num_labels": 3, "strategy": "modified"}` or
  `{"head": "span-extraction"}`. `from_pretrained` then rebuilds the head around a fresh
  backbone and loads the weights of both; without it, it returns the masked-LM model.
- `checksums.json` is `{"model.safetensors": "<sha256>"}`: every loader (`from_pretrained`, so
  shatter-extend, finetuning and train/evaluate_cli.py) checks the weights against it and names the
  file on a mismatch; an export without one (written before it existed) loads with a warning.
- Weights added to an arch after exports existed (xlnet's relative segment encoding) load at
  zero from an export without them, with a warning: their zero leaves the saved model as it was.
- The state dict depends on max_len only through the absolute position embeddings
  (`encoder.embeddings.position_embeddings.weight`, bert and bert-rab); partition tables are
  non-persistent buffers recomputed for any max_len.

Files are written to a temporary name and renamed, so a crash never leaves a half-written file
under the final name. References: nanoGPT (model args stored beside the weights), HF
`save_pretrained`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
from torch import nn

from shatter.config import ModelConfig
from shatter.heads import build_head
from shatter.model import ShatterForMaskedLM
from shatter.shards.reader import sha256_file
from shatter.shards.tokenizer import TOKENIZER_JSON

WEIGHTS, CONFIG, HEAD, TOKENIZER, CHECKSUMS = (
    "model.safetensors",
    "config.json",
    "head.json",
    "tokenizer.model",
    "checksums.json",
)
# an export's tokenizer is one of two files: a sentencepiece model, or a Hugging Face `tokenizers`
# tokenizer.json (a dataset built with `shatter-data build --hf-tokenizer`)
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_JSON)
log = logging.getLogger(__name__)  # unconfigured, Python prints warnings as one stderr line


class CheckpointError(ValueError):
    """A checkpoint directory or one of its files is missing or unreadable (names the file)."""


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode())


def save_pretrained(model: nn.Module, path: str | Path, tokenizer: Any = None) -> Path:
    """Write `model` (the MLM model or a head) to directory `path`; return the path.

    `tokenizer` may be the path of a sentencepiece `tokenizer.model` or of a Hugging Face
    `tokenizer.json` (copied under its own name, the other one removed), or a loaded
    `SentencePieceProcessor` (its serialized proto is written).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config: ModelConfig = model.config
    tmp = path / (WEIGHTS + ".tmp")
    safetensors.torch.save_model(model, str(tmp), metadata={"format": "pt", "arch": config.arch})
    digest = sha256_file(str(tmp))
    os.replace(tmp, path / WEIGHTS)
    _write_text(path / CHECKSUMS, json.dumps({WEIGHTS: digest}, indent=2) + "\n")
    _write_text(path / CONFIG, json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    head = getattr(model, "head_config", None)
    if head is not None:
        _write_text(path / HEAD, json.dumps(head(), indent=2, sort_keys=True) + "\n")
    elif (path / HEAD).exists():
        (path / HEAD).unlink()  # the directory used to hold a head; it now holds an MLM model
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)
    return path


def _save_tokenizer(tokenizer: Any, path: Path) -> None:
    """The export's one tokenizer file (see save_pretrained)."""
    if hasattr(tokenizer, "serialized_model_proto"):
        name, data = TOKENIZER, tokenizer.serialized_model_proto()
    else:
        name = TOKENIZER_JSON if str(tokenizer).endswith(".json") else TOKENIZER
        if Path(tokenizer).resolve() == (path / name).resolve():
            return
        if not Path(tokenizer).is_file():
            raise CheckpointError(f"tokenizer file {tokenizer} does not exist")
        data = Path(tokenizer).read_bytes()
    _write_bytes(path / name, data)
    for other in TOKENIZER_FILES:
        if other != name and (path / other).exists():
            (path / other).unlink()


def tokenizer_path(directory: str | Path) -> Path | None:
    """The tokenizer file of an export (or dataset) directory: `tokenizer.model` or
    `tokenizer.json`, or None where it has neither."""
    for name in TOKENIZER_FILES:
        if (Path(directory) / name).is_file():
            return Path(directory) / name
    return None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: not a shatter export directory?")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def verify_weights(path: str | Path) -> None:
    """Check `path`/model.safetensors against `path`/checksums.json (a warning when there is none)."""
    path = Path(path)
    weights, sums = path / WEIGHTS, path / CHECKSUMS
    if not sums.is_file():
        log.warning(
            "warning: %s has no %s: %s cannot be verified (an export written before checksums "
            "existed; re-export it to add one)",
            path,
            CHECKSUMS,
            weights,
        )
        return
    expected = _read_json(sums).get(WEIGHTS)
    if not isinstance(expected, str):
        raise CheckpointError(f"{sums} has no sha256 for {WEIGHTS}; re-export the model")
    if sha256_file(str(weights)) != expected:
        raise CheckpointError(
            f"{weights} is corrupted: its sha256 differs from {sums}; restore the file or "
            "re-export it from the run's checkpoint"
        )


def load_config(path: str | Path) -> ModelConfig:
    file = Path(path) / CONFIG
    try:
        return ModelConfig.from_dict(_read_json(file))
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: {e}") from None


def from_pretrained(path: str | Path, **overrides: Any) -> nn.Module:
    """Load an export written by `save_pretrained`: the MLM model, or the head if `head.json`
    is present. `overrides` replace config fields that do not change the weights' shapes
    (e.g. `dropout=0.0` or `attention_impl="chunked"`). Returned in eval mode."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = load_config(path)
    if overrides:
        config = ModelConfig.from_dict({**config.to_dict(), **overrides})
    model: nn.Module = ShatterForMaskedLM(config)
    if (path / HEAD).exists():
        try:
            model = build_head(model, _read_json(path / HEAD), path / HEAD)
        except ValueError as e:  # head.json names the file already
            raise CheckpointError(str(e)) from None
    weights = path / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing")
    verify_weights(path)
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(weights), strict=False)
    except (safetensors.SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(
            f"{weights} is corrupt or does not match {path / CONFIG}: {e}"
        ) from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights} does not match {path / CONFIG} ({config.arch}): "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval()
