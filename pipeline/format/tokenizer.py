"""A dataset's tokenizer as the pipeline, the trainer and the model read it: the special ids
every shard and model share, the text normalisation, and the loader of a sentencepiece model
that checks them. Beam-free and torch-free (sentencepiece only), so `shatter/` and `train/`
import it without the pipeline's Beam side."""

from __future__ import annotations

import sentencepiece as spm

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
SPECIAL_PIECES = {
    "[PAD]": PAD_ID,
    "[UNK]": UNK_ID,
    "[CLS]": CLS_ID,
    "[SEP]": SEP_ID,
    "[MASK]": MASK_ID,
}
NORMALIZATION = "nmt_nfkc_cf"  # NFKC and case folding: text is lower-cased


def load(model: bytes) -> spm.SentencePieceProcessor:
    """A processor from serialized model bytes, checked against the special ids."""
    sp = spm.SentencePieceProcessor(model_proto=model)
    for piece, want in SPECIAL_PIECES.items():
        got = sp.piece_to_id(piece)
        if got != want or sp.id_to_piece(want) != piece:
            raise ValueError(
                f"tokenizer has {piece} at id {got}, expected {want} (the format's special ids)"
            )
    return sp
