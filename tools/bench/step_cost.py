"""A model of the whole training step per arch on the H100, A100 and V100, built from a trace of the
real code and calibrated on the one H100 measurement.

    python tools/bench/step_cost.py                         # bert and shatter, l = 256 and 1024
    python tools/bench/step_cost.py --config configs/v100x8-base-256.yaml --gpus V100  # 8 V100s
    python tools/bench/step_cost.py --archs bert,shatter,part-mask --lengths 512 --json out.json
    python tools/bench/step_cost.py --calibrate             # replay commit ccce3e8's measurement
    python tools/bench/step_cost.py --calibrate --fit --gpus H100   # and the tables that fit it best

Each (GPU, arch, length) is one training step on one GPU of `shatter.build_model(f"{arch}-base")`
traced on meta tensors (tools/bench/step_trace.py): the forward, the backward, and DeepSpeed's
ZeRO-1 optimizer step (an fp32 master update of the rank's 1/world share of the parameters), in bf16
(fp16 on the V100). The run: 16,384 tokens a step of full rows on one GPU, or, with `--config`,
a training config's micro-batch x length tokens per GPU, its gradient accumulation, its
`run.num_gpus` as the world size ZeRO-1 partitions the update over, its precision, size, and
`run.compile`. ZeRO-1's collectives (the gradients' reduce-scatter, the parameters' all-gather)
are communication: left out of the time, and said so in the JSON ("communication").

Every kernel is priced on the GPU by its kind, with the one efficiency table EFFICIENCY for every
arch:

    gemm        cuBLAS products: max(FLOPs / (gemm x peak), bytes / (memory x HBM bandwidth))
    flash       SDPA's FlashAttention-2 kernel (forward, backward): its FLOPs at `flash` x peak
    efficient   SDPA's memory-efficient kernel (a mask or bias, or a V100): at `efficient` x peak
    custom      a Triton kernel with products (tl.dot) inside our custom ops: at `custom` x peak,
                where below sm_80 (the V100) the peak is the fp32 FMA peak: Triton's dots run
                on FMAs there, not on tensor cores (shatter.kernels.cost.kind_peak)
    memory      every kernel without products (elementwise, reductions, copies, the optimizer):
                its bytes at `memory` x HBM bandwidth
    launch      plus `launch_us` per kernel launched: the gaps between small kernels

A custom op (`shatter::`) is priced per kernel from shatter.kernels.cost.OP_COSTS: each of its
kernels (its cuBLAS GEMMs as gemm, its Triton kernels as custom or memory) the slower of its
FLOPs and its bytes, plus one launch each.

Two modes, both printed and in the JSON: `eager`, one kernel per ATen op, and `compiled`, the
model under torch.compile as inductor runs it, from inductor's own plan of the step
(tools/bench/inductor_plan.py: inductor's scheduler and Triton code generator asked on this CPU,
for a CUDA target, which kernels it makes, with the bytes it counts for each, and the torch ops
its generated wrapper calls between them): its kernels replace the forward's and backward's ops
it compiles, while the GEMMs, SDPA and the custom ops
(its extern kernels), the ops outside the compiled graphs (`shatter.eager`'s ranges) and the
DeepSpeed optimizer step are as in eager. Each plan of a
base-size step takes about 40 s of CPU (cached: SHATTER_PLAN_CACHE). The compiled figures
are the main ones, as a GPU run compiles unless told not to (`run.compile` unset: on a GPU,
shatter/train/compiling.py); `--eager` (or the config's `run.compile: false`) makes the eager
figures the main ones.

The GPU's choices are the real ones: bf16 on sm_80+ (fp16 and no flash kernel on the V100),
Shatter's `auto` attention impl (on sm_80+ `triton` or `fused`, on the V100 `rows` or
`triton`, whichever shatter.kernels.cost prices faster for the layer's shape, as `auto` picks
it), SDPA on the flash kernel for a batch without padding (attention_mask None) and on the
efficient kernel with one (`--padding`: every batch passes its mask).

The split printed per arch: GEMMs, attention (SDPA and custom kernels), elementwise and copies
(the forward's and backward's other kernels), optimizer (its phase, every kind), launches.
FLOPs per token are the trace's model FLOPs (products only, SDPA's recomputation left out) beside
train/cost.py's count; MFU is train/cost.py's count at the modelled tokens per second.

JSON: {"efficiency", "tokens_per_step" (per GPU), "size", "config", "world_size", "grad_accum",
"compiled", "communication", "figures": {GPU: {arch: {length: {"ms_per_step", "tokens_per_s"
(per GPU), "split_ms", "kernels", "flops_per_token", "cost_py_flops_per_token", "mfu",
"ratio_to_bert", "mode", "eager": {...}, "compiled": {...}}}}}}, and "calibration" with
--calibrate; the top-level figures are the main mode's.

`--calibrate` replays the measurement (commit ccce3e8, one H100, bf16 autocast over fp32
weights, torch's fused AdamW, an all-ones attention mask, base size, vocabulary 30,000, 16,384
tokens a step, eager) through that commit's own `shatter.build_model`, from a detached git
worktree it creates (or reuses) at /tmp/shatter-ccce3e8, traced in a subprocess with that
worktree on PYTHONPATH; it checks BERT's 43.7 ms a step (l = 256) within 20% and Shatter / BERT
at 1.67 +- 0.25 (l = 256) and 2.43 +- 0.35 (l = 1024), and exits 1 when one fails. `--fit` also
prints the tables of the PLAUSIBLE grid that reproduce it best: how EFFICIENCY was set, once.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click
import torch

from shatter.config import ATTENTION_IMPLS
from shatter.kernels.cost import EFFICIENCY, FFN_OPS, family_of, kind_peak  # the frozen table
from shatter.tools.bench.attention_cost import GPUS as TABLE_GPUS
from shatter.tools.bench.inductor_plan import planned
from shatter.tools.bench.step_trace import build_meta, records, trace_step

ROOT = Path(__file__).resolve().parents[2]
# attention_cost's datasheet peaks, and the H200 (the H100's tensor peak, 4.8 TB/s of HBM3e): the
# GPU a lent machine has, so that step_measure.py's measurements have their modelled figures
GPUS = TABLE_GPUS | {"H200": (989e12, 4.8e12)}
DEFAULT_GPUS = "H100,A100,V100"
MEMORY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "V100": 32.0}  # the larger model of each

# The grid --fit searches: round values a GPU can plausibly reach, bounded by what is physical
# (cuBLAS at most 70% of peak at these shapes, elementwise kernels at least 60% of HBM)
PLAUSIBLE = {
    "gemm": (0.5, 0.6, 0.7),
    "memory": (0.6, 0.7, 0.75, 0.8),
    "efficient": (0.2, 0.25, 0.3),
    "launch_us": (3.0, 4.0, 5.0, 6.0),
}
SPLIT = ("gemm", "attention", "elementwise", "optimizer", "launches")
SPLIT_NAMES = ("GEMMs", "attention", "elementwise+copies", "optimizer", "launches")
MODES = ("eager", "compiled")

# The measurement --calibrate replays (one H100; docs/benchmarks.md)
REPLAY_COMMIT = "ccce3e8"
REPLAY_BERT_MS = 43.7  # l = 256, +-20%
REPLAY_RATIOS = {256: (1.67, 0.25), 1024: (2.43, 0.35)}  # Shatter / BERT, +-
REPLAY_VOCAB = 30000
COMMS = (
    "excluded: ZeRO-1's reduce-scatter of the gradients and all-gather of the parameters (each "
    "(world - 1) / world of the low-precision parameters' bytes per rank) are not priced"
)


@dataclass(frozen=True)
class Gpu:
    name: str
    peak: float  # dense bf16/fp16 tensor FLOP/s
    bandwidth: float  # HBM bytes/s
    low: torch.dtype  # the training precision
    flash: bool  # FlashAttention-2 available (sm_80+)
    partition_impl: str  # Shatter's attention impl there ("auto": per shape, `shatter_impl`)
    capability: tuple[int, int] = (9, 0)
    memory_gib: float = 80.0  # one GPU's memory (auto's rows-keep: impls.keeps_rows)


def gpus() -> dict[str, Gpu]:
    sm80 = dict(low=torch.bfloat16, flash=True, partition_impl="auto")
    sm70 = dict(low=torch.float16, flash=False, partition_impl="auto", capability=(7, 0))
    capability = {"H100": (9, 0), "H200": (9, 0), "A100": (8, 0)}
    return {
        name: Gpu(name, peak, bw, **(sm70 if name == "V100" else dict(sm80, capability=capability[name])),
                  memory_gib=MEMORY_GIB[name])
        for name, (peak, bw) in GPUS.items()
    }  # fmt: skip


def shatter_impl(gpu: Gpu, arch: str, size: str, length: int, rows: int) -> str:
    """The attention impl Shatter's archs run on `gpu`: its own, or with "auto" the impl a
    training run takes for the layer's shape there: `rows-keep` where impls.keeps_rows says so
    for the GPU's memory, else impls.kernel_choice's."""
    if gpu.partition_impl != "auto":
        return gpu.partition_impl
    from shatter.attention.impls import keeps_rows, kernel_choice
    from shatter.config import preset_config

    config = preset_config(f"{arch}-{size}", max_len=max(length, 512))
    shape = (rows, length, config.hidden, config.heads)
    if keeps_rows(gpu.capability, shape, gpu.low, config.layers, gpu.memory_gib * 2**30):
        return "rows-keep"  # as a training run resolves auto (train/pretrain.py)
    return kernel_choice(gpu.capability, shape, gpu.low)


def kernel_seconds(kind: str, flops: float, nbytes: float, gpu: Gpu, eff: dict = EFFICIENCY):
    """One kernel's time on `gpu` (launch not included): the slower of its FLOPs at its kind's
    rate (a Triton dot below sm_80 at the FMA peak: cost.kind_peak) and its bytes at the memory
    rate."""
    memory = nbytes / (eff["memory"] * gpu.bandwidth)
    if kind == "memory":
        return memory
    peak = kind_peak(kind, family_of(gpu.capability), gpu.peak)
    return max(flops / (eff[kind] * peak), memory)


def op_seconds(row: dict, gpu: Gpu, eff: dict = EFFICIENCY) -> float:
    """One op's time on `gpu` (launches not included): a custom op's kernels each on its own
    (shatter.kernels.cost), added up; any other op is one kernel."""
    kernels = row.get("kernels") or [(row.get("op"), row["kind"], row["flops"], row["bytes"])]
    return sum(kernel_seconds(kind, f, b, gpu, eff) for _, kind, f, b in kernels)


def price(rows: list[dict], gpu: Gpu, eff: dict = EFFICIENCY, accum: int = 1) -> dict[str, float]:
    """Seconds of the traced step on `gpu`, split as SPLIT, plus the total and the kernels
    launched; `accum` forward-backward passes a step (gradient accumulation), one optimizer
    step."""
    split = dict.fromkeys(SPLIT, 0.0)
    kernels = 0
    for row in rows:
        count = row["count"] * (1 if row["phase"] == "optimizer" else accum)
        t = op_seconds(row, gpu, eff) * count
        if row["phase"] == "optimizer":
            part = "optimizer"
        elif row["kind"] == "gemm" or row.get("op") in FFN_OPS:
            part = "gemm"
        elif row["kind"] in ("flash", "efficient", "custom"):
            part = "attention"
        else:
            part = "elementwise"
        split[part] += t
        kernels += row["launches"] * count
    split["launches"] = kernels * eff["launch_us"] * 1e-6
    split["total"] = sum(split[k] for k in SPLIT)
    split["kernels"] = kernels
    return split


def model_flops(rows: list[dict]) -> float:
    """The trace's model FLOPs of the forward and backward (products only)."""
    return sum(r["model_flops"] * r["count"] for r in rows if r["phase"] != "optimizer")


