"""A model of the whole training step per arch on the H100, A100 and V100, built from a trace of the
real code and calibrated on the one H100 measurement.

    python tools/bench/step_cost.py                         # bert and shatter, l = 256 and 1024
    python tools/bench/step_cost.py --archs bert,shatter,part-mask --lengths 512 --json out.json
    python tools/bench/step_cost.py --calibrate             # replay commit ccce3e8's measurement
    python tools/bench/step_cost.py --calibrate --fit --gpus H100   # and the tables that fit it best

Each (GPU, arch, length) is one bf16 training step of `shatter.build_model(f"{arch}-base")` traced
on meta tensors (tools/bench/step_trace.py): the forward, the backward, and DeepSpeed's bf16 ZeRO-1
optimizer step (an fp32 master update), at 16,384 tokens a step of full rows. Every op is
priced on the GPU by its kind, with the one efficiency table EFFICIENCY for every arch:

    gemm        cuBLAS products: max(FLOPs / (gemm x peak), bytes / (memory x HBM bandwidth))
    flash       SDPA's FlashAttention-2 kernel (forward, backward): its FLOPs at `flash` x peak
    efficient   SDPA's memory-efficient kernel (a mask or bias, or a V100): at `efficient` x peak
    custom      our attention ops (`shatter::` custom ops) by their own (FLOPs, bytes) formula
                (shatter.kernels.cost.OP_COSTS): each runs several kernels in turn (cuBLAS
                GEMMs and memory-bound Triton mixing), so FLOPs / (custom x peak) + bytes /
                (memory x HBM bandwidth)
    memory      every other kernel (elementwise, reductions, copies, the optimizer): its bytes at
                `memory` x HBM bandwidth
    launch      plus `launch_us` per kernel launched: the gaps between small kernels

The GPU's choices are the real ones: bf16 on sm_80+ (fp16 and no flash kernel on the V100),
Shatter's `auto` attention impl (`triton` on sm_80+, `chunked` on the V100), SDPA on the flash
kernel for a batch without padding (attention_mask None) and on the efficient kernel with one
(`--padding`: every batch passes its mask).

The split printed per arch: GEMMs, attention (SDPA and custom kernels), elementwise and copies
(the forward's and backward's other kernels), optimizer (its phase, every kind), launches.
FLOPs per token are the trace's model FLOPs (products only, SDPA's recomputation left out) beside
train/cost.py's count.

`--calibrate` replays the measurement (commit ccce3e8, one H100, bf16 autocast over fp32
weights, torch's fused AdamW, an all-ones attention mask, base size, vocabulary 30,000, 16,384
tokens a step) through that commit's own `shatter.build_model`, from a detached git worktree it
creates (or reuses) at /tmp/shatter-ccce3e8, traced in a subprocess with that worktree on
PYTHONPATH; it checks BERT's 43.7 ms a step (l = 256) within 20% and Shatter / BERT at 1.67 +-
0.25 (l = 256) and 2.43 +- 0.35 (l = 1024), and exits 1 when one fails. `--fit` also prints the
tables of the PLAUSIBLE grid that reproduce it best: how EFFICIENCY was set, once.
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

from shatter.tools.bench.attention_cost import GPUS
from shatter.tools.bench.step_trace import build_meta, records, trace_step

ROOT = Path(__file__).resolve().parents[2]

# The one efficiency table, every arch and GPU alike (docs/benchmarks.md states it). gemm, memory,
# efficient and launch_us were set once from the H100 measurement that --calibrate replays (the
# best of the PLAUSIBLE grid, `--fit`), then frozen; flash and custom are stated, not fitted
# (the replayed commit ran neither kernel).
EFFICIENCY = {
    "gemm": 0.70,  # cuBLAS bf16/fp16 GEMMs, fraction of the dense tensor peak
    "flash": 0.35,  # FlashAttention-2, forward and backward (its paper: 30-40% on an H100)
    "efficient": 0.25,  # the memory-efficient (cutlass) attention kernel
    "custom": 0.50,  # a custom op's products: mostly its cuBLAS GEMMs, partly Triton dots
    "memory": 0.60,  # fraction of HBM bandwidth for memory-bound kernels
    "launch_us": 6.0,  # per kernel launch: the gap it leaves between kernels
}
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

# The measurement --calibrate replays (one H100; docs/benchmarks.md)
REPLAY_COMMIT = "ccce3e8"
REPLAY_BERT_MS = 43.7  # l = 256, +-20%
REPLAY_RATIOS = {256: (1.67, 0.25), 1024: (2.43, 0.35)}  # Shatter / BERT, +-
REPLAY_VOCAB = 30000


@dataclass(frozen=True)
class Gpu:
    name: str
    peak: float  # dense bf16/fp16 tensor FLOP/s
    bandwidth: float  # HBM bytes/s
    low: torch.dtype  # the training precision
    flash: bool  # FlashAttention-2 available (sm_80+)
    partition_impl: str  # Shatter's `auto` attention impl there


def gpus() -> dict[str, Gpu]:
    sm80 = dict(low=torch.bfloat16, flash=True, partition_impl="triton")
    sm70 = dict(low=torch.float16, flash=False, partition_impl="chunked")
    return {
        name: Gpu(name, peak, bw, **(sm70 if name == "V100" else sm80))
        for name, (peak, bw) in GPUS.items()
    }


def op_seconds(row: dict, gpu: Gpu, eff: dict = EFFICIENCY) -> float:
    """One op's time on `gpu` (launch not included): the slower of its FLOPs and its bytes."""
    memory = row["bytes"] / (eff["memory"] * gpu.bandwidth)
    if row["kind"] == "memory":
        return memory
    compute = row["flops"] / (eff[row["kind"]] * gpu.peak)
    if row["kind"] == "custom":  # several kernels in turn: GEMMs, then memory-bound mixing
        return compute + memory
    return max(compute, memory)


