"""The training step measured on this GPU beside tools/bench/step_cost.py's model of it, with the
profiler's split of the GPU's time into the model's groups.

    python tools/bench/step_cost.py --gpus H200 --json modelled.json     # on any machine
    python tools/bench/step_measure.py --modelled modelled.json --gpu H200  # on the GPU

Each (arch, length, mode) runs the step step_cost.py models, on real tensors: base size,
vocabulary 30,000, 16,384 tokens of full rows (no attention mask: SDPA's fastest kernel, which
under torch 2.11 on an H200 is cuDNN's, not FlashAttention-2 as the model assumes), the
model's weights in bf16 as DeepSpeed's bf16 mode keeps them, and ZeRO-1's optimizer step on one
rank as the trainer runs it (`Zero1`: by default bf16's one-pass step, `--optim-impl torch`
DeepSpeed stepping torch's fused AdamW, as step_cost.py prices either). `eager` runs the model as it is; `compiled` compiles
it as the trainer does (shatter/train/compiling.py).

Printed per row: ms a step (median of --steps after warm-up) beside the model's, and the
profiler's CUDA time a step per group beside the model's split:
    GEMMs        kernels named as cuBLAS's (gemm, nvjet, cutlass, xmma) outside the groups below,
                 and the FFN's GEMMs with GELU in their epilogues (`shatter::linear_gelu*`)
    attention    every kernel launched inside an SDPA op or another `shatter::` custom op
    elementwise  every other kernel of the forward and backward, copies and memsets included
    optimizer    every kernel launched inside the optimizer step
    gaps         the step's (unprofiled) wall time that no kernel filled (the model's "launches")
and the kernels a step, measured and modelled. Then Shatter / BERT per length and mode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shatter.kernels.cost import FFN_OPS
from shatter.kernels.launch import INTERPRET
from shatter.model import predicted_positions
from shatter.tools.bench.step_trace import DEEPSPEED_SCALAR_OPS, adamw
from shatter.train.compiling import mark_varying
from shatter.train.master_step import MASTER_IMPLS
from shatter.train.mix_order import WRAPPER_CUSTOM_OPS

GROUPS = ("gemm", "attention", "elementwise", "optimizer", "gaps")
MODEL_GROUPS = {"gemm": "gemm", "attention": "attention", "elementwise": "elementwise"}
MODEL_GROUPS |= {"optimizer": "optimizer", "gaps": "launches"}
GEMM_NAMES = re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)
# a kernel launched inside one of these ops is the op's group: the FFN's GEMMs with GELU in their
# epilogues are GEMMs, a LayerNorm backward's gradients finished by inductor's wrapper
# (train/mix_order.py) elementwise, as the plan prices them; every other `shatter::` op attention
RANGE_GROUPS = (
    (re.compile("^(" + "|".join(FFN_OPS) + ")$"), "gemm"),
    (re.compile("^(" + "|".join(WRAPPER_CUSTOM_OPS) + ")$"), "elementwise"),
    (re.compile(r"^shatter::|flash_attention|efficient_attention|cudnn_attention"), "attention"),
)
OPTIMIZER_RANGE = "step_measure::optimizer"
TOP = 15  # kernels printed per contender, by GPU time (the JSON has them all)


class Zero1:
    """DeepSpeed's ZeRO-1 step on one rank, as step_trace.zero1_step traces it, on real
    buffers: each parameter group's parameters are views of the group's flat low-precision
    buffer (the weights; the 1-D parameters), as DeepSpeed keeps them; the gradients stay where
    autograd put them (one rank: no contiguous bucket and no reduction, train/engine.py). The
    global norm's squares by one multi-tensor norm and a `dot`; then with `one_pass` (bf16's
    `optim.impl` `auto` or `master`, train/master_step.py) the step's scalars in one kernel and
    each group's one-pass AdamW on the gradients where they lie, else (`torch`) the scalars in
    DEEPSPEED_SCALAR_OPS one-element kernels, each group's gradients cast into a flat fp32
    buffer, torch's fused AdamW with the clip's factor and the skip's verdict, and the master
    copied back into the flat parameters."""

    def __init__(self, model: torch.nn.Module, one_pass: bool = False):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.groups = []
        for group in (
            [p for p in self.params if p.dim() >= 2],
            [p for p in self.params if p.dim() < 2],
        ):
            if group:
                self.groups.append(_Group(group))
        self.scalar = torch.zeros((), device=self.params[0].device)
        self.one_pass = one_pass

    def step(self) -> None:
        from shatter.train.engine import joined

        grads = [[p.grad.reshape(-1) for p in g.params] for g in self.groups]
        norms = joined(torch._foreach_norm(sum(grads, []), 2, dtype=torch.float32))
        squares = torch.dot(norms, norms)
        if self.one_pass:
            self._one_pass(squares, grads)
        else:
            self._torch(squares, grads)
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def _one_pass(self, squares: torch.Tensor, grads: list[list[torch.Tensor]]) -> None:
        from shatter.kernels.master_adamw import master_adamw_
        from shatter.kernels.norm_verdict import norm_verdict

        steps = [g.step_count for g in self.groups]
        _, bad, factor = norm_verdict(squares, self.scalar, steps, 1.0, False)  # clip at 1
        for g, group in zip(self.groups, grads, strict=True):
            master_adamw_(
                group, g.master, g.m, g.v, g.step_count, g.flat, 1e-4, 0.9, 0.999, 1e-8, 0.01,
                grad_scale=factor, found_inf=bad, step_counted=True,
            )  # fmt: skip

    def _torch(self, squares: torch.Tensor, grads: list[list[torch.Tensor]]) -> None:
        for _ in range(DEEPSPEED_SCALAR_OPS):
            self.scalar.add_(1.0)
        norm = squares.sqrt()
        factor = torch.clamp(norm + 1e-6, min=1.0)  # the trainer's clip at 1 (train/engine.py)
        bad = torch.isfinite(norm).logical_not().float()  # its skip, made on the device
        for g, group in zip(self.groups, grads, strict=True):
            grad = torch.empty_like(g.master)  # cast as it is flattened (flatten_into_fp32)
            torch._foreach_copy_(list(grad.split([t.numel() for t in group])), group)
            g.step_count += 1
            adamw([g.master], [grad], [g.m], [g.v], [g.step_count], factor, bad)
            g.flat.copy_(g.master)


class _Group:
    """One parameter group of Zero1: its flat parameters, fp32 master and moments."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        dev, low = params[0].device, params[0].dtype
        numel = sum(p.numel() for p in params)
        self.flat = torch.empty(numel, dtype=low, device=dev)
        offset = 0
        for p in params:
            self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.master = self.flat.float()
        self.m, self.v = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.step_count = torch.zeros((), device=dev)


