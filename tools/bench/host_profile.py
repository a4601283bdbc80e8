"""Where a step's wall time goes on a GPU: the host launching ops, or the GPU running them.

    python tools/bench/host_profile.py step [--archs bert,shatter] [--micro-batch 64] [--seq-len 256]
    python tools/bench/host_profile.py op [--lengths 256,1024] [--batch-tokens 16384]

`step`: the bare model step (forward, backward, torch's fused AdamW, bf16 autocast, batches on the
device) of each base arch, ms a step, median of --steps: eager; eager with the MLM head's
positions gathered by an index made beforehand (no host sync in the forward); that step captured
once as a CUDA graph and replayed (no host work: the GPU's own time, the floor that CUDA graphs or
fewer, larger kernels could reach); with `--compile ARCHS`, torch.compile's "reduce-overhead"
mode (inductor's CUDA graphs) over batches of varying masks. eager / graph is the host's share.

`op`: the `triton` attention (fwd+bwd) at each length, at the batch of --batch-tokens and at
batch 1 (where the GPU idles and the time is the host's), eager and as a replayed CUDA graph;
then the profiler's CUDA time per kernel at the full batch, and the configuration the autotuner
chose for each Triton kernel. Run under `py-spy record --idle -f raw` for the host's own split.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shatter

BASE = {"d": 768, "n": 12}


def _ms(fn, steps: int, cuda: bool = True) -> float:
    """Median ms of `fn` over `steps` calls (after 3 untimed), each ended by a device sync."""
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i < 3:
            continue
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graphed(fn, warmup: int = 3):
    """fn captured as a CUDA graph (after `warmup` eager calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _batch(
    micro_batch: int, seq_len: int, device: str, vocab: int = 32000, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (micro_batch, seq_len), generator=g)
    labels = torch.where(torch.rand(micro_batch, seq_len, generator=g) < 0.15, ids, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}


def step_rows(
    arch: str, micro_batch: int, seq_len: int, steps: int, device: str, size: str = "base"
) -> dict[str, float]:
    """ms a step: the model's own forward (its loss gathers the predicted positions with a
    boolean index: a host sync), the same sum with the positions gathered by an index made on
    the host beforehand (no sync), and that step replayed as a CUDA graph."""
    torch.manual_seed(0)
    model = shatter.build_model(f"{arch}-{size}", vocab_size=32000, max_len=max(512, seq_len)).to(
        device
    )
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, capturable=cuda)
    batch = _batch(micro_batch, seq_len, device)
    flat = batch["labels"].flatten()
    where = (flat != -100).nonzero().squeeze(1)  # once, before timing
    target = flat[where]
    for p in model.parameters():  # grads exist before capture, so the graph reuses them
        p.grad = torch.zeros_like(p)

    def model_loss():
        return model(**batch)["loss"]

    def static_loss():
        h = model.encoder(batch["input_ids"], batch["attention_mask"])
        logits = model.mlm_head(h.flatten(0, 1)[where])
        return torch.nn.functional.cross_entropy(logits, target)

    def step(loss_fn):
        with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    rows = {
        "eager": _ms(lambda: step(model_loss), steps, cuda),
        "eager, no sync": _ms(lambda: step(static_loss), steps, cuda),
    }
    if cuda:
        try:
            rows["CUDA graph"] = _ms(_graphed(lambda: step(static_loss)), steps, cuda)
        except Exception as e:  # noqa: BLE001  (a capture failure is a finding, not the end)
            print(
                f"{arch}: CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )
            torch.cuda.synchronize()
    return rows


def compiled_ms(
    arch: str, micro_batch: int, seq_len: int, steps: int, device: str, size: str, mode
):
    """(seconds of the first 8 steps, which compile; ms a step after) of the model's own forward
    compiled by torch.compile in `mode`, over 4 batches of different masks."""
    import itertools

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shatter.build_model(f"{arch}-{size}", vocab_size=32000, max_len=max(512, seq_len))
    model = model.to(device)
    model.compile(mode=mode)
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    batches = itertools.cycle([_batch(micro_batch, seq_len, device, seed=i) for i in range(4)])

    def step():
        if mode:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(**next(batches))["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(8):  # every mask's graphs compiled, and recompiled with M dynamic
        step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, _ms(step, steps, cuda)


def graphed_compile_rows(
    arch: str, micro_batch: int, seq_len: int, steps: int, device: str, size: str
):
    """ms a step compiled in torch.compile's "reduce-overhead" mode: inductor's CUDA graphs, where
    graphs whose shapes vary (the MLM head's, whose gathered positions change from batch to
    batch) run without them. The trainer's own compilation (inductor's default mode) is
    bench_train.py's."""
    import torch._inductor.config as inductor_config

    inductor_config.triton.cudagraph_skip_dynamic_graphs = True
    mode = "reduce-overhead"
    try:
        first, ms = compiled_ms(arch, micro_batch, seq_len, steps, device, size, mode)
    except Exception as e:  # noqa: BLE001  (a failure to compile is a finding, not the end)
        print(f"{arch}: {mode} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return {}
    return {f"compiled, CUDA graphs (first 8 steps {first:.0f} s)": ms}


def op_rows(L: int, B: int, steps: int) -> dict[str, float]:
    from shatter.tools.bench.bench_kernel import _fwd_bwd, contenders

    fn, leaves = contenders(B, L, BASE["d"], BASE["n"], torch.bfloat16, True, True)["triton"]
    step = _fwd_bwd(fn, leaves)
    rows = {"eager": _ms(step, steps)}
    rows["CUDA graph"] = _ms(_graphed(step), steps)
    return rows


def kernel_table(L: int, B: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from shatter.kernels import partition_mixing as pm
    from shatter.tools.bench.bench_kernel import _fwd_bwd, contenders

    fn, leaves = contenders(B, L, BASE["d"], BASE["n"], torch.bfloat16, True, True)["triton"]
    step = _fwd_bwd(fn, leaves)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"\n### l = {L}, batch {B}: 5 x fwd+bwd, by CUDA time")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60)
    )
    for name in (
        "row_stats_kernel",
        "mix_fwd_kernel",
        "delta_kernel",
        "mix_bwd_dv_kernel",
        "mix_bwd_dz_kernel",
    ):
        tuner = getattr(pm, name)
        for key, config in getattr(tuner, "cache", {}).items():
            print(f"{name}: key {key} -> {config}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("step", "op"))
    parser.add_argument("--archs", default="bert,shatter")
    parser.add_argument("--micro-batch", default="16,64")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--size", default="base")
    parser.add_argument(
        "--compile",
        default="",
        help="step: these archs also compiled with CUDA graphs (last --micro-batch)",
    )
    parser.add_argument("--lengths", default="256,1024")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--device", default="cuda", help="step: cpu runs the eager rows (a smoke test)"
    )
    parser.add_argument("--loop-seconds", type=float, default=0.0, help="op: then loop batch 1 this long (for py-spy)")  # fmt: skip
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("host_profile: needs a CUDA device (tools/bench/host_profile.py)")
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, bf16")
    if args.what == "step":
        sizes = list(map(int, args.micro_batch.split(",")))
        for mb in sizes:
            for arch in args.archs.split(","):
                rows = step_rows(arch, mb, args.seq_len, args.steps, args.device, args.size)
                if arch in args.compile.split(",") and mb == sizes[-1]:
                    rows |= graphed_compile_rows(
                        arch, mb, args.seq_len, args.steps, args.device, args.size
                    )
                floor = rows.get("CUDA graph", rows["eager, no sync"])
                cells = ", ".join(f"{k} {v:.2f} ms ({v / floor:.2f}x)" for k, v in rows.items())
                print(f"{arch}-{args.size}, {mb} x {args.seq_len}: {cells}", flush=True)
        return
    for L in map(int, args.lengths.split(",")):
        for B in (args.batch_tokens // L, 1):
            rows = op_rows(L, B, args.steps)
            print(f"triton fwd+bwd, l = {L}, batch {B}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows.items()), flush=True)  # fmt: skip
    for L in map(int, args.lengths.split(",")):
        kernel_table(L, args.batch_tokens // L)
    if args.loop_seconds:
        from shatter.tools.bench.bench_kernel import _fwd_bwd, contenders

        fn, leaves = contenders(1, 256, BASE["d"], BASE["n"], torch.bfloat16, True, True)["triton"]
        step, t0, calls = _fwd_bwd(fn, leaves), time.perf_counter(), 0
        while time.perf_counter() - t0 < args.loop_seconds:
            step()
            calls += 1
        torch.cuda.synchronize()
        print(
            f"loop: {calls} fwd+bwd at l = 256, batch 1, {(time.perf_counter() - t0) / calls * 1e3:.3f} ms each"
        )


if __name__ == "__main__":
    main()