def price(rows: list[dict], gpu: Gpu, eff: dict = EFFICIENCY) -> dict[str, float]:
    """Seconds of the traced step on `gpu`, split as SPLIT, plus the total."""
    split = dict.fromkeys(SPLIT, 0.0)
    for row in rows:
        t = op_seconds(row, gpu, eff) * row["count"]
        if row["phase"] == "optimizer":
            part = "optimizer"
        elif row["kind"] == "gemm":
            part = "gemm"
        elif row["kind"] in ("flash", "efficient", "custom"):
            part = "attention"
        else:
            part = "elementwise"
        split[part] += t
        split["launches"] += row["launches"] * row["count"] * eff["launch_us"] * 1e-6
    split["total"] = sum(split[k] for k in SPLIT)
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


def trace_here(arch, size, length, rows, gpu: Gpu, padding: bool, vocab: int) -> list[dict]:
    """This checkout's model, traced with the GPU's precision, SDPA kernel and Shatter impl."""
    import shatter
    from shatter.attention import ATTENTIONS, SingleHeadPartitionAttention

    impl = (
        gpu.partition_impl if issubclass(ATTENTIONS[arch], SingleHeadPartitionAttention) else None
    )
    model = build_meta(shatter.build_model, arch, size, vocab, max(length, 512), gpu.low, impl)
    try:
        rec = trace_step(model, length, rows, "zero1", gpu.low, gpu.flash, padding_mask=padding)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        what = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(
            f"step_cost: {arch} with attention_impl {impl} cannot be traced on meta tensors "
            f"({what}); its kernels must be torch.library custom ops with a fake impl "
            f"(shatter/attention/triton_kernel.py), or pick another with --partition-impl"
        ) from None
    return records(rec)


def figures(
    archs, lengths, tokens, gpu_names, padding, size="base", vocab=REPLAY_VOCAB, impl=None
) -> dict:
    """{gpu: {arch: {length: figures}}} at this checkout; `impl` replaces Shatter's `auto` choice
    of attention impl on every GPU."""
    out = {}
    table = gpus()
    if impl:
        table = {k: replace(g, partition_impl=impl) for k, g in table.items()}
    traces = {}
    for name in gpu_names:
        gpu = table[name]
        key = (gpu.low, gpu.flash, gpu.partition_impl)
        out[name] = {}
        for arch in archs:
            out[name][arch] = {}
            for L in lengths:
                rows = tokens // L
                if (key, arch, L) not in traces:
                    traces[key, arch, L] = trace_here(arch, size, L, rows, gpu, padding, vocab)
                trace = traces[key, arch, L]
                split = price(trace, gpu)
                out[name][arch][L] = {
                    "ms_per_step": 1e3 * split["total"],
                    "tokens_per_s": rows * L / split["total"],
                    "split_ms": {k: 1e3 * split[k] for k in SPLIT},
                    "flops_per_token": model_flops(trace) / (rows * L),
                    "cost_py_flops_per_token": cost_py_flops(arch, L, rows, size, vocab),
                }
    for per_arch in out.values():
        add_ratios(per_arch)
    return out


