"""Ahead-of-time compile report for the Triton partition-attention kernels (no GPU needed).

For every kernel (fwd, dv, dq, dx), every autotune configuration, the base (d=768, n=12) and
large (d=1024, n=16) shapes, and each dtype, it compiles the kernel for each requested arch with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`, reads shared memory from the
compiled kernel's metadata, and runs the wheel's `cuobjdump` on the cubin for registers, spill
(stack) bytes and HMMA/HGMMA tensor-core instruction counts; each configuration is compiled for the
arch families and activations it is listed for (`archs`, `acts`). It prints one table row per compile
and exits non-zero when a configuration exceeds the arch's shared memory per block, spills, or
has no tensor-core instruction: such configurations must leave the autotune lists of
shatter/kernels/partition_attention.py.

    python tools/kernel_report.py --arch 80,90
    python tools/kernel_report.py --arch 90 --shape base --dtype bf16 --first-config   # CI subset
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # usable shared memory per block (A100, H100)
SHAPES = {"base": (768, 12), "large": (1024, 16)}  # (d, n), the paper's sizes
DTYPES = ("bf16", "fp16", "fp32")  # fp32 runs IEEE dots: no tensor cores expected
L_EXAMPLE = 512  # a typical pretraining length: sets which int arguments are multiples of 16
MAX_LEN = 512


@dataclass
class Row:
    arch: int
    kernel: str
    activation: str
    shape: str
    dtype: str
    config: str
    smem: int
    regs: int
    spill: int
    hmma: int
    hgmma: int

    def problems(self) -> list[str]:
        out = []
        if self.smem > SMEM_LIMIT[self.arch]:
            out.append(f"smem {self.smem} > {SMEM_LIMIT[self.arch]}")
        if self.spill:
            out.append(f"spills {self.spill} bytes")
        if not self.hmma + self.hgmma and self.dtype != "fp32":
            out.append("no tensor-core instruction")
        return out


def _args(kernel: str, d: int, n: int, dtype: str) -> dict[str, tuple[str, object]]:
    """(triton type, representative value) per runtime argument, as the wrapper passes them for
    B = 8, L = L_EXAMPLE; the values only decide the runtime's divisibility-by-16 hints."""
    L, k, m = L_EXAMPLE, d // n, MAX_LEN
    ptr = lambda t: (f"*{t}", None)  # noqa: E731
    common = {
        "sq_b": L * d, "sq_l": d, "sx_b": L * d, "sx_l": d, "sc_b": L * n, "sc_l": n,
        "st_h": 2 * m - 1, "L": L, "L_KEY": L, "D_MODEL": d, "K_PART": k, "T_CENTRE": m - 1,
    }  # fmt: skip
    v = {"sv_b": L * d, "sv_h": k, "sv_l": d}
    if kernel == "fwd":
        ptrs = dict(Q=dtype, X=dtype, V=dtype, C=dtype, Mk="fp32", T="fp32", OUT="fp32", AP="fp32")
        ptrs.update(SS="fp32", MX="fp32")
        ints = {**common, **v, "so_b": L * d, "so_h": L * k, "so_l": k, "sa_b": L * n, "sa_l": n}
    elif kernel == "dv":
        ptrs = dict(Q=dtype, X=dtype, C=dtype, Mk="fp32", T="fp32", STAT="fp32", STAT2="fp32")
        ptrs.update(DO=dtype, DV=dtype)
        ints = {**common, "sd_b": L * d, "sd_h": L * k, "sd_l": k}
    else:
        ptrs = dict(Q=dtype, X=dtype, V=dtype, C=dtype, Mk="fp32", T="fp32", STAT="fp32")
        ptrs["STAT2"] = "fp32"
        ptrs.update(DELTA="fp32", DO=dtype, DAP=dtype, G=dtype, DC=dtype)
        ints = {**common, **v, "sd_b": L * d, "sd_h": L * k, "sd_l": k, "sa_b": L * n, "sa_l": n}
        ints.update(sg_b=L * d, sg_l=d)
    out = {name: ptr(t) for name, t in ptrs.items()}
    out.update({name: ("i32", val) for name, val in ints.items()})
    out["scale"] = ("fp32", None)
    return out


