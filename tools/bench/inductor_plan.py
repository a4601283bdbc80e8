"""Inductor's own kernels for one compiled training step on a GPU, planned on a machine without one.

    python tools/bench/inductor_plan.py --arch bert --size base --length 256 --rows 64 --json -

torch.compile's inductor splits a model's forward and backward into extern kernels (cuBLAS GEMMs,
SDPA, our `shatter::` custom ops) and the Triton kernels it writes itself for everything else: its
scheduler fuses pointwise ops into each other, into the reductions that read them (LayerNorm and
its backward, the softmax of the loss) and side by side where they read the same tensors. Which
ops land in which kernel is inductor's decision, and this module asks inductor for it rather than
guessing it: the step is compiled on this machine's CPU with inductor's Triton backend for the CPU
(`cpu_backend = "triton"`, the scheduler and code generator a CUDA device uses) against a CUDA
sm_90 target, and nothing is executed on a GPU:

- each Triton kernel inductor generates is recorded (not compiled), with the HBM bytes inductor
  itself counts for it (`kernel_num_gb`, its `benchmark_kernel` metadata: every buffer it reads
  or writes once) and its grid (`grid_type`); every launch of it in the forward or the backward
  is counted;
- the scheduler's fusions that inductor keeps to GPU devices are taken as a GPU takes them: its
  mix-order reductions (on by default for CUDA; `MixOrderReductionGrid`), which fold a
  LayerNorm backward's weight and bias gradients (sums down the tokens) into the kernel that
  sums each token's row, where the CPU's plan would read the tensors again in a kernel of their
  own. A torch whose scheduler gates them inline (no `_is_gpu_triton_backend`) keeps the CPU's
  choice, and the plan says so on stderr;
- the torch ops inductor's generated wrapper calls between its kernels are recorded too, each a
  CUDA kernel of its own (`wrapper_ops`): a mix-order reduction's last sums over its partial rows
  (`shatter::partial_sums`, one kernel for the gradients it folds and their casts, as a compiled
  run rewrites inductor's torch sums: train/mix_order.py), the dropout seeds
  (`randint`), the fallbacks inductor writes no Triton for (the embedding gradient's
  `index_add`), with their bytes counted as the eager trace counts an op's (each tensor it reads
  or writes once; step_trace.StepTrace);
- the extern kernels do not run: the GEMMs are no-ops; SDPA is the aten op CUDA runs
  (FlashAttention-2, or the memory-efficient kernel: step_trace.gpu_sdpa), one extern kernel
  each way, and it and each `shatter::` op return empty tensors of their fake impl's shapes.
  The MLM head decodes PREDICTED of the positions, given as the trainer's loader gives them
  (`predicted`). Values are garbage; only the plan is read.

So the plan is real tensors of the step's real shapes (untouched memory: `empty` allocates pages
it never writes) for seconds of CPU plus inductor's compile time (about 40 s at base size).
Inductor's heuristics that read the device's properties (how many ways it splits a reduction,
a mix-order reduction's partial rows: 8 programs an SM) read the target GPU's SM count
(cost.SMS), not this machine's cores. What a GPU would do differently: its autotuned block sizes,
and it keeps a GEMM's bias inside `addmm` on a CPU where on a GPU it may move it into the next
pointwise kernel (the same bytes). The GEMMs, SDPA and custom ops are
priced from the eager trace (tools/bench/step_trace.py), not from here.

JSON: {"torch", "kernels": [{"name", "phase" (forward or backward), "bytes", "launches", "grid"}]}:
a wrapper's op is named by its aten op ("aten::sum") with grid "wrapper", one entry per size.

`planned(...)` is the same from another process (the patches above change this process for
good), cached per argument set, torch and triton version and the checkout's code in
$SHATTER_PLAN_CACHE (default ~/.cache/shatter/inductor-plans): the first plan of a base-size
step takes about 40 s of CPU, a cached one milliseconds. Inductor's and Triton's own environment
variables (TORCHINDUCTOR_*, TRITON_*) are not in the key: a plan made under other settings of
them is not made again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import click
import torch

EXTERN_GEMMS = ("mm", "addmm", "bmm", "baddbmm")
PREDICTED = 0.15  # the share of positions the MLM head decodes, as the eager trace takes it
PHASE = {"now": "forward"}
LAUNCHES: Counter = Counter()  # (kernel name, phase) -> launches
BYTES: dict[str, float] = {}
GRIDS: dict[str, str] = {}  # kernel name -> inductor's grid type (Grid1D, MixOrderReductionGrid..)
WRAPPER_OPS: Counter = Counter()  # (aten op, phase, bytes) -> launches (module doc)
WRAPPER = "wrapper"  # the grid of a wrapper's op in the JSON


class _Planned:
    """A generated Triton kernel, recorded instead of compiled: each run is one launch."""

    def __init__(self, name: str):
        self.name = name

    def run(self, *args, **kwargs) -> None:
        LAUNCHES[self.name, PHASE["now"]] += 1


def _record(self, kernel_name: str, source_code: str, device_str: str = "cuda") -> _Planned:
    found = re.search(r"'kernel_num_gb': ([0-9.eE+-]+)", source_code)
    if not found:
        raise SystemExit(f"inductor_plan: kernel {kernel_name} has no kernel_num_gb metadata")
    BYTES[kernel_name] = float(found.group(1)) * 1e9
    grid = re.search(r"'grid_type': '(\w+)'", source_code)
    GRIDS[kernel_name] = grid.group(1) if grid else "?"
    return _Planned(kernel_name)


def plan_for_gpu(capability: tuple[int, int] = (9, 0), flash: bool = True) -> None:
    """Make inductor plan Triton kernels for a CUDA `capability` target from CPU tensors, recording
    them instead of compiling them, and make the extern kernels no-ops (module doc); `flash`: SDPA
    without a mask runs FlashAttention-2 (sm_80+), else the memory-efficient kernel. For this
    process only, before it imports shatter's kernels: it changes inductor's and torch's state
    for good, and takes our Triton ops' CPU path (TRITON_INTERPRET=1: never run, as stubbed)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor
    import torch.utils._triton as torch_triton
    from torch._inductor.select_algorithm import extern_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    torch_triton.triton_backend = functools.cache(
        lambda: make_backend(GPUTarget("cuda", capability[0] * 10 + capability[1], 128))
    )
    async_compile.AsyncCompile.triton = _record
    inductor.cpu_backend = "triton"
    inductor.benchmark_kernel = True  # each kernel's source carries kernel_num_gb
    inductor.compile_threads = 1
    for name in EXTERN_GEMMS:
        setattr(extern_kernels, name, lambda *args, out=None, **kwargs: out)
    aten = torch.library.Library("aten", "IMPL")
    _KEEP.append(aten)
    _stub_sdpa(aten, flash)
    _stub_custom_ops()
    _gpu_fusions()
    _gpu_properties(capability)
    _count_wrapper_ops()


