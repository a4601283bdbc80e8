"""Reading a model from an export or a DeepSpeed checkpoint, and writing an export atomically.

- An export directory (docs/format.md): `model.safetensors` + `config.json` (+ `tokenizer.model`
  or `tokenizer.json`, + `head.json`), loaded with `shatter.from_pretrained`.
- A DeepSpeed checkpoint directory: the run's `checkpoints/` folder (with DeepSpeed's `latest`
  file), or one tag folder inside it (`global_step100/`). ZeRO partitions are consolidated to
  fp32 with `deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`; a ZeRO-0
  checkpoint's full `module` state is read from `mp_rank_00_model_states.pt`. The model config
  comes from the checkpoint's client state (`model_config`, or the trainer's run `config`:
  preset + overrides), else a `config.json` beside it or the run's `export/config.json`; the
  tokenizer from beside it, the run's export, or the run config's shard dataset.
- `write_export` writes into a temporary sibling directory and renames it into place, so a
  failed or interrupted write leaves nothing under the output name.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from shatter import safe_load
from shatter.accelerator import say_deepspeed_accelerator
from shatter.checkpoint import (
    CONFIG,
    WEIGHTS,
    CheckpointError,
    from_pretrained,
    load_config,
    save_pretrained,
    tokenizer_path,
)
from shatter.config import ModelConfig, preset_config
from shatter.model import ShatterForMaskedLM
from shatter.remote import local_export

MODEL_STATES = "mp_rank_00_model_states.pt"


def is_export(path: Path) -> bool:
    return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()


def _deepspeed_tag_dir(path: Path) -> Path | None:
    """The checkpoint tag folder that `path` names or whose `latest` file points at."""
    if (path / MODEL_STATES).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = path / latest.read_text().strip()
        if not (tag / MODEL_STATES).is_file():
            raise CheckpointError(f"{latest} points at {tag}, which has no {MODEL_STATES}")
        return tag
    return None


def dataset_dirs(path) -> list[Path]:
    """The dataset directories of a run config's data.path: one, or a mixture's "DIR:WEIGHT"
    each (train/config.py `data_sources`), local ones only."""
    values = [path] if isinstance(path, str) else list(path or ())
    dirs = []
    for value in (v for v in values if isinstance(v, str) and "://" not in v):
        head, sep, _ = value.rpartition(":")
        dirs.append(Path(head) if sep and not Path(value).is_dir() else Path(value))
    return dirs


def _trained_length(tag_dir: Path, run_config: dict) -> int | None:
    """The length a trainer run built its model for: RUN/config.json's `seq_len`, else the run
    config's data.seq_len, else its dataset's index.json seq_len; None when none says."""
    import json

    for run_file in (tag_dir.parent.parent / CONFIG, tag_dir.parent / CONFIG):
        try:
            return int(json.loads(run_file.read_text())["seq_len"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    data = run_config.get("data") or {}
    if data.get("seq_len"):
        return int(data["seq_len"])
    lengths = []
    for directory in dataset_dirs(data.get("path")):
        try:
            lengths.append(int(json.loads((directory / "index.json").read_text())["seq_len"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return min(lengths, default=None)  # mixed datasets: the trainer's default length


def _config_for(tag_dir: Path, client_state: dict, state: dict) -> ModelConfig:
    """The checkpoint's ModelConfig: stored whole, or rebuilt from the trainer's run config
    (`config.model.preset` + `overrides`, vocab_size read off the word embeddings), or a
    `config.json` beside the checkpoint or in the run's export."""
    try:
        if isinstance(client_state.get("model_config"), dict):
            return ModelConfig.from_dict(client_state["model_config"])
        run_config = client_state.get("config")
        if isinstance(run_config, dict) and isinstance(run_config.get("model"), dict):
            model = run_config["model"]
            vocab = state.get("encoder.embeddings.word_embeddings.weight")
            extra = {"vocab_size": int(vocab.shape[0])} if vocab is not None else {}
            seq_len = _trained_length(tag_dir, run_config)
            if seq_len:  # the trainer builds the model for the length it trains at
                extra["max_len"] = seq_len
            return preset_config(model["preset"], **{**extra, **(model.get("overrides") or {})})
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{tag_dir / MODEL_STATES}: its stored config is unusable: {e}"
        ) from None
    for directory in (tag_dir, tag_dir.parent, tag_dir.parent.parent / "export"):
        if (directory / CONFIG).is_file():
            return load_config(directory)
    raise CheckpointError(
        f"{tag_dir}: no model config found (a 'model_config' or trainer 'config' entry in "
        f"{MODEL_STATES}, {CONFIG} beside the checkpoint, or the run's export/{CONFIG})"
    )


