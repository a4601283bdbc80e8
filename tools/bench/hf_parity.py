"""The transformers export's parity table: every arch x head, max |logits_hf - logits_ours|.

    python tools/bench/hf_parity.py --tokenizer data/wiki/tokenizer.model [--size tiny] [--long 1024]

For each arch and head (masked LM; sequence classification with the §3.4 modified strategy and
with [CLS]; span extraction) it builds a model of the given size with perturbed weights (away
from the init's zero biases and unit LayerNorms), writes a toolkit export, runs the real
`shatter.hf.export.export_hf`, loads the directory back with transformers' Auto class, and
compares the logits on a padded batch of two lengths in fp32. For the masked LM it also runs
`pipeline("fill-mask")` and checks that its top token is our model's argmax. `--long N` adds
the shatter and bert models extended to N (shatter.extend) and compared at length N.
Prints a markdown table (docs/export.md).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import shatter
from shatter.extend import extend_model
from shatter.heads import SequenceClassificationModel, SpanExtractionModel
from shatter.hf.export import export_hf, load_hf, outputs, sample_batch as batch

HEADS = ("mlm", "classify-modified", "classify-cls", "span")
FILL_TEXT = "to be or not to [MASK] , that is the question"


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def with_head(backbone, head: str):
    if head == "mlm":
        return backbone
    if head == "span":
        return SpanExtractionModel(backbone)
    return SequenceClassificationModel(backbone, 3, strategy=head.removeprefix("classify-"))


def fill_mask(model, directory: Path, native: bool):
    """(whether pipeline("fill-mask")'s top token is our argmax at [MASK], the pipeline)."""
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(directory), trust_remote_code=not native)
    enc = fill.tokenizer(FILL_TEXT, return_tensors="pt")
    with torch.no_grad():
        logits = model(enc["input_ids"], enc["attention_mask"])["logits"][0]
    at = (enc["input_ids"][0] == fill.tokenizer.mask_token_id).nonzero().item()
    return fill(FILL_TEXT)[0]["token"] == int(logits[at].argmax()), fill


def row(model, tokenizer: Path, work: Path, lengths, head: str) -> str:
    src, out = work / "export", work / "hf"
    shatter.save_pretrained(model, src, tokenizer=tokenizer)
    report = export_hf(src, out, overwrite=True)
    hf = load_hf(out, model)
    diff = (
        (
            outputs(hf, batch(model.config.vocab_size, lengths))
            - outputs(model, batch(model.config.vocab_size, lengths))
        )
        .abs()
        .max()
        .item()
    )
    fill = fill_mask(model, out, report.native)[0] if head == "mlm" else None
    return (
        f"| {model.config.arch} | {head} | {max(lengths)} | {diff:.1e} | "
        f"{'native ' + report.hf_class if report.native else 'remote code'} | "
        f"{'' if fill is None else ('same top token' if fill else 'DIFFERENT')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokenizer", type=Path, required=True, help="a sentencepiece tokenizer.model"
    )
    parser.add_argument("--size", default="tiny", help="preset size (tiny, small, base, large)")
    parser.add_argument("--long", type=int, default=1024, help="extended length to check (0: none)")
    args = parser.parse_args()
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(args.tokenizer)).get_piece_size()
    torch.manual_seed(0)  # the models' init: the same table on every run
    print("| arch | head | length | max abs logit diff | transformers class | fill-mask |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i, arch in enumerate(shatter.ARCHS):
            backbone = perturbed(
                shatter.build_model(f"{arch}-{args.size}", vocab_size=vocab, max_len=64), i
            )
            for head in HEADS:
                model = perturbed(with_head(backbone, head), 100 + i) if head != "mlm" else backbone
                print(row(model, args.tokenizer, work, (24, 11), head), flush=True)
        if args.long:
            for arch in ("shatter", "bert"):
                base = perturbed(
                    shatter.build_model(f"{arch}-{args.size}", vocab_size=vocab, max_len=64), 0
                )
                long, _ = extend_model(base, args.long)
                print(
                    row(long.eval(), args.tokenizer, work, (args.long, 2 * args.long // 3), "mlm"),
                    flush=True,
                )


if __name__ == "__main__":
    main()
