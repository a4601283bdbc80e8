"""Side-by-side GPU time of bf16 ZeRO-1's optimizer step on one GPU, the update alone (no norm, no
collectives), for a model's parameters:

    torch     as DeepSpeed steps torch's fused AdamW (`optim.impl: torch`): the bf16 gradients
              copied into one flat fp32 buffer (one multi-tensor copy that casts), the step
              count's two ops around `_fused_adamw_` (grad_scale, found_inf), the master cast
              back into the bf16 weights
    master    the one-pass step (`optim.impl: master`, train/master_step.py): `shatter::
              master_adamw_` reading each parameter's gradient where it lies (one GPU)
    flat      the same kernel on one flat gradient (a partition's, on several GPUs)

It prints each one's median ms (`triton.testing.do_bench`), its ratio to `torch`, and the HBM
bandwidth it reached counting the step model's bytes (44, 28, 28 a parameter), beside the GPU's
datasheet bandwidth: the model prices these kernels at 60% of it (EFFICIENCY["memory"]).

    python tools/bench/bench_optim.py --preset bert-base
"""

from __future__ import annotations

import click
import torch

BYTES = {"torch": 44, "master": 28, "flat": 28}  # a parameter, as tools/bench/step_trace.py counts


def _steps(preset: str, dev: str = "cuda") -> tuple[int, dict, dict]:
    """The parameter count of `preset`, each way's step on `dev` as a function of no arguments,
    and the state they update (tests/tools/test_bench_optim.py runs them on the CPU under the
    interpreter)."""
    import shatter
    from shatter.kernels.master_adamw import master_adamw_

    model = shatter.build_model(preset, vocab_size=30522)
    shapes = [p.shape for p in model.parameters()]
    n = sum(s.numel() for s in shapes)
    grads = [torch.randn(s, device=dev).bfloat16() * 1e-3 for s in shapes]
    master, m, v = (torch.randn(n, device=dev) * 0.02 for _ in range(3))
    v.abs_()
    weight, flat32 = torch.empty(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev)
    flat16 = torch.cat([g.reshape(-1) for g in grads])
    step, scale, found = (
        torch.zeros((), device=dev),
        torch.ones((), device=dev),
        torch.zeros((), device=dev),
    )
    sizes = [g.numel() for g in grads]

    def torch_way():
        torch._foreach_copy_(list(flat32.split(sizes)), [g.reshape(-1) for g in grads])
        torch._foreach_add_([step], 1)
        torch._fused_adamw_(
            [master], [flat32], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999,
            weight_decay=0.01, eps=1e-6, amsgrad=False, maximize=False, grad_scale=scale,
            found_inf=found,
        )  # fmt: skip
        torch._foreach_sub_([step], [found])
        weight.copy_(master)

    def one_pass(gradients):
        master_adamw_(
            gradients, master, m, v, step, weight, 1e-4, 0.9, 0.999, 1e-6, 0.01,
            grad_scale=scale, found_inf=found,
        )  # fmt: skip

    def master_way():
        one_pass(grads)

    def flat_way():
        one_pass([flat16])

    ways = {"torch": torch_way, "master": master_way, "flat": flat_way}
    return n, ways, {"master": master, "weight": weight, "step": step}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--preset", default="bert-base", show_default=True, help="whose parameters")
def main(preset: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_optim: needs a CUDA device")
    from triton.testing import do_bench

    from shatter.tools.bench.step_cost import GPUS

    n, steps, _ = _steps(preset)
    name = torch.cuda.get_device_name()
    sheet = next((bw for gpu, (_, bw) in GPUS.items() if gpu in name), None)
    print(f"{name}, {preset}: {n / 1e6:.1f}M parameters, bf16 gradients and weights, fp32 master")
    print("| way | ms | / torch | GB/s (model's bytes) | of the datasheet's |")
    print("|---|---|---|---|---|")
    base = None
    for way, fn in steps.items():
        ms = do_bench(fn)
        base = base or ms
        rate = BYTES[way] * n / ms / 1e6
        share = f"{rate * 1e9 / sheet:.0%}" if sheet else "?"
        print(f"| {way} | {ms:.3f} | {ms / base:.2f} | {rate:.0f} | {share} |")


if __name__ == "__main__":
    main()
