"""Helper run by test_model_partition.py in a subprocess: a bf16 DeepSpeed engine (buffers cast to
bf16 as `data_types.buffer_dtype` asks), then one forward per single-head impl, recording the
partition table each attention call is handed. Prints one line per impl: dtype, max |Σ_h f_h − 1|.

usage: python deepspeed_partition.py
"""

import os

import torch

os.environ.update(
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=os.environ.get("MASTER_PORT", "29563"),
)

from shatter.train.engine import build_extensions  # noqa: E402

# DeepSpeed's CPU op as the trainer gets it: its per-environment cache, the finished build loaded
# as it is (torch's JIT builder would run ninja, which recompiles when its command line differs)
build_extensions()

import deepspeed  # noqa: E402

import shatter  # noqa: E402
from shatter.attention import single_head  # noqa: E402

seen = []
resolve_layer = single_head.resolve_layer


def recording(name, device, dtype, shape=None):
    attend = resolve_layer(name, device, dtype, shape)

    def call(P, X, mask, table, sigmoid):
        seen.append(table)
        return attend(P, X, mask, table, sigmoid)

    return call


single_head.resolve_layer = recording
model = shatter.build_model("shatter-tiny", vocab_size=50, max_len=16, dropout=0.0)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "bf16": {"enabled": True},
    "data_types": {"buffer_dtype": "bf16"},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
layers = [layer.attention for layer in model.encoder.layers]
print("buffer", layers[0].partition.dtype)
ids = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(0))
for impl in ("chunked", "lean", "naive"):
    for attention in layers:
        attention.impl = impl
    seen.clear()
    engine(ids, torch.ones_like(ids), ids)
    err = max((t.double().sum(0) - 1).abs().max().item() for t in seen)
    print(impl, len(seen), {str(t.dtype) for t in seen}.pop() if seen else None, f"{err:.3g}")