def load_deepspeed(tag_dir: Path) -> tuple[ShatterForMaskedLM, dict]:
    """Consolidate a DeepSpeed checkpoint tag folder: (fp32 masked-LM model, its client state)."""
    try:
        states = safe_load.load(tag_dir / MODEL_STATES)
    except safe_load.UnsafeCheckpointError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{tag_dir / MODEL_STATES} cannot be read: {e}") from None
    if not isinstance(states, dict):
        raise CheckpointError(f"{tag_dir / MODEL_STATES} is not a DeepSpeed model-states file")
    if any(tag_dir.glob("*zero_pp_rank_*optim_states.pt")):
        # ZeRO: the fp32 master weights live partitioned in the optimizer states (and under
        # stage 3 `module` is empty); bf16/fp16 `module` weights would lose precision.
        say_deepspeed_accelerator()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        said = io.StringIO()  # its progress lines and bars: internals, and \r in a log
        try:
            with safe_load.only_weights(), contextlib.redirect_stdout(said):
                with contextlib.redirect_stderr(said):
                    state = get_fp32_state_dict_from_zero_checkpoint(
                        str(tag_dir.parent), tag=tag_dir.name
                    )
        except safe_load.UnsafeCheckpointError as e:
            raise CheckpointError(str(e)) from None
        except Exception as e:  # a missing rank file or a foreign layout surfaces as many types
            raise CheckpointError(
                f"{tag_dir}: cannot consolidate the ZeRO checkpoint: {e}"
            ) from None
    else:
        state = states.get("module")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{tag_dir / MODEL_STATES} holds no model weights")
    state = {k.removeprefix("module."): v.float() for k, v in state.items()}
    config = _config_for(tag_dir, states, state)
    model = ShatterForMaskedLM(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(
            f"{tag_dir}: weights do not match its {config.arch} config: {e}"
        ) from None
    tied = {"mlm_head.word_embeddings.weight", "encoder.embeddings.word_embeddings.weight"}
    if unexpected or set(missing) - tied:
        raise CheckpointError(
            f"{tag_dir}: weights do not match its {config.arch} config: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return model.eval(), states


def describe_non_export(path: str | Path, option: str = "--checkpoint") -> str | None:
    """None when `path` is an export, else one sentence saying what it is and what to pass
    instead: no such directory, a training run, a DeepSpeed checkpoint, or something else."""
    path = Path(path)
    if not path.exists():
        return f"{option} {path}: no such directory"
    if not path.is_dir():
        return f"{option} {path} is a file; pass an export directory (RUN/export or shatter-extend's --output)"
    if is_export(path):
        return None
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        if is_export(path / "export"):
            return f"{option} {path} is a training run directory; pass its export: {option} {path / 'export'}"
        return (
            f"{option} {path} is a training run directory without an export yet: finish the run "
            f"(the same pretrain command resumes it) or export its checkpoint with "
            f"`shatter-extend {path / 'checkpoints'} --max-len N --output DIR`"
        )
    if (path / "latest").is_file() or (path / MODEL_STATES).is_file():
        run_export = next((p / "export" for p in path.parents[:2] if is_export(p / "export")), None)
        if run_export is not None:
            return (
                f"{option} {path} is a DeepSpeed checkpoint, not an export; the run's export is "
                f"{run_export} (or convert this checkpoint with "
                f"`shatter-extend {path} --max-len N --output DIR`)"
            )
        return (
            f"{option} {path} is a DeepSpeed checkpoint, not an export: pass the run's export/ "
            f"directory, or convert it with `shatter-extend {path} --max-len N --output DIR` "
            "(N = its max_len converts it unchanged; a larger N also extends it)"
        )
    return (
        f"{option} {path} is not a shatter export (it needs {WEIGHTS} and {CONFIG}); pass RUN/export "
        "or shatter-extend's --output"
    )


def load_model(path: str | Path) -> tuple[nn.Module, Path | None]:
    """(model, its tokenizer file or None) from an export or a DeepSpeed checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if is_export(path):
        return from_pretrained(path), tokenizer_path(path)
    tag_dir = _deepspeed_tag_dir(path)
    if tag_dir is None:
        raise CheckpointError(
            f"{path}: neither an export ({WEIGHTS} + {CONFIG}) nor a DeepSpeed checkpoint "
            f"(a 'latest' file or {MODEL_STATES})"
        )
    model, client_state = load_deepspeed(tag_dir)
    candidates = [tag_dir, tag_dir.parent, tag_dir.parent.parent / "export"]
    data_path = ((client_state.get("config") or {}).get("data") or {}).get("path")
    # the trainer's run config names the shard datasets, which hold the tokenizer
    candidates += dataset_dirs(data_path)
    for candidate in candidates:
        if found := tokenizer_path(candidate):
            return model, found
    return model, None


def write_export(
    model: nn.Module, tokenizer: Path, output: str | Path, overwrite: bool = False
) -> Path:
    """Write an export to `output` through a temporary sibling directory and a rename."""
    return replace_directory(
        output, lambda tmp: save_pretrained(model, tmp, tokenizer=tokenizer), overwrite
    )


def replace_directory(
    output: str | Path, write: Callable[[Path], object], overwrite: bool = False
) -> Path:
    """Fill a temporary sibling directory with `write(tmp)` and rename it to `output`: a failed
    or interrupted write leaves nothing under the output name (and an old one untouched)."""
    output = Path(output)
    if output.exists() and not overwrite and (not output.is_dir() or any(output.iterdir())):
        raise CheckpointError(
            f"{output} already exists and is not empty (pass --overwrite to replace it)"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        write(tmp)
        if output.exists():
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            os.replace(output, old)
            os.replace(tmp, output)
            shutil.rmtree(old)
        else:
            os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return output


@dataclass(frozen=True)
class Export:
    """An export opened for use: the model (weights checked against checksums.json), its
    tokenizer file, and where it lies on this node (a remote export: its copy in the cache)."""

    source: str  # as the user gave it (a path, s3://, gs://)
    path: Path  # the local directory
    model: nn.Module
    tokenizer: Path | None


def open_export(path: str | Path, option: str = "--checkpoint", tokenizer: bool = True) -> Export:
    """The one way to open an export: a remote one through the node's cache, a DeepSpeed
    checkpoint or a run directory refused in one line that says what to pass instead, the
    weights checked against their checksums, and (`tokenizer`) the tokenizer file required."""
    local = local_export(path)  # s3://, gs://: fetched once per node
    problem = describe_non_export(local, option)
    if problem:
        raise CheckpointError(problem)
    found = tokenizer_path(local)
    if tokenizer and found is None:
        raise CheckpointError(
            f"{local}: the export has no tokenizer.model or tokenizer.json; copy the dataset's "
            "tokenizer file into it (or re-export with one)"
        )
    return Export(str(path), local, from_pretrained(local), found)