def _gpu_fusions() -> None:
    """The scheduler's GPU-only fusions (mix-order reductions) allowed for the CPU's Triton
    nodes, as inductor allows them for CUDA's (module doc)."""
    import torch._inductor.scheduler as scheduler

    if hasattr(scheduler, "_is_gpu_triton_backend"):
        scheduler._is_gpu_triton_backend = lambda node1, node2: True
    else:
        print(
            f"inductor_plan: torch {torch.__version__} gates its mix-order reductions to CUDA "
            "inline: the plan keeps the CPU's kernels for LayerNorm's weight gradients",
            file=sys.stderr,
        )


def _gpu_properties(capability: tuple[int, int]) -> None:
    """The CPU device's properties, as inductor's heuristics read them, made the target GPU's
    (module doc): its SM count (cost.SMS), where they would be this machine's core count."""
    from torch._inductor.runtime.hints import DeviceProperties

    from shatter.kernels.cost import SMS
    from shatter.kernels.family import family_of

    create = DeviceProperties.create
    gpu = dict(
        multi_processor_count=SMS[family_of(capability)], warp_size=32,
        max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536,
    )  # fmt: skip

    def created(cls, device):
        props = create(device)
        return props._replace(**gpu) if props.type == "cpu" else props

    DeviceProperties.create = classmethod(functools.cache(created))


def _count_wrapper_ops() -> None:
    """Each compiled graph run under a StepTrace that records the torch ops its wrapper calls
    (module doc): those that launch a kernel of inductor's own kind ("memory"), not the extern
    GEMMs, SDPA or custom ops (priced from the eager trace; the GEMMs here are no-ops that
    dispatch nothing)."""
    from torch._inductor.output_code import CompiledFxGraph

    from shatter.tools.bench.step_trace import StepTrace
    from shatter.train.mix_order import (
        WRAPPER_CUSTOM_OPS,  # absent from the eager trace: planned here
    )

    call = CompiledFxGraph.__call__

    def counted(self, inputs):
        trace = StepTrace(PREDICTED)
        with trace:
            out = call(self, inputs)
        for (op, _, kind, _, _, nbytes, launches, _), _ in trace.events:
            if kind == "memory" or op in WRAPPER_CUSTOM_OPS:
                WRAPPER_OPS[op, PHASE["now"], nbytes] += launches
        return out

    CompiledFxGraph.__call__ = counted


SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
)
_KEEP: list = []  # the stubs' library registrations, alive for the process


def _stub_sdpa(aten, flash: bool) -> None:
    """SDPA as CUDA runs it (step_trace.gpu_sdpa: FlashAttention-2 or the memory-efficient
    kernel, one extern kernel each way, its output laid out as that kernel's meta impl lays it
    out), those aten ops given CPU kernels that return empty tensors of their shapes."""
    from shatter.tools.bench.step_trace import gpu_sdpa

    for name in SDPA_OPS:
        aten.impl(name, _shaped_stub(getattr(torch.ops.aten, name).default), "CPU")

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        return gpu_sdpa(flash, q, k, v, attn_mask, dropout_p, is_causal, scale)

    torch.nn.functional.scaled_dot_product_attention = sdpa


def _empty_cpu(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)


def _stub_custom_ops() -> None:
    """Every `shatter::` custom op returns empty tensors of its fake impl's shapes on the CPU."""
    import shatter.attention.rows  # noqa: F401 (registers the ops)
    import shatter.attention.triton_kernel  # noqa: F401
    import shatter.kernels.fused_attention  # noqa: F401
    import shatter.kernels.gelu_linear  # noqa: F401
    import shatter.kernels.master_adamw  # noqa: F401
    import shatter.kernels.norm_verdict  # noqa: F401
    import shatter.kernels.partial_sums  # noqa: F401
    from shatter.kernels.cost import OP_SCHEMA

    for qualname in OP_SCHEMA:
        op = getattr(torch.ops.shatter, qualname.split("::")[1])
        torch.library.register_kernel(qualname, "cpu", _shaped_stub(op))


def _shaped_stub(op):
    """A CPU kernel for `op`: empty tensors of its fake impl's outputs (shapes, strides, dtypes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    @torch.compiler.disable  # a kernel: Dynamo would compile it into kernels that do not run
    def kernel(*args, **kwargs):
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = op(*args, **kwargs)
        return tree_map(_empty_cpu, out)

    return kernel


def plan_step(model, length: int, rows: int, low: torch.dtype, padding=False) -> list[dict]:
    """The Triton kernels inductor makes for one training step of `model` (built on the CPU) at
    `rows` x `length` tokens in `low`, compiled as the trainer compiles it (`nn.Module.compile`),
    with PREDICTED of its positions predicted and, with `padding`, an all-ones attention mask:
    [{"name", "phase", "bytes", "launches", "grid"}]."""
    from shatter.partition import relative_index
    from shatter.train.compiling import compile_in_place, mark_varying

    model = model.to(low).train()
    # the state of a run's steps after its first, whose values no kernel here would make: the
    # fp32 partition tables (step_trace.build_meta) and the relative-position index
    for module in model.modules():
        if hasattr(module, "exact_partition"):
            module.exact_partition()
    relative_index(length, model.config.max_len, torch.device("cpu"))
    compile_in_place(model)
    ids = torch.randint(5, 100, (rows, length))
    labels = ids.clone()
    # the positions the loader counts on the host: the first PREDICTED of them, as the eager
    # trace counts them (step_trace.trace_step), a varying size as the trainer marks it
    predicted = torch.arange(max(1, round(PREDICTED * rows * length)))
    mark_varying({"predicted": predicted})
    mask = torch.ones(rows, length, dtype=torch.long) if padding else None
    PHASE["now"] = "forward"
    loss = model(ids, mask, labels, predicted=predicted)["loss"]
    PHASE["now"] = "backward"
    loss.backward()
    kernels = [
        {"name": name, "phase": phase, "bytes": BYTES[name], "launches": n, "grid": GRIDS[name]}
        for (name, phase), n in LAUNCHES.items()
    ]
    return kernels + [
        {"name": op, "phase": phase, "bytes": float(nbytes), "launches": n, "grid": WRAPPER}
        for (op, phase, nbytes), n in WRAPPER_OPS.items()
    ]


ROOT = Path(__file__).resolve().parents[2]


def _code_hash() -> str:
    """A hash of the code a plan depends on: the model package (its own files, not the linked
    pipeline, train and tools), this tool, the SDPA choice it takes from step_trace and the
    trainer's compile (train/compiling.py, train/mix_order.py)."""
    package = ROOT / "shatter"
    files = [p for p in package.glob("**/*.py") if p.resolve().is_relative_to(package)]
    files += [Path(__file__).resolve(), Path(__file__).resolve().with_name("step_trace.py")]
    files += [ROOT / "train" / "compiling.py", ROOT / "train" / "mix_order.py"]
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


