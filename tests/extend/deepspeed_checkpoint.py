"""Helper run by test_deepspeed.py in a subprocess: one real DeepSpeed step, then a checkpoint.

usage: python deepspeed_checkpoint.py OUT_DIR ZERO_STAGE PRECISION
"""

import os
import sys

import torch

os.environ.update(
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=os.environ.get("MASTER_PORT", "29561"),
)

from shatter.train.engine import build_extensions  # noqa: E402

# DeepSpeed's CPU op as the trainer gets it: its per-environment cache, the finished build loaded
# as it is (torch's JIT builder would run ninja, which recompiles when its command line differs)
build_extensions()

import deepspeed  # noqa: E402

import shatter  # noqa: E402

out, stage, precision = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = shatter.build_model(
    "bert-tiny", vocab_size=50, max_len=16, dropout=0.0, attention_dropout=0.0
)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": stage},
    "bf16": {"enabled": precision == "bf16"},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ids = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(0))
loss = engine(ids, torch.ones_like(ids), ids)["loss"]
engine.backward(loss)
engine.step()
# Stage 0 stores the ModelConfig itself; stage 2 the way train/checkpoint.py does (the run config).
if stage == 0:
    client = {"model_config": model.config.to_dict()}
else:
    client = {
        "config": {
            "model": {
                "preset": "bert-tiny",
                "overrides": {"max_len": 16, "dropout": 0.0, "attention_dropout": 0.0},
            },
            "data": {"path": None},
        }
    }
engine.save_checkpoint(out, tag="step00000001", client_state=client)
# ZeRO-2 keeps parameters as views into one flat buffer, which safetensors refuses: copy out.
reference = shatter.ShatterForMaskedLM(model.config)
reference.load_state_dict(
    {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
)
shatter.save_pretrained(reference, os.path.join(out, "..", "reference"))
