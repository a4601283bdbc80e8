"""The finetuning loop: build, train, evaluate every `eval_every` steps, keep the best.

Functions plus the engine (no trainer class): `finetune(cfg)` loads the export and its tokenizer,
builds the task data (train/finetuning/data.py) and the head (shatter.heads), a DeepSpeed engine
with the trainer's config builder (train/engine.py), and runs. Every rank draws the same global
batch order (seeded per epoch) and takes its slice, so the global batch is `batch_size` on any
world size. Evaluation runs on rank 0 while the others wait; the best model is saved from the
optimizer's fp32 master weights (gathered by every rank).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from train.checkpoint import fp32_masters
from train.config import ConfigError, RunArgs, TrainConfig, check_output
from train.finetuning.config import FinetuneConfig, default_steps, scaled_lr
from train.finetuning.data import SpanData, build_task_data
from train.finetuning.metrics import learned_nothing


def global_batches(
    n: int, batch_size: int, seed: int, rank: int, world: int
) -> Iterator[list[int]]:
    """This rank's share of each global batch, over reshuffled epochs without end: the global
    batches cut one stream, the concatenation of the permutations drawn from (seed, epoch)."""
    if batch_size % world:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by the world size {world}")
    epoch, order, at = 0, np.random.default_rng([seed, 0]).permutation(n), 0
    while True:
        parts, need = [], batch_size
        while need:
            if at == n:
                epoch, at = epoch + 1, 0
                order = np.random.default_rng([seed, epoch]).permutation(n)
            take = min(need, n - at)
            parts.append(order[at : at + take])
            at, need = at + take, need - take
        yield np.concatenate(parts)[rank::world].tolist()


@torch.no_grad()
def predict(
    model: torch.nn.Module, data, batch_size: int, show: bool = False
) -> dict[str, list[np.ndarray]]:
    """Head outputs for every evaluation feature, each trimmed to its own length; with `show`, a
    progress bar of its own below the training bar (gone when done)."""
    from tqdm import tqdm

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs: dict[str, list[np.ndarray]] = {}
    features = data.eval_features
    starts = range(0, len(features), batch_size)
    for start in tqdm(starts, desc="evaluate", unit="batch", leave=False, disable=not show):
        chunk = features[start : start + batch_size]
        batch = data.collate(chunk)
        out = model(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
        )
        for key, value in out.items():
            if key == "loss" or value is None:
                continue
            value = value.float().cpu().numpy()
            rows = outputs.setdefault(key, [])
            for i, f in enumerate(chunk):
                rows.append(
                    value[i, : len(f["input_ids"])]
                    if value.ndim == 2 and key != "logits"
                    else value[i]
                )
    model.train(was_training)
    return outputs


def _head(backbone, data, strategy: str):
    from shatter.heads import SequenceClassificationModel, SpanExtractionModel

    if isinstance(data, SpanData):
        return SpanExtractionModel(backbone)
    return SequenceClassificationModel(backbone, data.num_labels, strategy=strategy)


def _save_best(module: torch.nn.Module, masters: dict, tokenizer: Path, out: Path) -> None:
    """A standalone fp32 copy with the optimizer's fp32 `masters` (under bf16/fp16 the module's
    own weights are rounded), written atomically."""
    from shatter.heads import build_head
    from shatter.model import ShatterForMaskedLM
    from shatter.sources import write_export

    copy = build_head(ShatterForMaskedLM(module.config), module.head_config())
    copy.load_state_dict(masters)
    write_export(copy, tokenizer, out, overwrite=True)


def _agreed(flag: bool, device: torch.device, world: int) -> bool:
    """Rank 0's `flag` on every rank (one broadcast)."""
    if world == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.broadcast(value, src=0)
    return bool(value.item())


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def finetune(cfg: FinetuneConfig) -> dict | None:
    """Run one finetuning; return metrics.json's content on rank 0 (None elsewhere)."""
    import shatter
    from shatter.checkpoint import CheckpointError, tokenizer_path
    from shatter.remote import local_export
    from shatter.sources import describe_non_export
    from train.engine import build_engine, init_distributed, resolved_deepspeed_config
    from train.finetuning.features import Tokenizer
    from train.metrics import MetricsWriter, Progress

    # a remote export (s3://, gs://): its copy in the node's cache, fetched once per node
    checkpoint, run_dir = local_export(cfg.run.checkpoint), Path(cfg.run.output)
    problem = describe_non_export(checkpoint)
    if problem:
        raise CheckpointError(problem)
    check_output(run_dir, directory=True)
    tokenizer_file = tokenizer_path(checkpoint)
    if tokenizer_file is None:
        raise FileNotFoundError(
            f"{checkpoint / 'tokenizer.model'}: the export has no tokenizer (re-export with one)"
        )
    tokenizer = Tokenizer(tokenizer_file)
    backbone = shatter.from_pretrained(checkpoint)
    max_len = cfg.data.max_len or backbone.config.max_len
    if max_len > backbone.config.max_len:
        raise ConfigError(
            f"--max-len {max_len} exceeds {cfg.run.checkpoint}'s max_len {backbone.config.max_len}; "
            f"extend it first: shatter-extend {cfg.run.checkpoint} --max-len {max_len} --output DIR"
        )
    if tokenizer.vocab_size > backbone.config.vocab_size:
        raise ConfigError(
            f"{tokenizer_file} has {tokenizer.vocab_size} pieces, more than the model's "
            f"vocab_size {backbone.config.vocab_size}"
        )
    data = build_task_data(dataclasses.replace(cfg.data, max_len=max_len), tokenizer)
    r = cfg.run
    steps = r.max_steps or default_steps(len(data.train_features), r.batch_size, r.epochs)
    optim = cfg.optim
    if r.scale_lr:
        optim = dataclasses.replace(optim, lr=scaled_lr(optim.lr, backbone.config.hidden))
    warmup = int(r.warmup_ratio * steps) if optim.warmup_steps < 0 else optim.warmup_steps
    optim = dataclasses.replace(
        optim, warmup_steps=max(1, warmup)
    )  # DeepSpeed's schedulers need >= 1

    rank, world = init_distributed()
    torch.manual_seed(r.seed)
    model = _head(backbone, data, r.cls_strategy).train()
    run_args = dataclasses.replace(
        RunArgs(),
        max_steps=steps,
        micro_batch=r.batch_size // world,
        precision=r.precision,
        zero_stage=r.zero_stage,
        seed=r.seed,
        deepspeed_config=r.deepspeed_config,
    )
    train_config = TrainConfig(optim=optim, run=run_args).validate()
    ds_config = resolved_deepspeed_config(train_config, world)
    engine = build_engine(model, train_config, ds_config)
    device = engine.device

    run_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "task": cfg.data.task,
        "main_metric": data.main_metric,
        "max_len": max_len,
        "steps": steps,
        "train_features": len(data.train_features),
        "validation_features": len(data.eval_features),
        "skipped": data.skipped,
        "corrected": getattr(data, "corrected", {}),
        "evaluations": [],
    }
    if rank == 0:
        _write_json(
            run_dir / "config.json",
            {
                "config": cfg.to_dict(),
                "deepspeed": ds_config,
                "world_size": world,
                "max_len": max_len,
                "steps": steps,
                "lr": optim.lr,
                "labels": getattr(data, "labels", None),
            },
        )
        for split, counts in data.skipped.items():
            if counts:
                print(f"{split}: skipped {sum(counts.values())} rows: {counts}", flush=True)
        for split, counts in getattr(data, "corrected", {}).items():
            if counts:
                print(
                    f"{split}: kept {sum(counts.values())} rows after correcting {counts}",
                    flush=True,
                )
    writer = MetricsWriter(run_dir, rank, r.tensorboard)
    progress = Progress(rank, r.progress, 0, steps, desc=f"finetune {cfg.data.task}")
    batches = global_batches(len(data.train_features), r.batch_size, r.seed, rank, world)
    window_loss, window_steps, window_tokens, started = 0.0, 0, 0, time.time()
    window_start = started
    best = None
    try:
        for step in range(1, steps + 1):
            batch = data.collate([data.train_features[i] for i in next(batches)])
            loss = engine(**{k: v.to(device, non_blocking=True) for k, v in batch.items()})["loss"]
            engine.backward(loss)
            engine.step()
            # summed on the device: the loss is read at log steps only (no host sync per step)
            window_loss, window_steps = window_loss + loss.detach().float(), window_steps + 1
            window_tokens += int(batch["attention_mask"].sum()) * world  # this rank's share, scaled
            if step % r.log_every == 0 or step == steps:
                lr, now = engine.get_lr()[0], time.time()
                window_loss = float(window_loss)
                tokens_per_s = window_tokens / max(now - window_start, 1e-9)
                writer.write(
                    {
                        "step": step,
                        "loss": window_loss / window_steps,
                        "lr": lr,
                        "tokens_per_s": round(tokens_per_s, 1),
                        "elapsed_s": round(now - started, 2),
                    }
                )
                progress.update(window_steps, window_loss / window_steps, lr, tokens_per_s)
                window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, now
            if step % r.eval_every and step != steps:
                continue
            improved = False
            if rank == 0:  # ZeRO-0..2: a forward is no collective, the other ranks wait
                outputs = predict(engine.module, data, r.eval_batch_size, show=r.progress)
                scores, predictions = data.score(outputs)
                record = {"step": step, **scores}
                summary["evaluations"].append(record)
                writer.write({"split": "validation", **record})
                progress.write(
                    f"step {step}: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float))
                )
                if best is None or scores[data.main_metric] > best[data.main_metric]:
                    best, improved = record, True
                    _write_json(run_dir / "predictions.json", predictions)
            if r.save_best and _agreed(improved, device, world):
                masters = fp32_masters(engine)  # a collective under ZeRO: every rank gathers
                if rank == 0:
                    _save_best(engine.module, masters, tokenizer_file, run_dir / "best")
                del masters
            if world > 1:
                torch.distributed.barrier()
    finally:
        progress.close()
        writer.close()
    if rank != 0:
        return None
    summary.update(final=summary["evaluations"][-1], best=best)
    warning = learned_nothing(best, data.main_metric)
    if warning:
        print(warning, file=sys.stderr, flush=True)
        summary["warnings"] = [warning]
    _write_json(run_dir / "metrics.json", summary)
    return summary
