"""shatter: the Shatter encoder (single-headed attention with relative partition) and its BERT
baselines and ablations, as masked-LM models built from named presets.

    model = shatter.build_model("shatter-base", max_len=1024)
    out = model(input_ids, attention_mask, labels)       # {"loss", "logits" [M, V]}
    shatter.save_pretrained(model, "export/")            # model.safetensors + config.json
    model = shatter.from_pretrained("export/")

See docs/model.md and the paper (Shatter, §2-3 and the appendix).
"""

from shatter import heads, partition
from shatter.checkpoint import CheckpointError, from_pretrained, load_config, save_pretrained
from shatter.config import (
    ARCHS,
    PARTITION_ARCHS,
    SIZES,
    ModelConfig,
    preset_config,
    special_id_overrides,
)
from shatter.model import (
    Encoder,
    EncoderOutput,
    ShatterForMaskedLM,
    build_model,
    count_parameters,
)

__all__ = [
    "ARCHS",
    "PARTITION_ARCHS",
    "SIZES",
    "CheckpointError",
    "Encoder",
    "EncoderOutput",
    "ModelConfig",
    "ShatterForMaskedLM",
    "build_model",
    "count_parameters",
    "from_pretrained",
    "heads",
    "load_config",
    "partition",
    "preset_config",
    "save_pretrained",
    "special_id_overrides",
]