def cost_py_flops(arch: str, length: int, rows_per_step: int, size: str, vocab: int) -> float:
    """train/cost.py's training FLOPs per token for this arch and run (MLM, 15% predicted)."""
    from shatter.config import preset_config
    from shatter.train.cost import training_flops_per_token

    config = preset_config(f"{arch}-{size}", max_len=max(length, 512), vocab_size=vocab)
    return training_flops_per_token(config, length, 0.15, micro_batch=rows_per_step)


@dataclass(frozen=True)
class Run:
    """What one GPU of a run does each step: the defaults are one GPU at 16,384 tokens a step,
    compiled (`run.compile` unset compiles on a GPU); `run_of_config` reads them from a
    training config."""

    tokens: int = 16384  # tokens per GPU per forward and backward (micro-batch x length)
    grad_accum: int = 1  # forward-backward passes per optimizer step
    world: int = 1  # ranks: ZeRO-1 partitions the optimizer's update over them
    compiled: bool = True  # the main figures' mode: torch.compile (inductor) or eager
    precision: str | None = None  # bf16 or fp16 over the GPU's own (bf16 on sm_80+, fp16 on V100)
    impl: str | None = None  # Shatter's attention impl on every GPU over `auto`'s choice
    ffn_impl: str | None = None  # the FFN's impl (shatter/ffn.py) on every GPU over `auto`'s
    optim_impl: str = "auto"  # optim.impl: `auto` and `master` take the one-pass step in bf16
    size: str = "base"
    config: str | None = None  # the config file read
    memory_gib: float | None = None  # one GPU's memory over the GPU table's (run.gpu_memory_gb)