def add_ratios(per_arch: dict) -> None:
    """Each arch's ms per step over BERT's at the same length (when BERT was modelled)."""
    for per_len in per_arch.values():
        for L, f in per_len.items():
            bert = per_arch.get("bert", {}).get(L)
            f["ratio_to_bert"] = f["ms_per_step"] / bert["ms_per_step"] if bert else None


def print_tables(out: dict, tokens: int) -> None:
    for gpu, per_arch in out.items():
        g = gpus()[gpu]
        print(
            f"\n{gpu}: {g.peak / 1e12:.0f} TFLOP/s, {g.bandwidth / 1e12:.2f} TB/s, "
            f"{str(g.low).split('.')[-1]}, {tokens} tokens a step"
        )
        head = ["arch", "l", "ms/step", "tokens/s", *(f"{n} ms" for n in SPLIT_NAMES)]
        head += ["GFLOP/token", "cost.py", "/ BERT"]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for arch, per_len in per_arch.items():
            for L, f in per_len.items():
                ratio = f["ratio_to_bert"]
                cells = [arch, L, f"{f['ms_per_step']:.1f}", f"{f['tokens_per_s'] / 1e3:.0f}k"]
                cells += [f"{f['split_ms'][k]:.1f}" for k in SPLIT]
                cells += [f"{f['flops_per_token'] / 1e9:.3f}"]
                cells += [f"{f['cost_py_flops_per_token'] / 1e9:.3f}"]
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
@click.option("--tokens", default=16384, show_default=True, help="tokens per step")
@click.option(
    "--size", default="base", show_default=True, help="the presets' size (base: 12 x 768)"
)
@click.option("--gpus", "gpu_names", default=",".join(GPUS), show_default=True)
@click.option("--padding", is_flag=True, help="every batch passes its attention mask")
@click.option(
    "--partition-impl",
    type=click.Choice(("triton", "chunked", "lean", "naive")),
    help="Shatter's attention impl on every GPU (default: auto's choice per GPU)",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the figures")
@click.option("--calibrate", "do_calibrate", is_flag=True, help="replay the H100 measurement")
@click.option("--fit", "do_fit", is_flag=True, help="also the PLAUSIBLE tables that fit it best")
def main(
    archs,
    lengths,
    tokens,
    size,
    gpu_names,
    padding,
    partition_impl,
    json_path,
    do_calibrate,
    do_fit,
):
    from shatter.config import ARCHS

    archs = archs.split(",")
    names = gpu_names.split(",")
    bad = [a for a in archs if a not in ARCHS] + [g for g in names if g not in GPUS]
    if bad:
        raise SystemExit(
            f"step_cost: unknown arch or GPU {bad}; archs: {', '.join(ARCHS)}; GPUs: {', '.join(GPUS)}"
        )
    try:
        lens = [int(v) for v in lengths.split(",")]
    except ValueError:
        raise SystemExit(
            f"step_cost: --lengths takes integers like 256,1024, got {lengths!r}"
        ) from None
    result = {"efficiency": EFFICIENCY, "tokens_per_step": tokens, "size": size}
    if do_calibrate or do_fit:
        traces = replay_traces(tokens)
        if do_fit:
            fit(traces)
        result["calibration"] = calibrate(traces)
        print_calibration(result["calibration"])
    result["figures"] = figures(archs, lens, tokens, names, padding, size, impl=partition_impl)
    print_tables(result["figures"], tokens)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    if "calibration" in result and not all(c["pass"] for c in result["calibration"]["checks"]):
        raise SystemExit("step_cost: the replay of the measurement failed (see above)")


if __name__ == "__main__":
    main()
