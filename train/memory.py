"""`--dry-run`: the resolved configs, parameter counts and a per-GPU memory estimate.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, §5 and Fig. 1): with Ψ parameters,
N_d data-parallel GPUs and K bytes of optimizer state per parameter, per GPU
    stage 0: (w + g + K) Ψ          stage 1: (w + g) Ψ + K Ψ / N_d
    stage 2: w Ψ + (g + K) Ψ / N_d  stage 3: (w + g + K) Ψ / N_d
where mixed precision (fp16/bf16) has w = g = 2 and K = 12 (fp32 master weights, Adam m and v)
and fp32 has w = g = 4, K = 8.

Activations are measured, not modelled: one micro-batch of the real model at the real length runs
forward on CPU while a saved-tensors hook records every tensor autograd keeps for the backward
pass (parameters excluded, shared storages counted once). That is the activation memory of a
training step; floating tensors are scaled from fp32 to the run's precision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from train.config import TrainConfig, model_overrides

GIB = 1024**3
CONTEXT_GIB = (
    1.0  # CUDA context, cuBLAS workspace and allocator slack: a rule of thumb, not measured
)


@dataclass(frozen=True)
class ModelStates:
    params: int  # Ψ, tied weights once
    weights: float  # bytes per GPU, per the stage
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_states(params: int, precision: str, stage: int, gpus: int) -> ModelStates:
    w = g = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    shard = lambda b: b * params / gpus  # noqa: E731
    whole = lambda b: b * params  # noqa: E731
    return ModelStates(
        params,
        weights=shard(w) if stage >= 3 else whole(w),
        grads=shard(g) if stage >= 2 else whole(g),
        optimizer=shard(k) if stage >= 1 else whole(k),
    )


def measure_activations(
    model: torch.nn.Module,
    batch: int,
    length: int,
    precision: str,
    vocab: int,
    mask_prob: float = 0.15,
    seed: int = 0,
    objective: str | None = "mlm",
) -> float:
    """Bytes autograd saves for backward in one training forward of [batch, length] (CPU run)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, length), generator=gen)
    labels = torch.where(
        torch.rand(batch, length, generator=gen) < mask_prob, ids, torch.full_like(ids, -100)
    )
    mask = torch.ones_like(ids)
    order = {}
    if objective == "plm":  # two streams: the targets last in a random order (train/plm.py)
        rank = torch.rand(batch, length, generator=gen).argsort(-1).argsort(-1)
        order["perm_rank"] = torch.where(labels != -100, rank, -1)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, bool]] = {}
    kept = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr not in storages:
            storages[ptr] = (storage.nbytes(), t.is_floating_point())
            kept.append(t)  # held as training holds it, so freed memory is not re-counted
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=mask, labels=labels, **order)
    del out
    kept.clear()
    scale = 1.0 if precision == "fp32" else 0.5
    return sum(n * (scale if floating else 1.0) for n, floating in storages.values())


def estimate(cfg: TrainConfig, model: torch.nn.Module, seq_len: int, vocab: int) -> dict:
    r = cfg.run
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    stages = {s: model_states(params, r.precision, s, r.num_gpus) for s in range(4)}
    activations = measure_activations(
        model,
        r.micro_batch,
        seq_len,
        r.precision,
        vocab,
        cfg.data.mask_prob,
        r.seed,
        cfg.data.objective,
    )
    chosen = stages[r.zero_stage].total + activations + CONTEXT_GIB * GIB
    return {
        "params": params,
        "stages": {s: st.total for s, st in stages.items()},
        "stage_parts": {s: (st.weights, st.grads, st.optimizer) for s, st in stages.items()},
        "activations": activations,
        "total": chosen,
        "fits": chosen <= r.gpu_memory_gb * GIB,
    }


def dry_run_report(cfg: TrainConfig) -> str:
    import shatter
    from pipeline.format import DatasetError, read_index
    from train.engine import resolved_deepspeed_config

    index = None
    if cfg.data.path:
        try:
            index = read_index(cfg.data.path, verify_tokenizer=False)
        except DatasetError as err:
            note = f"(data not read: {err})"
        else:
            note = f"(data: {cfg.data.path}, seq_len {index.seq_len}, vocab {index.vocab_size})"
    else:
        note = "(no --data: vocabulary and length from the config and the preset)"
    seq_len = cfg.data.seq_len or (index.seq_len if index else 256)
    torch.manual_seed(cfg.run.seed)
    # as pretrain.py builds it
    model = shatter.build_model(cfg.model.preset, **model_overrides(cfg, index, seq_len))
    vocab = model.config.vocab_size
    ds = resolved_deepspeed_config(
        cfg, cfg.run.num_gpus, cpu=False if cfg.run.precision == "fp16" else None
    )
    est = estimate(cfg, model, seq_len, vocab)
    r = cfg.run
    lines = [
        "# resolved config",
        json.dumps(cfg.to_dict(), indent=2),
        f"# DeepSpeed config for {r.num_gpus} GPU(s)",
        json.dumps(ds, indent=2),
        "# parameters",
        f"total (tied weights once): {est['params']:,}",
        f"without word embeddings (Table 2 convention): {shatter.count_parameters(model):,}",
        f"# memory per GPU: {cfg.model.preset}, {r.precision}, micro-batch {r.micro_batch} x length {seq_len}, "
        f"{r.num_gpus} GPU(s) {note}",
    ]
    for stage in range(4):
        w, g, o = est["stage_parts"][stage]
        mark = "  <- this run" if stage == r.zero_stage else ""
        lines.append(
            f"ZeRO-{stage} model states: {est['stages'][stage] / GIB:6.2f} GiB "
            f"(weights {w / GIB:.2f}, grads {g / GIB:.2f}, optimizer {o / GIB:.2f}){mark}"
        )
    verdict = "fits" if est["fits"] else "DOES NOT FIT"
    lines += [
        f"activations per micro-batch (measured on CPU, scaled to {r.precision}): {est['activations'] / GIB:.2f} GiB",
        f"CUDA context and workspace (rule of thumb): {CONTEXT_GIB:.2f} GiB",
        f"estimated peak per GPU at ZeRO-{r.zero_stage}: {est['total'] / GIB:.2f} GiB of {r.gpu_memory_gb:g} GiB: {verdict}",
    ]
    return "\n".join(lines)
