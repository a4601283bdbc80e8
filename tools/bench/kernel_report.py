"""Ahead-of-time compile report for the Triton kernels of the partition attentions: the mixing
kernels of the hybrid `triton` and the `fused` impls (sm_80, sm_90) and the row kernels of the
`rows` impl (sm_70 and up); and for the FFN's GEMMs with GELU in their epilogues (ffn_fwd,
ffn_bwd: shatter/kernels/gelu_linear.py, sm_80 and sm_90, per shape and dtype only); no GPU
needed.

For every kernel (stats and fwd of the forward; delta, dv and dz of the backward), every autotune
configuration and every variant it is compiled for (the score source: Z read from HBM for the
hybrid `triton` impl, Q Xᵀ recomputed on chip for `fused`, or made on chip and written as Z by
the hybrid's statistics from sm_80; the partition bias HAS_C on and
off, the sigmoid and the softmax, the base (d=768, n=12) and large (d=1024, n=16) shapes, bf16
and fp16, a length that is a multiple of 16 and one that is not: l = 512 and l = 509), it
compiles the kernel
for each requested arch with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))`,
reads shared memory from the compiled kernel's metadata, and runs the wheel's `cuobjdump` on the
cubin for registers, spill (stack) bytes, cp.async copies (LDGSTS: the loads of a loop Triton
software-pipelined) and HMMA/HGMMA tensor-core instruction counts. It prints one table row per
compile and exits non-zero when a configuration exceeds the arch's shared memory per block,
spills, or (a kernel with dots, in bf16/fp16, sm_80+) has no tensor-core instruction or no
cp.async (no sweep of it pipelined: Triton pipelines only a loop with no loop inside it): such
configurations must leave the autotune lists of shatter/kernels/partition_mixing.py, and such a
kernel change must not land.

The row kernels (rows_fwd, rows_bwd: shatter/kernels/row_mixing.py) hold a whole row of l keys a
program, with row_mixing.row_warps(l) warps: they have no dot and no autotune list, and are
compiled at each --length (up to row_mixing.MAX_ROW = 4096 keys). Each arch gets the kernels
`auto` runs there: sm_70 and sm_75 (V100, T4) the row kernels, sm_80 and sm_90 the mixing ones.

    python tools/bench/kernel_report.py --arch 80,90
    python tools/bench/kernel_report.py --arch 80,90 --source qx       # the fused impl's kernels only
    python tools/bench/kernel_report.py --arch 90 --shape base --dtype bf16 --first-config   # CI subset
    python tools/bench/kernel_report.py --arch 70 --dtype fp16 --length 256,509,1024,4096  # V100

Compiles run in parallel (--jobs, the CPU count by default); the table keeps the order above.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

SMEM_LIMIT = {
    70: 96 * 1024,
    75: 64 * 1024,
    80: 163 * 1024,
    90: 227 * 1024,
}  # per block (V100, T4, A100, H100)
SHAPES = {"base": (768, 12), "large": (1024, 16)}  # (d, n), the paper's sizes
DTYPES = ("bf16", "fp16", "fp32")  # fp32 runs IEEE dots: no tensor cores expected
KERNELS = ("stats", "fwd", "delta", "dv", "dz", "rows_fwd", "rows_bwd", "ffn_fwd", "ffn_bwd")
DOT_KERNELS = ("fwd", "dv", "dz", "ffn_fwd", "ffn_bwd")  # the others: no dot to expect
ROW_KERNELS = ("rows_fwd", "rows_bwd")
# the FFN's GEMMs with GELU in their epilogues (shatter/kernels/gelu_linear.py): sm_80+ only,
# the FFN of a `shape` (d, 4d) over T = 8 x 512 tokens; no scores, bias or activation variants
FFN_KERNELS = ("ffn_fwd", "ffn_bwd")
# below sm_80 (V100, T4) `auto` runs the `rows` impl's kernels or the hybrid's mixing kernels on
# Z with FMA dots (no tensor-core instruction to expect); sm_80+ the mixing kernels alone
FMA_ARCHS = (70, 75)
LENGTHS = (512, 509)  # a multiple of 16 and not: sets which int arguments are multiples of 16
# the kernels' RECOMPUTE: Z read (triton), Q Xᵀ made (fused), or Q Xᵀ made and written as Z (the
# triton impl's statistics from sm_80: family.z_inside)
SOURCES = {"z": False, "qx": True, "make": True}
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
    has_c: bool = True
    length: int = 512
    source: str = "z"
    ldgsts: int = -1  # cp.async copies (LDGSTS): a pipelined loop's loads; -1 not read

    def problems(self) -> list[str]:
        out = []
        if self.smem > SMEM_LIMIT[self.arch]:
            out.append(f"smem {self.smem} > {SMEM_LIMIT[self.arch]}")
        if self.spill:
            out.append(f"spills {self.spill} bytes")
        dots = self.kernel in DOT_KERNELS and self.dtype != "fp32" and self.arch not in FMA_ARCHS
        if dots and not self.hmma + self.hgmma:
            out.append("no tensor-core instruction")
        if dots and self.ldgsts == 0:
            out.append("no cp.async: its sweep is not pipelined (a loop inside it?)")
        return out


def _args(d: int, n: int, dtype: str, L: int, recompute=False, rows=False) -> dict[str, tuple[str, object]]:  # fmt: skip
    """(triton type, representative value) of every runtime argument name the kernels take, as
    the wrapper passes them for B = 8 and length L (Z's and dS's rows padded to a multiple of
    16); the values only decide the runtime's divisibility-by-16 hints. X̄, A_part and their
    gradients are views of the context [B, L, cw] and of its gradient (cw = context_width, the
    model's real strides); V, c, dV and dc views of the projections P [B, L, w] and of dP; with
    `recompute`, Q (a view of P) takes Z's place and X [B, L, d] is read; the row kernels
    (`rows`) write A_part into a [B, L, n] tensor of its own."""
    from shatter.attention.projection import context_width, projection_width

    k, m, Lp = d // n, max(MAX_LEN, L), -(-L // 16) * 16
    w = projection_width(d, n)  # V, c and their gradients are columns of the projections P
    cw = context_width(d, n)  # X̄, A_part and their gradients are columns of the context
    names = ("Z", "ZO", "X", "C", "V", "OUT", "AP", "DO", "DV", "DAP", "DZ", "DC")
    ptrs = {name: dtype for name in names}
    ptrs.update({name: "fp32" for name in ("T", "STAT", "STAT2", "DELTA")})
    ptrs["Mk"] = "i1"  # the key mask, read as the model passes it (bool)
    ptrs.update(W=dtype, DW=dtype)  # the row kernels' n parts' weights [B, n, L, Lp]
    sz = (L * w, w) if recompute else (L * Lp, Lp)
    ints = {
        "sz_b": sz[0], "sz_l": sz[1], "szo_b": L * Lp, "szo_l": Lp, "sx_b": L * d, "sx_l": d,
        "sdz_b": L * Lp, "sdz_l": Lp, "D": d, "sc_b": L * w, "sc_l": w, "st_h": 2 * m - 1,
        "sv_b": L * w, "sv_h": k, "sv_l": w, "so_b": L * cw, "so_h": k, "so_l": cw,
        "sd_b": L * cw, "sd_h": k, "sd_l": cw, "sg_b": L * w, "sg_h": k, "sg_l": w,
        "sa_b": L * cw, "sa_l": cw, "sp_b": L * cw, "sp_l": cw, "sdc_b": L * w, "sdc_l": w,
        "L": L, "L_KEY": 1 << (L - 1).bit_length(), "K_PART": k, "T_CENTRE": m - 1,
        "sm_b": L, "sw_b": n * L * Lp, "sw_h": L * Lp, "sw_l": Lp, "DC_COLS": w - 2 * d,
        "AP_COLS": cw - d,
    }  # fmt: skip
    if rows:
        ints.update(sa_b=L * n, sa_l=n)
    out = {name: (f"*{t}", None) for name, t in ptrs.items()}
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


def _ffn_args(kernel: str, d: int, dtype: str, L: int) -> dict[str, tuple[str, object]]:
    """An FFN kernel's runtime arguments for T = 8 L tokens of width d, an inner width of 4d:
    x, h, GELU(h), dy and dh row-major; W is W_in [4d, d] (ffn_fwd) or W_out [d, 4d] (ffn_bwd),
    nn.Linear's layouts."""
    ptrs = {name: (f"*{dtype}", None) for name in ("X", "W", "BIAS", "H", "G", "DY", "DH")}
    ptrs["PART"] = ("*fp32", None)
    f = 4 * d
    ints = dict(M=8 * L, N=f, K=d, sx_m=d, sx_k=1, sh_m=f, sg_m=f, sdy_m=d, sdy_k=1, sdh_m=f)
    ints.update(dict(sw_n=1, sw_k=f) if kernel == "ffn_bwd" else dict(sw_n=d, sw_k=1))
    return {**ptrs, **{name: ("i32", v) for name, v in ints.items()}}


def tuned_kernels() -> dict:
    from shatter.kernels import gelu_linear as gl, partition_mixing as pm, row_mixing as rm

    return {
        "stats": (pm.row_stats_kernel, pm.STATS_CONFIGS),
        "fwd": (pm.mix_fwd_kernel, pm.FWD_CONFIGS),
        "delta": (pm.delta_kernel, pm.DELTA_CONFIGS),
        "dv": (pm.mix_bwd_dv_kernel, pm.DV_CONFIGS),
        "dz": (pm.mix_bwd_dz_kernel, pm.DZ_CONFIGS),
        "rows_fwd": (rm.rows_fwd_kernel, None),
        "rows_bwd": (rm.rows_bwd_kernel, None),
        "ffn_fwd": (gl.linear_gelu_kernel, gl.CONFIGS),
        "ffn_bwd": (gl.linear_gelu_bwd_kernel, gl.CONFIGS),
    }


def row_config(L: int):
    """The one launch configuration of the row kernels at length L (shatter/attention/rows.py)."""
    import triton

    from shatter.kernels.row_mixing import row_warps

    block = triton.next_power_of_2(L)
    return triton.Config({"BLOCK_L": block}, num_warps=row_warps(block), num_stages=1)


def compile_one(
    arch: int, kernel: str, activation: str, shape: str, dtype: str, config, has_c=True, L=512,
    source="z",
) -> Row:  # fmt: skip
    import torch
    from triton.compiler import ASTSource

    from shatter.attention.triton_kernel import kernel_meta
    from shatter.kernels.family import delta_inside, family_of

    jit = tuned_kernels()[kernel][0]
    fn = jit.fn if hasattr(jit, "configs") else jit  # an autotuner's kernel, or the kernel
    d, n = SHAPES[shape]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if kernel in FFN_KERNELS:
        return _compile_ffn(arch, kernel, shape, dtype, config, L)
    values = {**kernel_meta(d, n, torch_dtype), **config.kwargs}
    values.update(HAS_C=has_c, SIGMOID=activation == "sigmoid", RECOMPUTE=SOURCES[source])
    values["DELTA_INSIDE"] = delta_inside(family_of((arch // 10, arch % 10)))
    # the statistics write z + b: Z made on chip (source "make"), or cuBLAS's Z with the bias
    values["KEEP"] = source == "make" or (source == "z" and has_c)
    constexprs = {name: values[name] for name in fn.arg_names if name in values}
    args = _args(d, n, dtype, L, SOURCES[source], kernel in ROW_KERNELS)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        ty, val = args[name]
        signature[name] = ty
        if ty.startswith("*") or (isinstance(val, int) and val % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the runtime specialises aligned args
    # no tensor-core instruction to count in the row kernels (no dot) or below sm_80 (FMA
    # dots), and CUDA 13's disassembler (Triton 3.9's cuobjdump) refuses sm_70 code
    sass = kernel not in ROW_KERNELS and arch not in FMA_ARCHS
    smem, regs, stack, counts = _compiled(ASTSource(fn, signature, constexprs, attrs), arch, config, sass)  # fmt: skip
    cfg = "M{BLOCK_M} N{BLOCK_N}" if "BLOCK_M" in config.kwargs else "L{BLOCK_L}"
    cfg = cfg.format(**config.kwargs)
    cfg += f" w{config.num_warps} s{config.num_stages}"
    cfg += f" G{config.kwargs['GROUP']}" if "GROUP" in config.kwargs else ""
    return Row(arch, kernel, activation, shape, dtype, cfg, smem, regs, stack, *counts[:2], has_c, L, source, counts[2])  # fmt: skip


def _compiled(src, arch: int, config, sass: bool) -> tuple[int, int, int, tuple[int, int, int]]:
    """(shared memory, registers, spill bytes, (HMMA, HGMMA, LDGSTS)) of `src` compiled for
    sm_`arch` at `config` (the instruction counts -1 where `sass` is False)."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = _cuobjdump("--dump-resource-usage", cubin)
        code = _cuobjdump("-sass", cubin) if sass else ""
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    counts = tuple(len(re.findall(rf"\b{i}\b", code)) if sass else -1 for i in ("HMMA", "HGMMA", "LDGSTS"))  # fmt: skip
    return compiled.metadata.shared, regs, stack, counts


def _compile_ffn(arch: int, kernel: str, shape: str, dtype: str, config, L: int) -> Row:
    """An FFN kernel (FFN_KERNELS) at `config`, its arguments as the op passes them: a stride
    of 1 a constant, as Triton's runtime specializes it, and the other integers hinted where
    they are multiples of 16."""
    from triton.compiler import ASTSource

    jit = tuned_kernels()[kernel][0]
    fn = jit.fn
    d = SHAPES[shape][0]
    args = _ffn_args(kernel, d, dtype, L)
    constexprs = {**config.kwargs, "PREC": "ieee" if dtype == "fp32" else "tf32", "KEEP_H": True}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif args[name][1] == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            ty, val = args[name]
            signature[name] = ty
            if ty.startswith("*") or (isinstance(val, int) and val % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {name: v for name, v in constexprs.items() if name in fn.arg_names}
    smem, regs, stack, counts = _compiled(ASTSource(fn, signature, constexprs, attrs), arch, config, True)  # fmt: skip
    cfg = "M{BLOCK_M} N{BLOCK_N} K{BLOCK_K}".format(**config.kwargs)
    cfg += f" w{config.num_warps} s{config.num_stages}"
    return Row(arch, kernel, "-", shape, dtype, cfg, smem, regs, stack, *counts[:2], True, L, "-", counts[2])  # fmt: skip


def jobs(archs, kernels, sources, activations, has_cs, shapes, dtypes, lengths, first_config):
    """(arch, kernel, source, activation, HAS_C, shape, dtype, l, config) of every compile: each
    kernel's configurations for the arch family and score source that serve the shape
    (partition_mixing.usable), or the first of them."""
    from shatter.kernels.partition_mixing import block_k, usable

    tuned = tuned_kernels()
    for cap, kernel in itertools.product(archs, kernels):
        if kernel in ROW_KERNELS and cap not in FMA_ARCHS:  # each arch: what `auto` runs there
            continue
        if kernel in FFN_KERNELS:  # sm_80+ (ffn.ffn_choice); only the shape and dtype matter
            if cap in FMA_ARCHS:
                continue
            for shape, dtype in itertools.product(shapes, dtypes):
                family = 90 if cap >= 90 else 80
                for config in [c for c in tuned[kernel][1] if family in c.archs][: 1 if first_config else None]:  # fmt: skip
                    yield cap, kernel, "-", "-", True, shape, dtype, lengths[0], config
            continue
        if kernel == "delta":  # it reads neither the scores, the bias nor the activation
            sources_, activations_, has_cs_ = ["z"], activations[:1], has_cs[:1]
        else:  # the row kernels and the FMA archs read Z: no recomputing variant
            sources_ = ["z"] if kernel in ROW_KERNELS or cap in FMA_ARCHS else sources
            sources_ = [s for s in sources_ if s != "make" or kernel == "stats"]  # Z made: stats
            activations_, has_cs_ = activations, has_cs
        for source, act, has_c, shape, dtype, L in itertools.product(
            sources_, activations_, has_cs_, shapes, dtypes, lengths
        ):
            d, n = SHAPES[shape]
            if kernel in ROW_KERNELS:
                yield cap, kernel, source, act, has_c, shape, dtype, L, row_config(L)
                continue
            configs = usable(tuned[kernel][1], n, block_k(d, n), cap, SOURCES[source])
            for config in configs[:1] if first_config else configs:
                yield cap, kernel, source, act, has_c, shape, dtype, L, config


def _compile_job(job) -> Row | str:
    cap, kernel, source, act, has_c, shape, dtype, L, config = job
    try:
        return compile_one(cap, kernel, act, shape, dtype, config, has_c, L, source)
    except Exception as e:
        return str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def summary(rows: list[Row]) -> list[str]:
    """Per arch and kernel, over every variant and configuration: the ranges of the columns."""
    lines = [f"{'arch':>5} {'kernel':9} {'compiles':>8} {'regs':>9} {'spill':>5} {'smem':>13} "
             f"{'LDGSTS':>9} {'HMMA':>9} {'HGMMA':>9}"]  # fmt: skip
    groups: dict[tuple[int, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.arch, f"{r.kernel}/{r.source}"), []).append(r)

    def span(values):
        lo, hi = min(values), max(values)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    for (cap, kernel), rs in groups.items():
        low = [r for r in rs if r.dtype != "fp32"] or rs
        lines.append(
            f"sm_{cap:<2} {kernel:9} {len(rs):>8} {span([r.regs for r in rs]):>9} "
            f"{max(r.spill for r in rs):>5} {span([r.smem for r in rs]):>13} "
            f"{span([r.ldgsts for r in rs]):>9} {span([r.hmma for r in low]):>9} "
            f"{span([r.hgmma for r in low]):>9}"
        )
    return lines


@click.command()
@click.option("--arch", default="80,90", help="compute capabilities, comma-separated (70-90)")
@click.option("--kernel", "kernels", default=",".join(KERNELS), help="kernels to compile")
@click.option(
    "--source", "sources", default="z,qx,make",
    help="scores: z (read), qx (made on chip: fused), make (made and written as Z: triton's stats)",
)  # fmt: skip
@click.option("--activation", "activations", default="sigmoid,softmax", help="sigmoid, softmax")
@click.option("--has-c", "has_cs", default="true,false", help="the partition bias: true, false")
@click.option("--shape", "shapes", default="base,large", help="base (d=768, n=12), large")
@click.option("--dtype", "dtypes", default="bf16,fp16", help="bf16, fp16, fp32")
@click.option("--length", "lengths", default="512,509", help="sequence lengths (hints only)")
@click.option("--first-config", is_flag=True, help="only each kernel's first autotune config")
@click.option("--jobs", "n_jobs", default=os.cpu_count() or 1, help="compiles run in parallel")
def main(arch, kernels, sources, activations, has_cs, shapes, dtypes, lengths, first_config, n_jobs):  # fmt: skip
    """Compile the Triton kernels ahead of time and check their resources (see module doc)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_report: unset TRITON_INTERPRET: the interpreter compiles nothing")
    try:
        archs = [int(a) for a in _split(arch)]
        ls = [int(v) for v in _split(lengths)]
    except ValueError:
        raise SystemExit(
            f"kernel_report: --arch and --length take numbers like 80,90 and 512,509, got "
            f"{arch!r} and {lengths!r}"
        ) from None
    for name, values, known in (
        ("--arch", archs, SMEM_LIMIT),
        ("--kernel", _split(kernels), KERNELS),
        ("--source", _split(sources), SOURCES),
        ("--activation", _split(activations), ("sigmoid", "softmax")),
        ("--has-c", _split(has_cs), ("true", "false")),
        ("--shape", _split(shapes), SHAPES),
        ("--dtype", _split(dtypes), DTYPES),
    ):
        bad = [v for v in values if v not in known]
        if bad:
            raise SystemExit(f"kernel_report: {name} {bad} unknown; choose from {list(known)}")
    from shatter.kernels.row_mixing import MAX_ROW

    bad_len = [v for v in ls if not 16 < v <= MAX_ROW]
    if bad_len:
        raise SystemExit(
            f"kernel_report: --length {bad_len} outside 17..{MAX_ROW} (the longest row a row "
            "kernel holds; the mixing kernels tile any length)"
        )
    import triton

    print(f"triton {triton.__version__} (python {sys.version.split()[0]})")
    header = f"{'arch':>5} {'kernel':9} {'act':7} {'c':1} {'shape':5} {'dtype':5} {'l':>4} "
    header += f"{'config':21} {'smem':>7} {'regs':>4} {'spill':>5} {'LDGSTS':>6} {'HMMA':>5} "
    header += f"{'HGMMA':>5}  check"
    print(header)
    has = [v == "true" for v in _split(has_cs)]
    todo = list(jobs(archs, _split(kernels), _split(sources), _split(activations), has,
                     _split(shapes), _split(dtypes), ls, first_config))  # fmt: skip
    rows: list[Row] = []
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=n_jobs) as pool:
        for job, r in zip(todo, pool.map(_compile_job, todo)):
            if isinstance(r, str):  # a compile error: one line, then stop
                cap, kernel, source, act, has_c, shape, dtype, L, config = job
                what = f"sm_{cap} {kernel}/{source} {act} HAS_C={has_c} {shape} {dtype} l={L} {config}"  # fmt: skip
                pool.shutdown(cancel_futures=True)
                raise SystemExit(
                    f"kernel_report: {what} does not compile: {r} "
                    "(shatter/kernels/partition_mixing.py)"
                )
            bad = r.problems()
            failed += bool(bad)
            rows.append(r)
            print(
                f"sm_{r.arch:<2} {r.kernel + '/' + r.source:9} {r.activation:7} {'yn'[not r.has_c]} {r.shape:5} "
                f"{r.dtype:5} {r.length:>4} {r.config:21} {r.smem:>7} {r.regs:>4} {r.spill:>5} "
                f"{r.ldgsts:>6} {r.hmma:>5} {r.hgmma:>5}  " + ("; ".join(bad) or "ok"),
                flush=True,
            )
    print("\nsummary over the variants above (ranges; HMMA/HGMMA over bf16/fp16)")
    print("\n".join(summary(rows)))
    if failed:
        raise SystemExit(
            f"kernel_report: {failed} configuration(s) fail the checks above: drop them from the "
            "autotune lists in shatter/kernels/partition_mixing.py (the FFN's: gelu_linear.py)"
        )


if __name__ == "__main__":
    sys.exit(main())