def planned(
    arch, size, length, rows, vocab, max_len, impl, low, flash, padding, capability, ffn_impl=None
) -> list[dict]:
    """`plan_step`'s kernels for one step, made in a subprocess (`main`) or read from the cache
    (module doc); a failure exits with its last line."""
    if importlib.util.find_spec("triton") is None:
        raise SystemExit(
            "inductor_plan: the compiled figures are inductor's Triton plan, and triton is not "
            "installed: pip install triton (or read the eager figures: --eager)"
        )
    import triton

    args = ["--arch", arch, "--size", size, "--length", str(length), "--rows", str(rows)]
    args += ["--vocab", str(vocab), "--max-len", str(max_len)]
    args += ["--dtype", str(low).removeprefix("torch.")]
    args += ["--capability", "{}.{}".format(*capability), "--flash" if flash else "--no-flash"]
    args += ["--impl", impl] * bool(impl) + ["--padding"] * padding
    args += ["--ffn-impl", ffn_impl] * bool(ffn_impl)
    key = " ".join([torch.__version__, triton.__version__, _code_hash(), *args])
    cache = Path(
        os.environ.get("SHATTER_PLAN_CACHE", Path.home() / ".cache/shatter/inductor-plans")
    )
    path = cache / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    if path.exists():
        return json.loads(path.read_text())["kernels"]
    cache.mkdir(parents=True, exist_ok=True)
    print(
        f"inductor_plan: planning {arch} at length {length} (about 40 s at base size)",
        file=sys.stderr,
    )
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = [sys.executable, "-m", "shatter.tools.bench.inductor_plan", *args, "--json", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_plan_env())
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"inductor_plan: {arch} at length {length} could not be planned: {last}")
    tmp.replace(path)
    return json.loads(path.read_text())["kernels"]


def _plan_env() -> dict:
    """The planning process's environment: this checkout first on its path, a private inductor
    cache (FX graphs of CPU tensors with stubbed kernels are not a run's) without its graph
    caches (their keys leave out this module's patches: a graph planned before a change of them
    would come back unchanged; `planned` caches the plans), and Triton's FP fusion default said
    (Triton 3.9 warns where it is unset; the kernels are not compiled)."""
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path.home() / ".cache/shatter/inductor-plan-fx")
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = env["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    return env


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--arch", required=True)
@click.option("--size", default="base", show_default=True)
@click.option("--length", type=int, required=True)
@click.option("--rows", type=int, required=True)
@click.option("--vocab", type=int, default=30000, show_default=True)
@click.option("--max-len", type=int, default=512, show_default=True, help="the model's max_len")
@click.option("--impl", default=None, help="the single-head archs' attention_impl")
@click.option("--ffn-impl", default=None, help="the model's ffn_impl (shatter/ffn.py)")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), default="bfloat16")
@click.option("--capability", default="9.0", show_default=True, help="the CUDA target")
@click.option("--flash/--no-flash", default=True, show_default=True, help="SDPA's kernel")
@click.option("--padding", is_flag=True, help="every batch passes its attention mask")
@click.option("--json", "json_to", default="-", show_default=True, help="file, or - for stdout")
def main(
    arch, size, length, rows, vocab, max_len, impl, ffn_impl, dtype, capability, flash, padding,
    json_to,
):  # fmt: skip
    import shatter

    plan_for_gpu(tuple(int(x) for x in capability.split(".")), flash)
    overrides = dict(vocab_size=vocab, max_len=max_len)
    if impl:
        overrides["attention_impl"] = impl
    if ffn_impl:
        overrides["ffn_impl"] = ffn_impl
    model = shatter.build_model(f"{arch}-{size}", **overrides)
    kernels = plan_step(model, length, rows, getattr(torch, dtype), padding)
    text = json.dumps({"torch": torch.__version__, "kernels": kernels})
    if json_to == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(json_to, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
