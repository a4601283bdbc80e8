"""The attention registry: `config.arch` -> the variant's module (HF's dict of classes).

Contract of every variant (cramming's): `forward(x_BLD, mask_BL) -> context_BLD` before the
output projection W^O, which the encoder block owns; `pool(y_BD, x_BLD, mask_BL) -> context_BD`
for the §3.4 classification head; a class attribute `absolute_positions` telling the embeddings
whether to add learnt absolute position embeddings (eq. 4); a class attribute `parts` (its heads
are the n parts of the partition N, §3.1: the config requires n even and >= 4). This dict is the
one list of archs: shatter.config's ARCHS and PARTITION_ARCHS are read from it. A variant may also have (xlnet):
- `two_stream(h, g, mask_BL, rank_BL, **inputs) -> (content, query)` for the permutation LM
  (shatter/xlnet.py runs the two streams through the same blocks);
- `segments = True`: forward and two_stream also take `segment_BL` ([B, L], the number of [SEP]
  before each position), which the encoder computes once per forward
  (`Encoder.attention_inputs`) and the blocks pass through unread;
- `optional_mask = True`: forward and pool take `mask_BL = None` for a batch without padding
  (the encoder passes None when attention_mask is None; the multi-head variants, so that SDPA
  runs its flash kernel).
- `prepare(blocks) -> list[LayerWeights]` (a classmethod): the weights it derives from its
  parameters, made once per forward for every layer (shatter/attention/layer_weights.py); each
  block passes its LayerWeights.attention to `forward` as keyword arguments and applies
  LayerWeights.output as W^O, so that the context may be wider than d (the single-head archs'
  [X̄ | A_part], with §3.3's A_part V_part folded into W^O).
Each variant owns its position parameters (R, W^B) and its constant partition table.
"""

from shatter.attention.multihead import (
    BertAttention,
    NoPositionAttention,
    PartMaskAttention,
    RabAttention,
    RpeAttention,
)
from shatter.attention.single_head import (
    OneHeadSigmoidAttention,
    OneHeadSoftmaxAttention,
    PartBiasAttention,
    ShatterAttention,
    SingleHeadPartitionAttention,
)
from shatter.attention.xlnet import XLNetAttention

ATTENTIONS = {
    "bert": BertAttention,
    "bert-rpe": RpeAttention,
    "bert-rab": RabAttention,
    "no-position": NoPositionAttention,
    "part-mask": PartMaskAttention,
    "1h-softmax": OneHeadSoftmaxAttention,
    "1h-sigmoid": OneHeadSigmoidAttention,
    "part-bias": PartBiasAttention,
    "shatter": ShatterAttention,
    "xlnet": XLNetAttention,
}

__all__ = ["ATTENTIONS", "SingleHeadPartitionAttention"]