def _cuobjdump(*args: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    res = subprocess.run([str(tool), *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"kernel_report: cuobjdump failed: {res.stderr.strip()} ({tool})")
    return res.stdout


def compile_one(arch: int, kernel: str, activation: str, shape: str, dtype: str, config) -> Row:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from shatter.attention.triton_kernel import kernel_meta
    from shatter.kernels import partition_attention as pa

    tuned = {
        "fwd": pa.partition_fwd_kernel,
        "dv": pa.partition_bwd_dv_kernel,
        "dq": pa.partition_bwd_dq_kernel,
        "dx": pa.partition_bwd_dx_kernel,
    }[kernel]
    fn = tuned.fn
    d, n = SHAPES[shape]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    meta = kernel_meta(d, n, torch_dtype)
    args = _args(kernel, d, n, dtype)
    constexprs = {"HAS_C": True, "N_PARTS": n, "BLOCK_K": meta["BLOCK_K"], "PREC": meta["PREC"]}
    constexprs["SIGMOID"] = activation == "sigmoid"
    constexprs.update(config.kwargs)
    if kernel in ("dq", "dx"):
        constexprs.update(KEY_MAJOR=kernel == "dx", NP=meta["NP"], DCH=meta["DCH"])
        constexprs["NUM_DC"] = triton.cdiv(d, meta["DCH"])
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        ty, val = args[name]
        signature[name] = ty
        if ty.startswith("*") or (isinstance(val, int) and val % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the runtime specialises aligned args
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = _cuobjdump("--dump-resource-usage", cubin)
        sass = _cuobjdump("-sass", cubin)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    cfg = "M{BLOCK_M} N{BLOCK_N} D{BLOCK_D}".format(**config.kwargs)
    cfg += f" w{config.num_warps} s{config.num_stages}"
    return Row(
        arch, kernel, activation, shape, dtype, cfg, compiled.metadata.shared, regs, stack,
        len(re.findall(r"\bHMMA\b", sass)), len(re.findall(r"\bHGMMA\b", sass)),
    )  # fmt: skip


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


@click.command()
@click.option("--arch", default="80,90", help="compute capabilities, comma-separated (80, 90)")
@click.option("--kernel", "kernels", default="fwd,dv,dq,dx", help="kernels to compile")
@click.option("--activation", "activations", default="sigmoid,softmax", help="sigmoid, softmax")
@click.option("--shape", "shapes", default="base,large", help="base (d=768, n=12), large")
@click.option("--dtype", "dtypes", default="bf16,fp16", help="bf16, fp16, fp32")
@click.option("--first-config", is_flag=True, help="only each kernel's first autotune config")
def main(arch, kernels, activations, shapes, dtypes, first_config):
    """Compile the Triton kernels ahead of time and check their resources (see module doc)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_report: unset TRITON_INTERPRET: the interpreter compiles nothing")
    try:
        archs = [int(a) for a in _split(arch)]
    except ValueError:
        raise SystemExit(f"kernel_report: --arch takes numbers like 80,90, got {arch!r}") from None
    for name, values, known in (
        ("--arch", archs, SMEM_LIMIT),
        ("--kernel", _split(kernels), ("fwd", "dv", "dq", "dx")),
        ("--activation", _split(activations), ("sigmoid", "softmax")),
        ("--shape", _split(shapes), SHAPES),
        ("--dtype", _split(dtypes), DTYPES),
    ):
        bad = [v for v in values if v not in known]
        if bad:
            raise SystemExit(f"kernel_report: {name} {bad} unknown; choose from {list(known)}")
    from shatter.kernels import partition_attention as pa

    lists = {"fwd": pa.FWD_CONFIGS, "dv": pa.DV_CONFIGS, "dq": pa.DQ_CONFIGS, "dx": pa.DX_CONFIGS}
    header = (
        f"{'arch':>5} {'kernel':6} {'act':7} {'shape':5} {'dtype':5} {'config':20} {'smem':>7} "
    )
    header += f"{'regs':>4} {'spill':>5} {'HMMA':>5} {'HGMMA':>5}  check"
    print(header)
    failed = 0
    combos = itertools.product(
        archs, _split(kernels), _split(activations), _split(shapes), _split(dtypes)
    )
    for cap, kernel, act, shape, dtype in combos:
        configs = [c for c in lists[kernel] if cap in c.archs and act in c.acts]
        for config in configs[:1] if first_config else configs:
            try:
                r = compile_one(cap, kernel, act, shape, dtype, config)
            except Exception as e:  # a compile error: one line, then stop
                what = f"sm_{cap} {kernel} {act} {shape} {dtype} {config}"
                msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                raise SystemExit(
                    f"kernel_report: {what} does not compile: {msg} "
                    "(shatter/kernels/partition_attention.py)"
                ) from None
            bad = r.problems()
            failed += bool(bad)
            print(
                f"sm_{r.arch:<2} {r.kernel:6} {r.activation:7} {r.shape:5} {r.dtype:5} "
                f"{r.config:20} {r.smem:>7} {r.regs:>4} {r.spill:>5} {r.hmma:>5} {r.hgmma:>5}  "
                + ("; ".join(bad) or "ok"),
                flush=True,
            )
    if failed:
        raise SystemExit(
            f"kernel_report: {failed} configuration(s) fail the checks above: drop them from the "
            "autotune lists in shatter/kernels/partition_attention.py"
        )


if __name__ == "__main__":
    sys.exit(main())