def run_of_config(path: str, run: Run) -> Run:
    """`run` with the tokens per GPU (micro-batch x data.seq_len, when it sets one), accumulation,
    world size, compile, precision, size, attention impl and GPU memory of the training config at
    `path` (train/config.py's YAML)."""
    from shatter.train.config import ConfigError, resolve

    try:
        cfg = resolve(path, {})
    except (ConfigError, OSError) as e:
        raise SystemExit(f"step_cost: cannot read the config {path} ({e})") from None
    r = cfg.run
    if r.precision not in ("bf16", "fp16") or r.zero_stage > 2:
        raise SystemExit(
            f"step_cost: {path} trains in {r.precision} with ZeRO stage {r.zero_stage}; the "
            "model prices bf16 or fp16 steps with ZeRO stage 0-2 (run.precision, run.zero_stage)"
        )
    impl = cfg.model.overrides.get("attention_impl", "auto")
    ffn_impl = cfg.model.overrides.get("ffn_impl", "auto")
    return replace(
        run,
        tokens=r.micro_batch * cfg.data.seq_len if cfg.data.seq_len else run.tokens,
        grad_accum=r.grad_accum,
        world=r.num_gpus if r.zero_stage else 1,
        compiled=r.compile is not False,  # unset (auto) compiles on a GPU
        precision=r.precision,
        impl=run.impl or (None if impl == "auto" else impl),
        ffn_impl=run.ffn_impl or (None if ffn_impl == "auto" else ffn_impl),
        optim_impl=cfg.optim.impl,
        size=cfg.model.preset.rsplit("-", 1)[-1],
        config=path,
        memory_gib=r.gpu_memory_gb,
    )


