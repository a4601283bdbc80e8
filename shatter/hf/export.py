"""`shatter-export SRC --format hf --output DIR`: an export, a training run or a finetuned model
as a Hugging Face transformers directory, checked against our model before it is written.

SRC may be an export directory (`model.safetensors` + `config.json` + `tokenizer.model` or
`tokenizer.json`), a
pretraining run (its `export/`), or a finetuning run (its `best/` export with `head.json`; the
run's `config.json` gives the label names). DIR gets:

- `config.json` + `model.safetensors` (transformers' `save_pretrained`); for remote-code archs
  also `configuration_shatter.py` + `modeling_shatter.py` and `auto_map` (shatter/hf/convert.py
  says which archs are native);
- `tokenizer.json` + `tokenizer_config.json` (shatter/hf/tokenizer.py: converted from the
  sentencepiece model, or the dataset's own tokenizer.json, WordPiece, BPE or any other);
- `README.md`, the model card (shatter/hf/card.py).

Before DIR appears, the written directory is loaded back with transformers' Auto class and its
logits are compared with our model's on a padded batch of two lengths: a difference above
`TOLERANCE` fails the export. DIR is written beside and renamed into place
(`shatter.sources.replace_directory`), so a failure leaves nothing (or the old DIR) behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shatter.checkpoint import (
    TOKENIZER,
    TOKENIZER_JSON,
    CheckpointError,
    from_pretrained,
    tokenizer_path,
)
from shatter.hf import card
from shatter.hf.convert import (
    CLASSES,
    REMOTE_FILES,
    ConvertError,
    auto_map,
    check_convertible,
    head_kind,
    hf_model,
    is_native,
)
from shatter.hf.tokenizer import TokenizerError, save_tokenizer
from shatter.sources import describe_non_export, is_export, replace_directory

MIN_TRANSFORMERS = "5.0"  # dict-valued _tied_weights_keys and transformers.initialization
TOLERANCE = 1e-4  # max |logits_hf - logits_ours| accepted at export time (fp32; CI holds 1e-5)
REMOTE = Path(__file__).parent / "remote"


class ExportError(ValueError):
    """Bad input to the export; the message names the problem and the fix."""


@dataclass(frozen=True)
class Source:
    export: Path  # the toolkit export to convert
    run: Path | None  # the pretraining or finetuning run it came from, if any
    labels: list[str] | None  # a finetuned classifier's label names, by id


@dataclass(frozen=True)
class ExportReport:
    arch: str
    head: str | None
    hf_class: str
    native: bool
    max_abs_diff: float

    def describe(self) -> str:
        code = "native, no remote code" if self.native else "remote code (trust_remote_code=True)"
        return (
            f"{self.arch}{' ' + self.head if self.head else ''} -> {self.hf_class} ({code}); "
            f"max |logits_hf - logits_ours| = {self.max_abs_diff:.1e}"
        )


def check_transformers() -> None:
    try:
        import transformers
    except ModuleNotFoundError:
        raise ExportError(
            "shatter-export --format hf needs transformers: pip install 'shatter-toolkit[hf]'"
        ) from None
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ExportError(
            f"transformers {transformers.__version__} is too old for the exported classes "
            f"(needs >= {MIN_TRANSFORMERS}): pip install -U 'transformers>={MIN_TRANSFORMERS}'"
        )


def resolve(src: Path) -> Source:
    """Which export SRC names: itself, a pretraining run's export/, or a finetuning run's best/."""
    src = Path(src)
    if is_export(src):
        run = src.parent if (src.parent / "config.json").is_file() else None
        return Source(src, run, _labels(run))
    for sub in ("export", "best"):
        if is_export(src / sub):
            return Source(src / sub, src, _labels(src))
    reason = describe_non_export(src, "SRC") or f"SRC {src} is not an export"
    raise ExportError(
        f"{reason}; shatter-export takes an export, a training run or a finetuning run"
    )


def _labels(run: Path | None) -> list[str] | None:
    try:
        labels = json.loads((run / "config.json").read_text()).get("labels")
    except (TypeError, OSError, ValueError, AttributeError):
        return None
    return [str(x) for x in labels] if isinstance(labels, list) else None


def sample_batch(
    vocab_size: int, lengths: tuple[int, int], seed: int = 1
) -> dict[str, torch.Tensor]:
    """Two rows `[CLS] a [SEP] b [SEP]` of the given lengths, the shorter one padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab_size, (2, max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, 0], ids[row, n // 2], ids[row, n - 1], ids[row, n:] = 2, 3, 3, 0
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def outputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of any of our models or theirs at real tokens: [T, V], [B, labels] or [T, 2]."""
    with torch.no_grad():
        out = model(**batch)
    get = out.get if isinstance(out, dict) else lambda k: getattr(out, k, None)
    real = batch["attention_mask"].bool()
    if get("start_logits") is not None:
        return torch.stack([get("start_logits")[real], get("end_logits")[real]], -1)
    logits = get("logits")
    return logits[real] if logits.dim() == 3 else logits


def load_hf(directory: Path, model: nn.Module) -> nn.Module:
    """The directory loaded back with the Auto class its head maps to."""
    import transformers

    kind, head = head_kind(model)
    auto = getattr(transformers, CLASSES[kind][1])
    native = is_native(model.config, head)
    return auto.from_pretrained(str(directory), trust_remote_code=not native).eval()


def export_hf(
    src: Path,
    output: Path,
    overwrite: bool = False,
    license: str | None = None,
    datasets: tuple[str, ...] = (),
) -> ExportReport:
    """Convert SRC (see the module docstring) into the transformers directory `output`; the
    card's license and datasets are the Hub's ids (`license`, `datasets`)."""
    check_transformers()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # our own report line instead of its load reports
    hf_logging.disable_progress_bar()
    source = resolve(Path(src))
    model = from_pretrained(source.export).float().eval()
    check_convertible(model.config)
    tokenizer = tokenizer_path(source.export)
    if tokenizer is None:
        raise ExportError(
            f"{source.export} has no {TOKENIZER} or {TOKENIZER_JSON}: copy the dataset's "
            "tokenizer file into it"
        )
    kind, head = head_kind(model)
    converted = hf_model(model, source.labels)
    report: list[ExportReport] = []

    def write(tmp: Path) -> None:
        config = converted.config
        if not is_native(model.config, head):
            config.auto_map = auto_map(kind)
            for name in REMOTE_FILES:
                shutil.copyfile(REMOTE / name, tmp / name)
        converted.save_pretrained(str(tmp))
        save_tokenizer(tokenizer, tmp, model.config.max_len)
        L = min(model.config.max_len, 24)
        batch = sample_batch(model.config.vocab_size, (L, max(2, 2 * L // 3)))
        diff = (outputs(load_hf(tmp, model), batch) - outputs(model, batch)).abs().max().item()
        if not diff <= TOLERANCE:
            raise ExportError(
                f"the converted {model.config.arch} model differs from {source.export} by "
                f"{diff:.2e} (> {TOLERANCE}) in its logits; nothing was written: report this"
            )
        result = ExportReport(
            model.config.arch, kind, type(converted).__name__, is_native(model.config, head), diff
        )
        (tmp / "README.md").write_text(card.model_card(model, source, result, license, datasets))
        report.append(result)

    try:
        replace_directory(output, write, overwrite)
    except CheckpointError as e:  # the occupied output, named with the fix
        raise ExportError(str(e)) from None
    return report[0]


def push_to_hub(directory: Path, repo: str) -> str:
    """Upload a written export to the Hub repository `repo` (created if missing); its URL."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    except ImportError as e:
        raise ExportError(
            f"--push-to-hub needs huggingface_hub ({e}): pip install huggingface_hub"
        ) from None
    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        return api.upload_folder(folder_path=str(directory), repo_id=repo).commit_url
    except OfflineModeIsEnabled:
        raise ExportError(
            f"cannot push {directory} to {repo}: HF_HUB_OFFLINE is set; unset it (the export "
            f"is written: push it later with `huggingface-cli upload {repo} {directory}`)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ExportError(
            f"cannot push {directory} to {repo}: {first}; log in with `huggingface-cli login` "
            f"(the export is written: push it later with `huggingface-cli upload {repo} "
            f"{directory}`)"
        ) from None


__all__ = ["ConvertError", "ExportError", "TokenizerError", "export_hf", "push_to_hub"]