def batch(rows: int, length: int, vocab: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, length), generator=g)
    labels = torch.where(torch.rand(rows, length, generator=g) < 0.15, ids, -100)
    predicted = predicted_positions(labels)  # on the host, as the trainer's loader counts them
    return ids.to(device), labels.to(device), predicted.to(device)


def build(arch: str, length: int, args, compiled: bool):
    """The model of `arch` in bf16 on the device (compiled as the trainer compiles it) and its
    ZeRO-1 optimizer."""
    import shatter
    from shatter.tools.bench.step_cost import traced_max_len
    from shatter.train.compiling import compile_model

    torch.manual_seed(0)
    model = shatter.build_model(
        f"{arch}-{args.size}", vocab_size=args.vocab, max_len=traced_max_len(length)
    )
    model = model.to(device=args.device, dtype=torch.bfloat16).train()
    # the trainer's `auto`: the one-pass step where its kernels run (train/master_step.py)
    runs = args.device == "cuda" or INTERPRET
    opt = Zero1(model, one_pass=args.optim_impl in MASTER_IMPLS and runs)
    if compiled:
        compile_model(model)
    return model, opt


def step_fn(model, opt, batches):
    def step():
        ids, labels, predicted = next(batches)
        mark_varying({"predicted": predicted})
        model(ids, None, labels, predicted=predicted)["loss"].backward()
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            opt.step()

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, steps: int, device: str) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profiled(step, steps: int, device: str) -> dict:
    """The profiler's kernels over `steps` steps: ms a step per group, kernels a step, the wall
    ms a step under the profiler, and the kernels of most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    split = split_kernels(events)
    out = {g: split[g] / 1e3 / steps for g in GROUPS if g != "gaps"}
    out["kernels"] = split["kernels"] / steps
    out["wall"] = wall
    ranked = sorted(split["by_name"].items(), key=lambda kv: -kv[1][0])
    out["by_name"] = [[name, group, t / steps, n / steps] for (name, group), (t, n) in ranked]
    return out


def split_kernels(events: list[dict]) -> dict:
    """µs of GPU time per group and the kernel count, from a chrome trace's events: a kernel's
    group is the range its launch (matched by correlation id) sits in, else its name's."""
    ranges = []  # (start, end, group) of the CPU ranges that decide a kernel's group
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        name = e.get("name", "")
        group = "optimizer" if name == OPTIMIZER_RANGE else None
        for pattern, of in RANGE_GROUPS:
            group = group or (of if pattern.search(name) else None)
        if group:
            ranges.append((e["ts"], e["ts"] + e.get("dur", 0), group))
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
    split = dict.fromkeys(GROUPS, 0.0) | {"kernels": 0, "by_name": {}}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        at = launches.get(e.get("args", {}).get("correlation"))
        inside = [g for s, t, g in ranges if at is not None and s <= at <= t]
        group = "optimizer" if "optimizer" in inside else (inside[0] if inside else None)
        if group is None:
            group = "gemm" if GEMM_NAMES.search(e.get("name", "")) else "elementwise"
        split[group] += e.get("dur", 0)
        split["kernels"] += 1
        key = (e.get("name", "?"), group)
        total, count = split["by_name"].get(key, (0.0, 0))
        split["by_name"][key] = (total + e.get("dur", 0), count + 1)
    return split