def gpu_for(name: str, run: Run) -> Gpu:
    """The GPU `name` in the run's precision and attention impl."""
    gpu = gpus()[name]
    if run.impl:
        gpu = replace(gpu, partition_impl=run.impl)
    if run.memory_gib:
        gpu = replace(gpu, memory_gib=run.memory_gib)
    if run.precision == "bf16" and not gpu.flash:
        raise SystemExit(f"step_cost: the {name} has no bf16; train it in fp16 (run.precision)")
    if run.precision:
        gpu = replace(gpu, low={"bf16": torch.bfloat16, "fp16": torch.float16}[run.precision])
    return gpu


def trace_here(arch, length, gpu: Gpu, run: Run, padding: bool, vocab: int):
    """This checkout's model, traced with the GPU's precision, SDPA kernel and Shatter impl, at
    the run's tokens per GPU and world size."""
    import shatter

    impl = _attention_impl(arch, gpu)
    model = build_meta(
        shatter.build_model, arch, run.size, vocab, traced_max_len(length), gpu.low, impl,
        ffn_impl_for(gpu, run),
    )  # fmt: skip
    rows = run.tokens // length
    try:
        return trace_step(
            model, length, rows, optimizer_for(gpu, run), gpu.low, gpu.flash, padding_mask=padding,
            world=run.world, family=family_of(gpu.capability),
        )  # fmt: skip
    except (RuntimeError, ValueError, NotImplementedError) as e:
        what = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(
            f"step_cost: {arch} with attention_impl {impl} cannot be traced on meta tensors "
            f"({what}); its kernels must be torch.library custom ops with a fake impl "
            f"(shatter/attention/triton_kernel.py), or pick another with --partition-impl"
        ) from None


def plan_here(arch, length, gpu: Gpu, run: Run, padding: bool, vocab: int) -> list[dict]:
    """Inductor's kernels for this checkout's step, as `trace_here` traces it
    (tools/bench/inductor_plan.py)."""
    return planned(
        arch, run.size, length, run.tokens // length, vocab, traced_max_len(length),
        _attention_impl(arch, gpu), gpu.low, gpu.flash, padding, gpu.capability,
        ffn_impl_for(gpu, run),
    )  # fmt: skip


def traced_max_len(length: int) -> int:
    """The traced model's max_len: the presets' 512, or the length where it is longer."""
    return max(length, 512)


