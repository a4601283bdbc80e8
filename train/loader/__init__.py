"""The pretraining loader: the shard dataset streamed as masked-LM batches with an exact position.

Four jobs, one module each:
- `order`: which global rows make step s, slot k on any world size (`EpochOrder`, `Slots`,
  `StreamPosition`, the one integer a checkpoint saves);
- `stream`: one rank's `ShardStream`, reading record batches through `shatter.shards` with
  prefetch and, for a store, the node's cache; `train_loader` and `validation_stream`;
- `collate`: rows become `Piece`s, one masker chosen at construction masks them, and they are
  laid out as a named batch;
- `mix`: several datasets in one stream, a global position mapped to (dataset, its position)
  by weight (`MixedOrder`, `Mixture`).
"""

from shatter.train.loader.collate import MaskingSpec, Piece, make_masker, masking_spec
from shatter.train.loader.mix import MixedOrder, Mixture, source_epochs, stream_shape
from shatter.train.loader.order import SHUFFLE_WINDOW, EpochOrder, Slots, StreamPosition
from shatter.train.loader.stream import (
    LOADER_WAIT_SHARE,
    ShardStream,
    WorkerBatches,
    train_loader,
    validation_stream,
)

__all__ = [
    "LOADER_WAIT_SHARE",
    "SHUFFLE_WINDOW",
    "EpochOrder",
    "MaskingSpec",
    "MixedOrder",
    "Mixture",
    "Piece",
    "ShardStream",
    "Slots",
    "WorkerBatches",
    "StreamPosition",
    "make_masker",
    "masking_spec",
    "source_epochs",
    "stream_shape",
    "train_loader",
    "validation_stream",
]