def measure(arch: str, length: int, mode: str, args) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = build(arch, length, args, mode == "compiled")
    rows = args.tokens // length
    data = [batch(rows, length, args.vocab, seed, args.device) for seed in range(4)]
    step = step_fn(model, opt, itertools.cycle(data))
    t0 = time.perf_counter()
    for _ in range(args.warmup):  # compiles (every mask count's graphs) and autotunes
        step()
    sync(args.device)
    first = time.perf_counter() - t0
    ms = timed(step, args.steps, args.device)
    prof = profiled(step, 3, args.device)
    prof["gaps"] = max(ms - sum(prof[g] for g in GROUPS if g != "gaps"), 0.0)  # unprofiled wall
    del model, opt
    graphs = {  # Dynamo's: graphs compiled, and the graph breaks with their reasons
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": {
            reason.splitlines()[0][:120]: n for reason, n in counters["graph_break"].items()
        },
    }
    return {"ms": ms, "tokens_per_s": rows * length / ms * 1e3, "warmup_s": first, **prof, **graphs}


def modelled_of(path: str | None, gpu: str) -> dict:
    """step_cost.py's figures for `gpu` from its --json file ({} without one)."""
    if not path:
        return {}
    try:
        figures = json.loads(Path(path).read_text())["figures"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"step_measure: cannot read step_cost's JSON {path} ({e})") from None
    if gpu not in figures:
        raise SystemExit(
            f"step_measure: {path} models {', '.join(figures)}, not the {gpu}: run "
            f"tools/bench/step_cost.py --gpus {gpu} --json {path}"
        )
    return figures[gpu]