def ffn_impl_for(gpu: Gpu, run: Run) -> str:
    """The FFN impl a run takes on `gpu`: its config's, or `auto`'s there (shatter.ffn)."""
    from shatter.ffn import ffn_choice

    return run.ffn_impl or ffn_choice(gpu.capability, gpu.low)


def optimizer_for(gpu: Gpu, run: Run) -> str:
    """The ZeRO-1 step a run takes on `gpu` (step_trace.OPTIMIZERS): the one-pass step for
    `optim.impl` `auto` or `master` in bf16 (train/master_step.py), else torch's fused AdamW
    stepped by DeepSpeed (fp16 keeps DeepSpeed's loss-scaled step; `deepspeed`'s FusedAdam is
    priced as torch's)."""
    from shatter.train.master_step import MASTER_IMPLS

    one_pass = run.optim_impl in MASTER_IMPLS and gpu.low == torch.bfloat16
    return "master" if one_pass else "zero1"


def _attention_impl(arch: str, gpu: Gpu) -> str | None:
    """The GPU's attention impl for the single-head archs (None for the others)."""
    from shatter.attention import ATTENTIONS, SingleHeadPartitionAttention

    single = issubclass(ATTENTIONS[arch], SingleHeadPartitionAttention)
    return gpu.partition_impl if single else None


def priced(rows: list[dict], gpu: Gpu, run: Run, tokens: int) -> dict:
    """The figures of one mode (eager or compiled) of a traced step."""
    split = price(rows, gpu, accum=run.grad_accum)
    return {
        "ms_per_step": 1e3 * split["total"],
        "tokens_per_s": tokens / split["total"],
        "split_ms": {k: 1e3 * split[k] for k in SPLIT},
        "kernels": split["kernels"],
    }


def figures(archs, lengths, gpu_names, padding, run: Run = Run(), vocab=REPLAY_VOCAB) -> dict:
    """{gpu: {arch: {length: figures}}} at this checkout: the run's mode at the top level, both
    modes under "eager" and "compiled"."""
    out, traces = {}, {}
    for name in gpu_names:
        gpu = gpu_for(name, run)
        out[name] = {arch: {} for arch in archs}
        for arch in archs:
            for L in lengths:
                impl = shatter_impl(gpu, arch, run.size, L, run.tokens // L)
                key = (gpu.low, gpu.flash, impl, arch, L, family_of(gpu.capability))
                if key not in traces:
                    traces[key] = trace_here(
                        arch, L, replace(gpu, partition_impl=impl), run, padding, vocab
                    )
                rec = traces[key]
                rows = run.tokens // L
                tokens = rows * L * run.grad_accum  # per GPU per step
                plan = plan_here(arch, L, replace(gpu, partition_impl=impl), run, padding, vocab)
                modes = {
                    "eager": priced(records(rec), gpu, run, tokens),
                    "compiled": priced(records(rec, plan), gpu, run, tokens),
                }
                f = dict(modes["compiled" if run.compiled else "eager"])
                f["mode"] = "compiled" if run.compiled else "eager"
                f["flops_per_token"] = model_flops(records(rec)) / (rows * L)
                f["cost_py_flops_per_token"] = cost_py_flops(arch, L, rows, run.size, vocab)
                f["mfu"] = f["tokens_per_s"] * f["cost_py_flops_per_token"] / gpu.peak
                out[name][arch][L] = {**f, **modes}
    for per_arch in out.values():
        add_ratios(per_arch)
    return out


def add_ratios(per_arch: dict) -> None:
    """Each arch's ms per step over BERT's at the same length and mode (when BERT was
    modelled)."""
    for per_len in per_arch.values():
        for L, f in per_len.items():
            bert = per_arch.get("bert", {}).get(L)
            for mine, hers in [(f, bert)] + [(f[m], bert and bert[m]) for m in MODES]:
                mine["ratio_to_bert"] = mine["ms_per_step"] / hers["ms_per_step"] if hers else None


def print_tables(out: dict, run: Run) -> None:
    for gpu, per_arch in out.items():
        g = gpu_for(gpu, run)
        print(
            f"\n{gpu}: {g.peak / 1e12:.0f} TFLOP/s, {g.bandwidth / 1e12:.2f} TB/s, "
            f"{str(g.low).split('.')[-1]}, {run.tokens * run.grad_accum} tokens a step per GPU, "
            f"ZeRO-1 over {run.world} GPU{'s' if run.world > 1 else ''}"
        )
        head = ["arch", "l", "mode", "ms/step", "tokens/s", *(f"{n} ms" for n in SPLIT_NAMES)]
        head += ["kernels", "GFLOP/token", "cost.py", "MFU", "/ BERT"]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for arch, per_len in per_arch.items():
            for L, f in per_len.items():
                for mode in MODES:
                    m = f[mode]
                    ratio = m["ratio_to_bert"]
                    mfu = m["tokens_per_s"] * f["cost_py_flops_per_token"] / g.peak
                    cells = [arch, L, mode, f"{m['ms_per_step']:.1f}"]
                    cells += [f"{m['tokens_per_s'] / 1e3:.0f}k"]
                    cells += [f"{m['split_ms'][k]:.1f}" for k in SPLIT]
                    cells += [f"{m['kernels']:,}", f"{f['flops_per_token'] / 1e9:.3f}"]
                    cells += [f"{f['cost_py_flops_per_token'] / 1e9:.3f}", f"{100 * mfu:.0f}%"]
                    cells += ["-" if ratio is None else f"{ratio:.3f}"]
                    print("| " + " | ".join(str(c) for c in cells) + " |")


def replay_worktree(commit: str = REPLAY_COMMIT) -> Path:
    """A detached worktree of `commit` at /tmp/shatter-<commit> (created once, then reused)."""
    path = Path(f"/tmp/shatter-{commit}")
    if (path / "shatter" / "__init__.py").exists():
        return path
    run = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"step_cost: cannot check out {commit} into {path} ({last}); fix: run from a clone "
            f"that has commit {commit} (git fetch), or remove {path}"
        )
    return path


