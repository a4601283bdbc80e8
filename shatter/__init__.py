"""shatter: the Shatter encoder (single-headed attention with relative partition) and its BERT
baselines and ablations, as masked-LM models built from named presets.

    model = shatter.build_model("shatter-base", max_len=1024)
    out = model(input_ids, attention_mask, labels)       # {"loss", "logits" [M, V]}
    shatter.save_pretrained(model, "export/")            # model.safetensors + config.json
    model = shatter.from_pretrained("export/")

See docs/model.md and the paper (Shatter, §2-3 and the appendix).

The toolkit's other parts are subpackages: `shatter.pipeline` (the data pipeline, `pipeline/` in
a checkout), `shatter.train` (pretraining and finetuning, `train/`), `shatter.shards` (the shard
format, object store and node cache that all sides read) and, in a checkout only,
`shatter.tools` (set-up, reproduction and benchmark scripts, `tools/`). The names above are
loaded on first use (PEP 562): a pipeline worker imports `shatter.pipeline` without torch, which
the model needs.
"""

import importlib
import sys

from shatter.checkout import same_checkout

# a script of another checkout (a second clone sharing this venv) stops here, in one line
same_checkout(getattr(sys.modules.get("__main__"), "__file__", None))
del sys, same_checkout

# each public name and the module that defines it
_EXPORTS = {
    "CheckpointError": "shatter.checkpoint",
    "from_pretrained": "shatter.checkpoint",
    "load_config": "shatter.checkpoint",
    "save_pretrained": "shatter.checkpoint",
    "ARCHS": "shatter.config",
    "PARTITION_ARCHS": "shatter.config",
    "SIZES": "shatter.config",
    "ModelConfig": "shatter.config",
    "preset_config": "shatter.config",
    "special_id_overrides": "shatter.config",
    "Encoder": "shatter.model",
    "EncoderOutput": "shatter.model",
    "ShatterForMaskedLM": "shatter.model",
    "build_model": "shatter.model",
    "count_parameters": "shatter.model",
}
_SUBMODULES = ("heads", "partition")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"shatter.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shatter' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
