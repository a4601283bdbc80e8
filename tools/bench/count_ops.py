"""Aten ops and host reads of the trainer's step, per precision x ZeRO stage, beside plain AdamW.

    python tools/bench/count_ops.py [--preset bert-base] [--precisions fp32,bf16] [--stages 0,1,2,3]
                              [--zero-options] [--grad-accum 2]

Each row is a real DeepSpeed engine in one process (CPU, gloo), built from the trainer's own
DeepSpeed config (train/engine.py), stepping real MLM batches. After a warm-up optimizer step, a
TorchDispatchMode counts every aten op that reaches a kernel (views excluded: they launch
nothing) and every host read (`aten._local_scalar_dense`: `.item()`, `float(t)`, `bool(t)`)
in the next optimizer step: forward, `engine.backward` and `engine.step` of each of its
`--grad-accum` micro-batches. An op on a GPU is (at least) one kernel launch, so the count is the
launch cost of a step, which on a GPU at base size rivals its compute (a 16 x 256 bert-base step is
about 10 ms on an H100; 4,000 launches at ~2-3 us each are as long). The counts do not depend on
the batch or the device, so a CPU box measures them.

The baselines are the plain loops a user would write: torch.optim.AdamW(fused=True) on the same
model, fp32 or bf16 autocast (fp32 master weights), with and without clip_grad_norm_(foreach).
`--zero-options` adds rows with DeepSpeed's own switches (contiguous_gradients,
reduce_bucket_size, overlap_comm, bf16 immediate_grad_update) toggled one at a time at bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shatter
from shatter.train.config import resolve
from shatter.train.engine import build_engine, deepspeed_config, init_distributed, merge

REPO = Path(__file__).resolve().parents[2]

HOST_READS = {"aten::_local_scalar_dense"}
ROW_MARK = "count_ops row: "
METADATA = {"aten::_unsafe_view"}  # not a view in its schema, but no kernel either


@dataclass
class Tally:
    """Ops and host reads seen by an OpCounter, by phase."""

    ops: Counter = field(default_factory=Counter)  # phase -> non-view ops
    reads: Counter = field(default_factory=Counter)  # phase -> host reads
    names: Counter = field(default_factory=Counter)  # "phase op" -> count
    read_sites: Counter = field(default_factory=Counter)  # "phase file:line" of each host read
    held: Counter = field(default_factory=Counter)  # "backward" -> bytes held after it (--memory)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by `phase` (set by the caller). View ops are skipped: they only make
    metadata, no kernel runs."""

    def __init__(self):
        super().__init__()
        self.tally, self.phase = Tally(), "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if not (func.is_view or name in METADATA):
            self.tally.ops[self.phase] += 1
            self.tally.names[f"{self.phase} {name.removeprefix('aten::')}"] += 1
        if name in HOST_READS:
            self.tally.reads[self.phase] += 1
            self.tally.read_sites[f"{self.phase} {caller()}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = "other"


def _where(filename: str) -> str:
    """A frame's file: relative to this repository, or to site-packages (`deepspeed/...`)."""
    parts = Path(filename).parts
    if "site-packages" in parts:  # also a venv inside the repository (`make setup`'s .venv)
        return "/".join(parts[parts.index("site-packages") + 1 :])
    path = Path(filename)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "/".join(parts[-2:])


def caller() -> str:
    """The innermost frames outside torch: who asked for the value."""
    outside = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
    return " < ".join(f"{_where(f.filename)}:{f.lineno}" for f in outside[-3:][::-1])


def mlm_batch(batch: int, length: int, vocab: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, length), generator=gen)
    chosen = torch.rand(batch, length, generator=gen) < 0.15
    chosen[:, 0] = True  # at least one prediction per row
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    predicted = shatter.model.predicted_positions(labels)  # as the trainer's loader gives them
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "predicted": predicted}  # fmt: skip


def engine_step(engine, batches: list[dict], counter: OpCounter | None) -> None:
    """One optimizer step of the engine: len(batches) micro-batches; with a counter, the most
    bytes the engine holds after a backward or as one starts (`held_bytes`, `watch_buckets`)."""
    for batch in batches:
        ctx = counter.counting if counter else lambda _: contextlib.nullcontext()
        with ctx("forward"):
            loss = engine(**batch)["loss"]
        with ctx("backward"):
            engine.backward(loss)
        if counter:
            held = counter.tally.held
            held["backward"] = max(held["backward"], held_bytes(engine))
        with ctx("step"):
            engine.step()