def replay_trace(arch: str, lengths, tokens: int) -> dict[int, list[dict]]:
    """The replayed commit's own model, traced in a subprocess with its worktree on PYTHONPATH."""
    tree = replay_worktree()
    cmd = [sys.executable, str(ROOT / "tools" / "bench" / "step_trace.py"), "--arch", arch]
    cmd += ["--lengths", ",".join(map(str, lengths)), "--tokens", str(tokens)]
    cmd += ["--vocab", str(REPLAY_VOCAB), "--optimizer", "fused", "--padding-mask"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(
            f"step_cost: tracing {arch} at {REPLAY_COMMIT} failed ({last}); "
            f"tools/bench/step_trace.py must run against that commit's shatter.build_model"
        )
    return {int(k): v for k, v in json.loads(run.stdout).items()}


def replay_traces(tokens: int = 16384) -> dict[str, dict[int, list[dict]]]:
    return {arch: replay_trace(arch, sorted(REPLAY_RATIOS), tokens) for arch in ("bert", "shatter")}


def calibrate(traces: dict, eff: dict = EFFICIENCY) -> dict:
    """The replayed figures on the H100 and whether each is within its tolerance."""
    gpu = gpus()["H100"]
    ms = {
        arch: {L: 1e3 * price(rows, gpu, eff)["total"] for L, rows in per_len.items()}
        for arch, per_len in traces.items()
    }
    checks = [
        {
            "what": "BERT ms/step, l = 256",
            "modelled": ms["bert"][256],
            "measured": REPLAY_BERT_MS,
            "tolerance": 0.2 * REPLAY_BERT_MS,
        }
    ]
    for L, (ratio, tol) in REPLAY_RATIOS.items():
        checks.append(
            {
                "what": f"Shatter / BERT, l = {L}",
                "modelled": ms["shatter"][L] / ms["bert"][L],
                "measured": ratio,
                "tolerance": tol,
            }
        )
    for c in checks:
        c["error"] = abs(c["modelled"] - c["measured"]) / c["tolerance"]  # 1: the tolerance
        c["pass"] = c["error"] <= 1
    return {"commit": REPLAY_COMMIT, "gpu": "H100", "ms_per_step": ms, "checks": checks}


def fit(traces: dict, best: int = 5) -> None:
    """Print the PLAUSIBLE tables that reproduce the measurement best (the largest of the three
    errors, each over its tolerance): how EFFICIENCY was set. Changes nothing."""
    keys = list(PLAUSIBLE)
    scored = []
    for values in itertools.product(*PLAUSIBLE.values()):
        eff = dict(EFFICIENCY, **dict(zip(keys, values)))
        checks = calibrate(traces, eff)["checks"]
        scored.append((max(c["error"] for c in checks), values, [c["modelled"] for c in checks]))
    print(f"the best of {len(scored)} tables ({', '.join(keys)}): worst error / tolerance, "
          "BERT ms (l = 256), Shatter / BERT (l = 256, 1024)")  # fmt: skip
    for worst, values, modelled in sorted(scored)[:best]:
        print(f"  {values}: {worst:.2f}; " + ", ".join(f"{m:.2f}" for m in modelled))


def print_calibration(cal: dict) -> None:
    print(f"efficiency table (frozen): {EFFICIENCY}")
    print(
        f"replay of {cal['commit']} on the {cal['gpu']} (bf16 autocast, fused AdamW, all-ones mask):"
    )
    for arch, per_len in cal["ms_per_step"].items():
        print("  " + arch + ": " + ", ".join(f"l = {L}: {ms:.1f} ms" for L, ms in per_len.items()))
    for c in cal["checks"]:
        verdict = "pass" if c["pass"] else "FAIL"
        print(
            f"  {c['what']}: modelled {c['modelled']:.2f}, measured {c['measured']:.2f} "
            f"+- {c['tolerance']:.2f}: {verdict}"
        )


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--archs", default="bert,shatter", show_default=True)
@click.option("--lengths", default="256,1024", show_default=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="a training config (configs/*.yaml): tokens per GPU, world size, precision, compile",
)
@click.option(
    "--tokens", type=int, help="tokens per GPU per step [default: 16384, or the config's]"
)
@click.option("--size", help="the presets' size [default: base, or the config's]")
@click.option(
    "--gpus", "gpu_names", default=DEFAULT_GPUS, show_default=True, help=f"of {', '.join(GPUS)}"
)
@click.option("--padding", is_flag=True, help="every batch passes its attention mask")
@click.option(
    "--compiled/--eager",
    default=None,
    help="the main figures' mode (both are printed) [default: compiled, as run.compile unset "
    "runs on a GPU, or the config's run.compile]",
)
@click.option(
    "--partition-impl",
    type=click.Choice([i for i in ATTENTION_IMPLS if i != "auto"]),
    help="Shatter's attention impl on every GPU (default: auto's choice per GPU)",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the figures")
@click.option("--calibrate", "do_calibrate", is_flag=True, help="replay the H100 measurement")
@click.option("--fit", "do_fit", is_flag=True, help="also the PLAUSIBLE tables that fit it best")
def main(
    archs,
    lengths,
    config_path,
    tokens,
    size,
    gpu_names,
    padding,
    compiled,
    partition_impl,
    json_path,
    do_calibrate,
    do_fit,
):
    archs, names, lens = parse_lists(archs, gpu_names, lengths)
    run = Run(impl=partition_impl)
    if config_path:
        run = run_of_config(config_path, run)
    flags = dict(tokens=tokens, size=size, compiled=compiled)
    run = replace(run, **{k: v for k, v in flags.items() if v is not None})
    result = {"efficiency": EFFICIENCY, "tokens_per_step": run.tokens * run.grad_accum}
    result |= {"size": run.size, "config": run.config, "world_size": run.world}
    result |= {"grad_accum": run.grad_accum, "compiled": run.compiled, "communication": COMMS}
    if do_calibrate or do_fit:
        traces = replay_traces()
        if do_fit:
            fit(traces)
        result["calibration"] = calibrate(traces)
        print_calibration(result["calibration"])
    result["figures"] = figures(archs, lens, names, padding, run)
    print_tables(result["figures"], run)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    if "calibration" in result and not all(c["pass"] for c in result["calibration"]["checks"]):
        raise SystemExit("step_cost: the replay of the measurement failed (see above)")


def parse_lists(archs: str, gpu_names: str, lengths: str):
    """(archs, GPU names, lengths) from their comma-separated options, or one line naming the bad
    one."""
    from shatter.config import ARCHS

    archs, names = archs.split(","), gpu_names.split(",")
    bad = [a for a in archs if a not in ARCHS] + [g for g in names if g not in GPUS]
    if bad:
        raise SystemExit(
            f"step_cost: unknown arch or GPU {bad}; archs: {', '.join(ARCHS)}; GPUs: {', '.join(GPUS)}"
        )
    try:
        return archs, names, [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"step_cost: --lengths takes integers like 256,1024, got {lengths!r}"
        ) from None


if __name__ == "__main__":
    main()
