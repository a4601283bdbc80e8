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
training step; floating tensors are scaled from fp32 to the run's precision. A micro-batch above
PROBE_BATCH is measured at PROBE_BATCH and scaled linearly (activations are linear in the batch),
so a CPU box can estimate a GPU's micro-batch of 64 without holding its activations.

DeepSpeed's own buffers at ZeRO-1/2: the gradient reduction bucket, `reduce_bucket_size`
elements of the gradient dtype (the model's, unless `data_types.grad_accum_dtype` says fp32),
twice with `overlap_comm` (its double buffer; DeepSpeed's stage_1_and_2.setup_buckets), the
default 5e8 capped at the model's trainable parameters (train/engine.py: fit_reduce_bucket): bf16
on GPUs, 2 x 5e8 x 2 B = 1.86 GiB uncapped, 2 x 210 MiB for bert-base; none with
`contiguous_gradients` off (ZeRO-1 on one GPU: train/engine.py). ZeRO-3 adds its reduce bucket and its
`stage3_prefetch_bucket_size` (DeepSpeed's default 5e7) of weights.

In fp16 (a V100's precision) the peak also holds the W that `auto`'s `rows-keep` keeps where a
run on a V100 takes it (shatter/attention/single_head.py: rows_to_keep; the base width at l = 1024).

`--target gpu` estimates for a GPU from any box: the DeepSpeed config a GPU run gets (overlap_comm
on, torch's fused AdamW), its bucket buffers and the CUDA context. Activations are still measured
on the CPU with the CPU's attention impl: BERT's math-path SDPA saves the l x l probabilities that
a GPU's flash attention does not, so for softmax archs the estimate errs high.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from shatter.train.config import TrainConfig, data_sources, model_overrides

GIB = 1024**3
PROBE_BATCH = 4  # larger micro-batches are measured at this size and scaled linearly
STAGE3_PREFETCH = int(5e7)  # DeepSpeed's default stage3_prefetch_bucket_size (elements)
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


def bucket_bytes(ds_config: dict, precision: str) -> float:
    """DeepSpeed's gradient reduction (and ZeRO-3 prefetch) buffers of one rank."""
    zero = ds_config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage == 0:
        return 0.0
    accum = ds_config.get("data_types", {}).get("grad_accum_dtype")
    element = 4 if precision == "fp32" or accum in ("fp32", "float32") else 2
    reduce = int(zero.get("reduce_bucket_size", 5e8)) * element
    if stage in (1, 2) and not zero.get("contiguous_gradients", True):
        reduce = 0  # no contiguous bucket: the gradients stay where autograd put them
    buffers = reduce * (2 if zero.get("overlap_comm") else 1)
    if stage == 3:
        buffers += int(zero.get("stage3_prefetch_bucket_size", STAGE3_PREFETCH)) * element
    return float(buffers)


def estimate(
    cfg: TrainConfig, model: torch.nn.Module, seq_len: int, vocab: int, buckets: float = 0.0
) -> dict:
    r = cfg.run
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    stages = {s: model_states(params, r.precision, s, r.num_gpus) for s in range(4)}
    probe = min(r.micro_batch, PROBE_BATCH)
    measured = measure_activations(
        model, probe, seq_len, r.precision, vocab, cfg.data.mask_prob, r.seed, cfg.data.objective
    )
    per_sample = measured / probe
    fixed = stages[r.zero_stage].total + buckets + CONTEXT_GIB * GIB
    chosen = fixed + per_sample * r.micro_batch
    return {
        "params": params,
        "stages": {s: st.total for s, st in stages.items()},
        "stage_parts": {s: (st.weights, st.grads, st.optimizer) for s, st in stages.items()},
        "activations": per_sample * r.micro_batch,
        "buckets": buckets,
        "total": chosen,
        "fits": chosen <= r.gpu_memory_gb * GIB,
        "largest_micro_batch": max(int((r.gpu_memory_gb * GIB - fixed) // per_sample), 0),
    }


def _kept_rows(model: torch.nn.Module, r, seq_len: int) -> int:
    """The bytes of W a run in fp16 keeps on a V100 (sm_70) of r.gpu_memory_gb where `auto`
    takes `rows-keep` (shatter.attention.single_head.rows_to_keep); 0 otherwise."""
    if r.precision != "fp16":
        return 0
    from shatter.attention.single_head import rows_to_keep

    memory = r.gpu_memory_gb * GIB
    return rows_to_keep(model, r.micro_batch, seq_len, torch.float16, (7, 0), memory)


def dry_run_report(cfg: TrainConfig, target: str = "auto") -> str:
    """`target`: "gpu" estimates for a GPU from any box, "auto" for this machine's kind."""
    import shatter
    from shatter.shards import DatasetError, read_index
    from shatter.train.engine import fit_reduce_bucket, resolved_deepspeed_config

    index = None
    if cfg.data.path:
        path = data_sources(cfg.data.path)[0][0]  # mixed datasets share the first's vocabulary
        try:
            index = read_index(path, verify_tokenizer=False)
        except DatasetError as err:
            note = f"(data not read: {err})"
        else:
            note = f"(data: {path}, seq_len {index.seq_len}, vocab {index.vocab_size})"
    else:
        note = "(no --data: vocabulary and length from the config and the preset)"
    seq_len = cfg.data.seq_len or (index.seq_len if index else 256)
    torch.manual_seed(cfg.run.seed)
    # as pretrain.py builds it
    model = shatter.build_model(cfg.model.preset, **model_overrides(cfg, index, seq_len))
    vocab = model.config.vocab_size
    gpu = target == "gpu" or cfg.run.precision == "fp16"
    ds = resolved_deepspeed_config(cfg, cfg.run.num_gpus, cpu=False if gpu else None)
    ds = fit_reduce_bucket(ds, model)  # as build_engine gives it to DeepSpeed
    est = estimate(cfg, model, seq_len, vocab, bucket_bytes(ds, cfg.run.precision))
    r = cfg.run
    kept = _kept_rows(model, r, seq_len)
    if kept:  # a V100's run keeps the partition layers' W: in the peak, and per sample
        fixed = est["total"] - est["activations"]
        est["total"] += kept
        est["fits"] = est["total"] <= r.gpu_memory_gb * GIB
        per_sample = (est["activations"] + kept) / r.micro_batch
        est["largest_micro_batch"] = max(int((r.gpu_memory_gb * GIB - fixed) // per_sample), 0)
    lines = [
        "# resolved config",
        json.dumps(cfg.to_dict(), indent=2),
        f"# DeepSpeed config for {r.num_gpus} GPU(s)",
        json.dumps(ds, indent=2),
        "# parameters",
        f"total (tied weights once): {est['params']:,}",
        f"encoder without word embeddings (Table 2 convention): "
        f"{shatter.count_parameters(model.encoder):,}",
        f"with the MLM head (its decoder tied to the word embeddings): "
        f"{shatter.count_parameters(model):,}",
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
    kept_line = [f"W that auto's rows-keep keeps on a V100 or T4 in fp16: {kept / GIB:.2f} GiB"]
    lines += [
        f"activations per micro-batch (measured on CPU, scaled to {r.precision}): {est['activations'] / GIB:.2f} GiB",
        f"DeepSpeed reduction buckets (reduce_bucket_size, x2 with overlap_comm): {est['buckets'] / GIB:.2f} GiB",
        f"CUDA context and workspace (rule of thumb): {CONTEXT_GIB:.2f} GiB",
        *(kept_line if kept else []),
        f"estimated peak per GPU at ZeRO-{r.zero_stage}: {est['total'] / GIB:.2f} GiB of {r.gpu_memory_gb:g} GiB: {verdict}",
        f"largest micro-batch that fits {r.gpu_memory_gb:g} GiB at ZeRO-{r.zero_stage}: {est['largest_micro_batch']}",
    ]
    return "\n".join(lines)
