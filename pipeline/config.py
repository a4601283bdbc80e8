"""The build configuration: one frozen dataclass, saved whole in every index.json; a field
declared with `option(...)` is also an option of `shatter-data build` (`shatter.options`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shatter.options import option

CORPORA = ("wiki", "books", "text")
# `--runner` names with a meaning of ours (`shatter.pipeline.runners`; here, Beam-free, for the CLI too):
# names that make Beam's SwitchingDirectRunner try Prism first, which it downloads (and which
# cannot be downloaded offline; for this batch pipeline it would then pick the FnApiRunner anyway),
# and Beam's Dask runner, which we run fixed (`shatter.pipeline.dask_runner`). Prism: no
# apache/beam issue as of 2026-11-27; the fallback is visible in a log quoted by
# https://github.com/apache/beam/pull/36219 (Prism fails, then "Falling back to DirectRunner").
SWITCHING_RUNNERS = ("DirectRunner", "SwitchingDirectRunner")
DASK_RUNNERS = ("DaskRunner", "apache_beam.runners.dask.dask_runner.DaskRunner")


@dataclass(frozen=True)
class InputSpec:
    """One input of a build: a corpus reader and a path, glob or directory (any Beam filesystem)."""

    corpus: str  # "wiki", "books" or "text"
    path: str  # file, glob or directory; a wiki multistream dump may name its index with `index`
    index: str | None = None  # multistream index (`*-multistream-index.txt.bz2`) for parallel reads


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the bytes of a dataset (plus where it goes)."""

    inputs: tuple[InputSpec, ...]  # training corpora, mixed in one build (--input, --corpus)
    output: str = option(help="dataset directory (local or gs://, s3://, ...)", required=True)
    # a separate validation corpus (--validation-input); else held out (`shatter.pipeline.holdout`)
    validation_inputs: tuple[InputSpec, ...] = ()
    validation_fraction: float = option(
        0.005,
        "share of the text held out for validation (without --validation-input): whole documents "
        "by hash, or the last part of each where whole documents would make under half or over "
        "twice the fraction",
    )
    seq_len: int = option(256, "ids per row, [CLS] and closing [SEP] included")
    vocab_size: int = option(32000, "sentencepiece vocabulary, special ids included")
    tokenizer: str | None = option(None, "existing sentencepiece model (skips training)")
    tokenizer_sample: int = option(2_000_000, "lines of cleaned text the tokenizer is trained on")
    # sentencepiece's trainer needs several times its input in memory (the build logs the
    # sample's size and the driver's peak)
    tokenizer_sample_mb: float = option(
        200.0,
        "and at most this many MB of them: the tokenizer trainer's memory grows with its sample",
        min=0,
        min_open=True,
    )
    tokenizer_model_type: str = option(
        "unigram", "sentencepiece model type", choices=("unigram", "bpe")
    )
    cased: bool = option(
        False, "the sentencepiece model the build trains keeps case (NFKC only), or folds it"
    )
    hf_tokenizer: str | None = option(
        None,
        "a Hugging Face tokenizer instead of sentencepiece: tokenizer.json, its directory, or a "
        "Hub name (e.g. bert-base-uncased); its special tokens move to ids 0-4",
    )
    dupe_factor: int = option(5, "static maskings per row")
    mask_rate: float = option(0.15, "share of non-special tokens masked (BERT §3.1)")
    whole_word: bool = option(False, "mask whole words (word_start) instead of single tokens")
    cross_document: bool = option(True, "whether rows may span documents ([SEP] between them)")
    num_shards: int | None = option(None, "train shards (overrides --shard-size-mb)")
    num_validation_shards: int | None = option(None, "validation shards (likewise)")
    shard_size_mb: float = option(
        128,
        "shard size target (Arrow data before zstd): the shard count follows from the data",
    )
    seed: int = option(0, "global seed of the maskings")
    text_field: str = option(
        "text", "the JSON field or Parquet column of the text corpus", aliases=("--text-column",)
    )
    text_mode: str = option(
        "paragraph",
        ".txt documents: blank-line separated, or one per line",
        choices=("paragraph", "line"),
    )
    on_error: str = option(
        "skip",
        "truncated/broken input: skip the rest of that file (counted) or stop",
        choices=("skip", "stop"),
    )
    batch_chars: int = 1 << 20  # characters of text per DoFn call (Beam overhead is per element)
    split_bytes: int = 4 << 20  # byte-range size for parallel reads of splittable files
    spill_rows: int = option(
        65536,
        "rows a worker buffers before it sorts and spills them to a temporary file (memory: "
        "about 3 x rows x --seq-len x 4 bytes at a spill; the shards do not depend on it)",
        min=1,
    )
    stall_seconds: float = option(
        1800.0,
        "stop the build, in one line, when no counter has moved for this long (a worker killed "
        "for memory leaves Beam's local runner waiting for good); 0: never",
        min=0,
    )

    def __post_init__(self):
        for spec in self.inputs + self.validation_inputs:
            if spec.corpus not in CORPORA:
                raise ValueError(
                    f"unknown corpus {spec.corpus!r} for {spec.path}; choose from {CORPORA}"
                )
        if not self.inputs:
            raise ValueError("no --input given")
        if self.seq_len < 8:
            raise ValueError(f"--seq-len {self.seq_len} is too short (at least 8)")
        if self.seq_len > 65535:  # mask_positions are uint16 (the shard format)
            raise ValueError(
                f"--seq-len {self.seq_len} is too long (at most 65535: mask positions are uint16)"
            )
        if not 0 < self.mask_rate <= 1:
            raise ValueError(f"--mask-rate {self.mask_rate} must be in (0, 1]")
        if (
            not 0 <= self.seed < 2**64
        ):  # masking seeds are uint64 (shatter.pipeline.masking.row_seeds)
            raise ValueError(f"--seed {self.seed} must be in [0, 2**64)")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError("--validation-fraction must be in [0, 1)")
        if self.on_error not in ("skip", "stop"):
            raise ValueError("--on-error must be 'skip' or 'stop'")
        if self.text_mode not in ("paragraph", "line"):
            raise ValueError("--text-mode must be 'paragraph' or 'line'")
        counts = (self.num_shards, self.num_validation_shards)
        if (
            self.dupe_factor < 1
            or self.shard_size_mb <= 0
            or any(n is not None and n < 1 for n in counts)
        ):
            raise ValueError("--dupe-factor and shard counts must be >= 1, --shard-size-mb > 0")
        if self.tokenizer and self.hf_tokenizer:
            raise ValueError("pass --tokenizer (sentencepiece) or --hf-tokenizer, not both")
        if self.cased and (self.tokenizer or self.hf_tokenizer):
            raise ValueError(
                "--cased applies to the sentencepiece model a build trains; a given tokenizer "
                "keeps its own normalization (drop --cased)"
            )
        if self.vocab_size < 16:
            raise ValueError("--vocab-size must be >= 16")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BuildConfig:
        """Inverse of to_dict; unknown keys are rejected."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown build config keys: {sorted(unknown)}")
        d = dict(d)
        for key in ("inputs", "validation_inputs"):
            d[key] = tuple(InputSpec(**s) for s in d.get(key, ()))
        return cls(**d)