def row(arch: str, length: int, mode: str, m: dict, model: dict | None) -> str:
    """One table row: each measured figure, then the model's beside it ("-" without one)."""

    def pair(measured: float, modelled: float | None, fmt: str = "{:.2f}") -> str:
        return fmt.format(measured) + " / " + ("-" if modelled is None else fmt.format(modelled))

    split = (model or {}).get("split_ms", {})
    cells = [arch, str(length), mode, pair(m["ms"], model and model["ms_per_step"], "{:.1f}")]
    cells += [f"{m['tokens_per_s'] / 1e3:.0f}k"]
    cells += [pair(m[g], split.get(MODEL_GROUPS[g])) for g in GROUPS]
    cells += [pair(m["kernels"], model and model["kernels"], "{:.0f}"), f"{m['warmup_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"


HEAD = ["arch", "l", "mode", "ms/step", "tokens/s", "GEMMs ms", "attention ms", "elementwise ms"]
HEAD += ["optimizer ms", "gaps ms", "kernels", "warm-up s"]


def ratios(results: dict, modelled: dict) -> None:
    """Shatter / BERT, measured and modelled, per length and mode."""
    for (arch, length, mode), m in results.items():
        bert = results.get(("bert", length, mode))
        if arch == "bert" or not bert:
            continue
        model = modelled.get(arch, {}).get(str(length), {}).get(mode, {})
        said = f" (modelled {model['ratio_to_bert']:.3f})" if model.get("ratio_to_bert") else ""
        print(f"{arch} / bert, l = {length}, {mode}: {m['ms'] / bert['ms']:.3f}{said}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default="bert,shatter")
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a step (full rows)")
    parser.add_argument("--vocab", type=int, default=30000)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=6, help="untimed steps first (compiling)")
    parser.add_argument("--modelled", help="step_cost.py's --json file, for the model's figures")
    parser.add_argument(
        "--gpu", help="the modelled GPU (default: this one's name: H100, H200, A100)"
    )
    parser.add_argument("--json", help="write the measured figures here")
    parser.add_argument("--size", default="base")
    parser.add_argument(
        "--optim-impl", default="auto", help="the trainer's optim.impl (bf16: auto is master)"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the tool (tiny)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "step_measure: needs a CUDA GPU, or --device cpu (tools/bench/step_measure.py)"
        )
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    args.gpu = args.gpu or next((g for g in ("H100", "H200", "A100", "V100") if g in name), "H100")
    modelled = modelled_of(args.modelled, args.gpu)
    print(f"{name}, torch {torch.__version__}, bf16; measured / modelled ({args.gpu})")
    print("| " + " | ".join(HEAD) + " |\n|" + "---|" * len(HEAD), flush=True)
    results, failed = {}, []
    for length in map(int, args.lengths.split(",")):
        for arch in args.archs.split(","):
            for mode in args.modes.split(","):
                try:
                    m = measure(arch, length, mode, args)
                except Exception as e:  # noqa: BLE001  (one contender failing is a finding)
                    what = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    failed.append(f"{arch}, l = {length}, {mode}: {type(e).__name__}: {what}")
                    print(f"step_measure: {failed[-1]}", flush=True)
                    continue
                results[(arch, length, mode)] = m
                model = modelled.get(arch, {}).get(str(length), {}).get(mode)
                print(row(arch, length, mode, m, model), flush=True)
    ratios(results, modelled)
    for (arch, length, mode), m in results.items():
        if mode == "compiled":  # a break inside the loop over the layers multiplies the graphs
            breaks = "; ".join(f"{n} x {why}" for why, n in m["breaks"].items()) or "none"
            print(f"{arch}, l = {length}, compiled: {m['graphs']} graphs; breaks: {breaks}")
    for (arch, length, mode), m in results.items():
        print(
            f"\n{arch}, l = {length}, {mode}: the {TOP} kernels of most GPU time (µs a step, launches a step)"
        )
        for name, group, us, n in m["by_name"][:TOP]:
            print(f"  {us:9.1f} {n:5.1f}  {group:11} {name[:90]}")
    if args.json:
        out = [{"arch": a, "length": L, "mode": md, **m} for (a, L, md), m in results.items()]
        Path(args.json).write_text(json.dumps(out, indent=1))
    if failed:
        raise SystemExit(f"step_measure: {len(failed)} contender(s) failed (above)")


if __name__ == "__main__":
    main()