def held_bytes(engine) -> int:
    """Bytes of every tensor storage the engine holds: the model's parameters and gradients and
    whatever its optimizer reaches (DeepSpeed's flat buffers, fp32 masters, gradient buckets and
    partitions, the optimizer's states), each storage once. The same structures on a GPU, so
    a CPU measures the device memory a step's state takes (not the activations')."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    todo = [engine.optimizer, *engine.module.parameters()]
    todo += [p.grad for p in engine.module.parameters()]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            todo += list(obj)
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")):
            todo += list(vars(obj).values())
    return sum(storages.values())


def count_engine(preset: str, precision: str, stage: int, options: dict, args) -> Tally:
    cfg = resolve(
        None,
        {
            "precision": precision,
            "zero_stage": stage,
            "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum,
            "max_steps": 1000,
            "warmup_steps": 10,
            "optim_impl": getattr(args, "optim_impl", "auto"),
        },
    )
    torch.manual_seed(0)
    model = shatter.build_model(preset, vocab_size=args.vocab, max_len=max(512, args.seq_len))
    # the GPU's config (torch's fused AdamW as the client optimizer, which runs on a CPU too),
    # with overlap_comm off: gloo has no side streams
    ds = deepspeed_config(cfg, 1, cpu=False)
    if stage:
        ds["zero_optimization"]["overlap_comm"] = False
    ds = merge(ds, options)
    engine = build_engine(model, cfg, ds)
    batches = [
        mlm_batch(args.micro_batch, args.seq_len, args.vocab, i) for i in range(args.grad_accum)
    ]
    for _ in range(args.warmup):  # optimizer states, lazy buffers, ZeRO-3's parameter trace
        engine_step(engine, batches, None)
    counter = OpCounter()
    watch_buckets(engine, counter.tally)
    with counter:
        engine_step(engine, batches, counter)
    return counter.tally


def watch_buckets(engine, tally: Tally) -> None:
    """ZeRO-1/2's gradient buckets are made as a backward starts and released as it ends: the
    bytes held just after they are made also count towards tally.held's peak."""
    setup = getattr(engine.optimizer, "setup_buckets", None)
    if setup is None:
        return

    def setup_buckets():
        setup()
        tally.held["backward"] = max(tally.held["backward"], held_bytes(engine))

    engine.optimizer.setup_buckets = setup_buckets


def count_plain(preset: str, precision: str, clip: bool, args) -> Tally:
    """The baseline: model, autocast at bf16, fused AdamW, zero_grad(set_to_none)."""
    torch.manual_seed(0)
    model = shatter.build_model(preset, vocab_size=args.vocab, max_len=max(512, args.seq_len))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01, fused=True)
    batches = [
        mlm_batch(args.micro_batch, args.seq_len, args.vocab, i) for i in range(args.grad_accum)
    ]
    amp = precision == "bf16"

    def step(counter):
        ctx = counter.counting if counter else lambda _: contextlib.nullcontext()
        for batch in batches:
            with ctx("forward"), torch.autocast("cpu", torch.bfloat16, enabled=amp):
                loss = model(**batch)["loss"]
            with ctx("backward"):
                (loss / len(batches)).backward()
        with ctx("step"):
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    step(None)
    counter = OpCounter()
    with counter:
        step(counter)
    return counter.tally


# DeepSpeed's switches tried at bf16 (ZeRO stage, name, config merged over the trainer's).
ZERO_OPTIONS = [
    # off: no per-tensor pass and no test of the norm either, so a NaN step would be applied
    (1, "check_grad_overflow off", {"bf16": {"check_grad_overflow": False}}),
    (1, "contiguous_gradients off", {"zero_optimization": {"contiguous_gradients": False}}),
    (1, "reduce_bucket_size 5e7", {"zero_optimization": {"reduce_bucket_size": int(5e7)}}),
    (1, "reduce_bucket_size 2e9", {"zero_optimization": {"reduce_bucket_size": int(2e9)}}),
    (1, "overlap_comm on", {"zero_optimization": {"overlap_comm": True}}),
    (1, "reduce_scatter off", {"zero_optimization": {"reduce_scatter": False}}),
    # fp32 gradient accumulation at ZeRO-1 takes DeepSpeed's BF16_Optimizer, where
    # immediate_grad_update applies
    (1, "grad_accum_dtype fp32", {"data_types": {"grad_accum_dtype": "fp32"}}),
    (
        1,
        "grad_accum_dtype fp32 + immediate_grad_update",
        {"data_types": {"grad_accum_dtype": "fp32"}, "bf16": {"immediate_grad_update": True}},
    ),
    (2, "contiguous_gradients off", {"zero_optimization": {"contiguous_gradients": False}}),
]


def row(name: str, tally: Tally, grad_accum: int) -> str:
    f, b, s = (tally.ops[p] for p in ("forward", "backward", "step"))
    reads = "/".join(str(tally.reads[p]) for p in ("forward", "backward", "step"))
    per_micro = (f + b) / grad_accum
    held = tally.held["backward"]
    return (
        f"| {name} | {f // grad_accum:,} | {b // grad_accum:,} | {s:,} | {per_micro:,.0f} "
        f"| {f + b + s:,} | {reads} | " + (f"{held / 2**20:,.0f} |" if held else "— |")
    )


def count_row(spec: dict, args) -> Tally:
    """One row in this process: {"plain": bool, "precision", "stage", "clip", "options"}."""
    if spec["plain"]:
        return count_plain(args.preset, spec["precision"], spec["clip"], args)
    return count_engine(args.preset, spec["precision"], spec["stage"], spec["options"], args)


def rows_of(args) -> list[tuple[str, dict]]:
    rows = []
    for precision in args.precisions.split(","):
        for clip in (False, True):
            name = f"{precision}, plain fused AdamW" + (" + clip" if clip else "")
            rows.append((name, {"plain": True, "precision": precision, "clip": clip}))
        for stage in map(int, args.stages.split(",")):
            spec = {"plain": False, "precision": precision, "stage": stage, "options": {}}
            rows.append((f"{precision}, ZeRO-{stage}", spec))
    if args.zero_options:
        for stage, name, options in ZERO_OPTIONS:
            spec = {"plain": False, "precision": "bf16", "stage": stage, "options": options}
            rows.append((f"bf16, ZeRO-{stage}, {name}", spec))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps before counting")
    parser.add_argument("--zero-options", action="store_true")
    parser.add_argument("--only", help="count only the rows whose name contains this")
    parser.add_argument("--top", type=int, default=0, help="list the N most frequent ops per row")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, JSON, in a child
    args = parser.parse_args()
    if args.row:  # a child: count one row, print its tally as JSON
        init_distributed()
        torch.set_num_threads(1)
        tally = count_row(json.loads(args.row), args)
        print(ROW_MARK + json.dumps({k: dict(v) for k, v in vars(tally).items()}))
        return
    results = []
    for name, spec in rows_of(args):
        if args.only and args.only not in name:
            continue
        # each row in a fresh process: DeepSpeed engines are not freed by destroy(), and a
        # fresh process group per engine keeps rows independent
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--row", json.dumps(spec)],
            capture_output=True,
            text=True,
        )
        line = next((x for x in child.stdout.splitlines() if x.startswith(ROW_MARK)), None)
        if child.returncode or line is None:
            tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
            results.append((name, None, tail))
            continue
        data = json.loads(line[len(ROW_MARK) :])
        results.append((name, Tally(**{k: Counter(v) for k, v in data.items()}), ""))
    print(
        f"{args.preset}, micro-batch {args.micro_batch} x length {args.seq_len}, "
        f"grad_accum {args.grad_accum}, one optimizer step after {args.warmup} warm-up step(s) "
        "(CPU, 1 process)"
    )
    print(
        "| path | forward ops / micro | backward ops / micro | step ops / optimizer step "
        "| fwd+bwd / micro | ops / optimizer step | host reads / optimizer step (fwd/bwd/step) "
        "| MiB held (a backward's start or end) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, tally, error in results:
        print(row(name, tally, args.grad_accum) if tally else f"| {name} | {error} |||||||")
    if args.top:
        for name, tally, _ in results:
            if tally is None:
                continue
            top = ", ".join(f"{op} {n}" for op, n in tally.names.most_common(args.top))
            print(f"{name}: {top}")
            for site, n in tally.read_sites.most_common():
                print(f"    host read x{n}: {site}")


if __name__ == "__main__":
    main()
