"""The ops of one training step of a model, traced on meta tensors: what
tools/bench/step_cost.py prices.

`trace_step(model, ...)` runs one step of a masked-LM model built by `shatter.build_model` (this
checkout's, or an older commit's: the module imports no project module at load time, and
`shatter` itself only in `main`, so tools/bench/step_cost.py runs it by path under another
checkout's PYTHONPATH) on meta tensors, which have shapes, dtypes and strides but no values, so a
base-size step traces in seconds on a CPU:

    forward    model(input_ids, attention_mask, labels, predicted=...)["loss"]: the
               predicted positions as the trainer's loader counts them on the host (a
               `predicted` share of the tokens); a model without the argument finds them
               itself, with a boolean index (below)
    backward   loss.backward()
    optimizer  `fused`: torch's fused AdamW over the fp32 parameters (the model fp32 under
               bf16 autocast); `zero1`: DeepSpeed's ZeRO-1 step on one of `world` ranks (the
               model in bf16 or fp16; each gradient copied into the flat bucket, whole, as its
               hook fires; then, on the rank's 1/world partition only: its gradients copied
               into the partition's buffer, and per parameter group flattened and cast to fp32,
               their norm, the unscale, AdamW on the fp32 master, the master cast back to the
               low-precision parameters; DeepSpeed's one-element bookkeeping: `zero1_step`);
               `master`: the same ZeRO-1 step with `shatter::master_adamw_` reading the
               gradients where they lie in place of the flatten, AdamW and cast back.
               The collectives between (the gradients' reduce-scatter, the parameters'
               all-gather) are communication: not traced, not priced.

A TorchDispatchMode records every ATen op (and every custom op) with its executed FLOPs and the
HBM bytes it reads and writes (a tensor's bytes over its dimensions of non-zero stride, so a
broadcast operand counts once; an output that aliases an input is a view: no kernel, no bytes),
in order, and whether it runs outside torch.compile's graphs. What a GPU would do differently from the meta
device is emulated above the dispatcher, in a TorchFunctionMode:

- CUDA autocast (torch's documented op lists: GEMMs and SDPA in the low precision; softmax, sums,
  norms, layer_norm, losses in fp32; cat and friends to the widest), weight casts cached per
  forward as torch caches them;
- SDPA's backend choice on CUDA: the flash kernel when there is no mask and the GPU is sm_80+,
  else the memory-efficient kernel (a bool mask becomes a float bias first);
- the boolean index of the MLM head of an older model, which finds its predicted positions itself:
  a `predicted` share of the tokens, as the data's masking would give.

Custom ops named `shatter::...` are priced per kernel from `shatter.kernels.cost.OP_COSTS` when
this checkout has it: a row of kind "custom" carries the op's kernels, (name, kind, FLOPs,
bytes) each, one launch each, and its model FLOPs from `model_flops`; ops it lacks count their
tensors' bytes, one launch.

`records(rec)` is the step as eager PyTorch runs it, one kernel per op; `records(rec, plan)` as
inductor runs the compiled model, from `plan`, inductor's own kernels for the step
(tools/bench/inductor_plan.py): in the forward and the backward, the GEMMs, SDPA and the custom
ops stay as traced (inductor calls them as extern kernels), the ops that run outside the
compiled graphs stay as traced (`eager` events: the profiler range shatter.eager.EAGER, and an
older model's boolean index at the MLM head, where Dynamo breaks the graph, and its backward),
and every other op is replaced by the plan's Triton kernels; the optimizer stays eager.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}
SDPA = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_backward": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_efficient_attention_backward": "efficient",
}
# shatter.eager.EAGER, read by value: this module imports no project module
EAGER = "shatter::eager"
# the optimizer steps `trace_step` traces: torch's fused AdamW under autocast; ZeRO-1 stepping
# torch's fused AdamW (optim.impl torch); ZeRO-1 with the one-pass step (master)
OPTIMIZERS = ("fused", "zero1", "master")
PROFILER_RANGES = ("_record_function_enter_new", "_record_function_exit")
INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
# Ops that launch no kernel: allocation without a fill, metadata
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "alias", "lift_fresh", "_unsafe_view", "_local_scalar_dense", "sym_size", "sym_stride", "is_same_size",
             "_to_copy_noop"}  # fmt: skip

# Fills whose tensor argument gives only the dtype, device or shape: nothing of it is read
TEMPLATE_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}

# CUDA autocast's op lists (torch.amp's "Autocast Op Reference"), by the Python function's name
LOW = {"__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
       "chain_matmul", "multi_dot", "linear", "matmul", "mm", "mv", "einsum",
       "scaled_dot_product_attention"}  # fmt: skip
FP32 = {"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "cosh", "cdist",
        "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp",
        "expm1", "group_norm", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax", "log10",
        "log1p", "log2", "mse_loss", "nll_loss", "norm", "normalize", "pdist", "pow", "prod",
        "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "softmax", "softmin", "softplus", "sum",
        "renorm", "tan", "vector_norm", "binary_cross_entropy_with_logits"}  # fmt: skip
PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "scatter_add",
           "tensordot", "cat", "stack", "index_copy"}  # fmt: skip


def tensor_bytes(t: torch.Tensor) -> int:
    """HBM bytes of one pass over `t`: its element size times its sizes over dimensions of
    non-zero stride (an expanded operand is read once)."""
    span = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.dim() else 1
    return t.element_size() * span


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


# In-place ops that only write their `self` (its old values are not read)
OVERWRITES = {"copy_", "_foreach_copy_", "zero_", "fill_", "_foreach_zero_"}


def _read(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op reads: its tensor arguments but an `out=` buffer, and the `self` of an
    op that only overwrites it (OVERWRITES)."""
    values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    only_written = {"out"} | ({"self"} if func.overloadpacket.__name__ in OVERWRITES else set())
    return _tensors([v for k, v in values.items() if k not in only_written])


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an in-place or out= op writes (its mutable arguments)."""
    out = []
    values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    unscaled = values.get("grad_scale") is not None  # a fused Adam writes its grads only then
    for arg in func._schema.arguments:
        if arg.name == "grads" and not unscaled:
            continue
        if arg.alias_info is not None and arg.alias_info.is_write and arg.name in values:
            out += _tensors(values[arg.name])
    return out


# CUDA's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): a launch takes at most
# MTA_TENSORS[depth - 1] tensors of `depth` lists and MTA_BLOCKS chunks of MTA_CHUNK elements
MTA_TENSORS, MTA_BLOCKS, MTA_CHUNK = (110, 64, 48, 36, 30), 320, 65536


def multi_tensor_launches(name: str, args) -> int:
    """Kernels a `_foreach_` or `_fused_` op launches: launches full at the tensors or the chunks
    its depth allows (a fused Adam: params, grads and two moments, a third with amsgrad), plus
    the norm's cleanup kernel."""
    lists = [a for a in args if isinstance(a, list | tuple) and a and _tensors(a)]
    first = _tensors(lists[0])
    if name.startswith("_fused_adam"):
        depth = 4 + bool(len(lists) > 5 and len(lists[4]) == len(first))
    else:
        depth = sum(len(_tensors(a)) == len(first) for a in lists)
    chunks = sum(math.ceil(t.numel() / MTA_CHUNK) for t in first)
    full = max(len(first) / MTA_TENSORS[min(depth, 5) - 1], chunks / MTA_BLOCKS)
    return max(1, math.ceil(full)) + (name == "_foreach_norm")


def _custom_costs(family: int | None = None):
    """(OP_COSTS, model_flops) of this checkout's `shatter::` custom ops; with `family`, each cost
    that takes one is for that arch family's kernel configurations (an older checkout's as it
    is)."""
    try:
        from shatter.kernels import cost
    except ImportError:
        return {}, None
    costs = dict(cost.OP_COSTS)
    if family is not None:
        for name, fn in costs.items():
            if "family" in inspect.signature(fn).parameters:
                costs[name] = functools.partial(fn, family=family)
    return costs, getattr(cost, "model_flops", None)


def _kernels(cost) -> tuple[tuple[str, str, float, float], ...]:
    """An OP_COSTS entry's answer as (name, kind, FLOPs, bytes) per kernel; an older checkout's
    (FLOPs, bytes) for the whole op is one custom kernel."""
    if len(cost) == 2 and not isinstance(cost[0], tuple):
        return (("op", "custom", float(cost[0]), float(cost[1])),)
    return tuple((str(k[0]), str(k[1]), float(k[2]), float(k[3])) for k in cost)


class StepTrace(TorchDispatchMode):
    """Records, in order, each kernel-launching op: its row key (op, phase, kind, executed FLOPs,
    model FLOPs, bytes, launches, kernels) and whether it runs eagerly in a compiled step (module
    doc); `phase` is set by the caller (forward, backward, optimizer)."""

    def __init__(self, predicted: float, family: int | None = None):
        super().__init__()
        self.predicted = predicted
        self.phase = "forward"
        self.events: list[tuple] = []  # (key, eager)
        self.regions: list[bool] = []  # the open profiler ranges: each EAGER or not
        self.bool_indexed = 0  # bool indexes of the forward whose backward is still to come
        self.custom, self.custom_model_flops = _custom_costs(family)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":  # a host read (an old commit's mask check): no values
            return {torch.bool: True}.get(args[0].dtype, 1)
        if name in PROFILER_RANGES:  # a profiler range opens or closes: no kernel
            self._range(name, args)
            return func(*args, **kwargs)
        eager = any(self.regions)
        if name in INDEX_OPS:
            args, by_bool = self._bool_index(args)
            self.bool_indexed += by_bool and self.phase == "forward"
            backward = self.phase == "backward" and name != "index" and self.bool_indexed > 0
            self.bool_indexed -= backward  # each bool index's backward: one index_put
            eager = eager or by_bool or backward
        out = func(*args, **kwargs)
        if name not in NO_KERNEL and not _is_view(func):
            self.record(func, name, args, kwargs, out, eager)
        return out

    def _range(self, name: str, args) -> None:
        """A profiler range: EAGER's ops run outside torch.compile's graphs (shatter.eager)."""
        if name == "_record_function_enter_new":
            self.regions.append(args[0] == EAGER)
        elif self.regions:
            self.regions.pop()

    def _bool_index(self, args) -> tuple[tuple, bool]:
        """A bool index of the MLM head's predicted positions -> `predicted` of its elements as
        one long index per dimension (meta tensors have no values to count), and whether it was
        one (its output's shape depends on values: Dynamo breaks the graph there)."""
        indices = args[1]
        if not any(i is not None and i.dtype == torch.bool for i in indices):
            return args, False
        new = []
        for i in indices:
            if i is not None and i.dtype == torch.bool:
                m = max(1, round(self.predicted * i.numel()))
                new += [torch.empty(m, dtype=torch.long, device=i.device)] * i.dim()
            else:
                new.append(i)
        return (args[0], new, *args[2:]), True

    def record(self, func, name, args, kwargs, out, eager: bool = False):
        read_t = [] if name in TEMPLATE_ONLY else _read(func, args, kwargs)
        write_t = _written(func, args, kwargs) or _tensors(out)
        nbytes = sum(tensor_bytes(t) for t in (*read_t, *write_t))
        flops = model_flops = 0.0
        kind, kernels, launches = "memory", (), 1
        qualified = str(func.overloadpacket._qualified_op_name)
        if qualified in self.custom:
            kernels = _kernels(self.custom[qualified](args, kwargs, out))
            kind, launches = "custom", len(kernels)
            flops, nbytes = sum(k[2] for k in kernels), sum(k[3] for k in kernels)
            model_flops = flops
            if self.custom_model_flops is not None:  # the dense count train/cost.py makes
                model_flops = self.custom_model_flops(qualified, args, kwargs)
        elif func.overloadpacket in flop_registry and (name in GEMMS or name in SDPA):
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            kind = "gemm" if name in GEMMS else SDPA[name]
            # the SDPA backward recomputes Q K^T: 5 products where the model count has 4
            model_flops = flops * 0.8 if name.endswith("_backward") else flops
        if name.startswith(("_foreach_", "_fused_")):
            launches = multi_tensor_launches(name, args)
        key = (qualified, self.phase, kind, flops, model_flops, nbytes, launches, kernels)
        if (
            eager
            and name in INDEX_OPS
            and self.events
            and self.events[-1][0][0] == "aten::new_zeros"
        ):
            self.events[-1] = (self.events[-1][0], True)  # the index's backward's zeros
        self.events.append((key, eager))


class GpuEmulation(TorchFunctionMode):
    """CUDA autocast and SDPA's backend choice on meta tensors (see the module doc)."""

    def __init__(self, autocast_dtype: torch.dtype | None, flash: bool, low: torch.dtype):
        super().__init__()
        self.dtype, self.flash, self.low = autocast_dtype, flash, low
        self.cache: dict[int, torch.Tensor] = {}

    def _cast(self, t, dtype):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.dtype == dtype:
            return t
        if t.is_leaf and t.requires_grad:  # torch caches a weight's cast within the region
            if id(t) not in self.cache:
                self.cache[id(t)] = t.to(dtype)
            return self.cache[id(t)]
        return t.to(dtype)

    def _autocast(self, name, args, kwargs):
        if self.dtype is None:
            return args, kwargs
        if name in LOW:
            to = self.dtype
        elif name in FP32:
            to = torch.float32
        elif name in PROMOTE:
            floats = [t.dtype for t in _tensors((args, kwargs)) if t.is_floating_point()]
            to = torch.float32 if torch.float32 in floats else self.dtype
        else:
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [self._cast(t, to) for t in leaves]
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        args, kwargs = self._autocast(name, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if func is F.dropout:  # CUDA's one fused kernel (the CPU's composite is three)
            return self.dropout(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def dropout(x, p=0.5, training=True, inplace=False):
        return aten.native_dropout(x, p, True)[0] if training and p > 0 else x

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        return gpu_sdpa(self.flash, q, k, v, attn_mask, dropout_p, is_causal, scale)


def gpu_sdpa(flash, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """SDPA on the kernel CUDA's SDPA picks: flash without a mask (`flash`: sm_80+, and half
    precision), else the memory-efficient kernel with the mask as an additive float bias."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if attn_mask is None and flash and half:
        return aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False, scale=scale
        )[0]
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~bias, float("-inf")
        )
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    need_lse = q.requires_grad or k.requires_grad or v.requires_grad
    return aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, need_lse, dropout_p, is_causal, scale=scale
    )[0]


class MetaAutocast:
    """`torch.autocast` while tracing: a region on the meta device switches the emulated autocast
    (`enabled=False`: a kernel that computes in fp32 on purpose); others are torch's own."""

    real = torch.autocast

    def __init__(self, emulation: GpuEmulation):
        self.emulation = emulation

    def __call__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type != "meta":
            return self.real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return self._region(dtype, enabled)

    @contextlib.contextmanager
    def _region(self, dtype, enabled):
        saved = self.emulation.dtype
        self.emulation.dtype = (dtype or self.emulation.low) if enabled else None
        try:
            yield
        finally:
            self.emulation.dtype = saved


# The one-element kernels of DeepSpeed 0.19.8's bf16 ZeRO-1 step as the trainer runs it with
# torch's fused AdamW (`optim.impl: torch`), at any model size, after the squares' `dot` (the
# global norm's root and validity, the clip's factor, the skip's verdict made on the device),
# counted on a real engine: tools/bench/count_ops.py (tests/tools/test_step_cost.py checks the
# step's count); AdamW's step counters besides
DEEPSPEED_SCALAR_OPS = 15


def zero1_step(params: list[torch.Tensor], world: int = 1, one_pass: bool = False) -> None:
    """DeepSpeed's ZeRO-1 optimizer step on one of `world` ranks as the trainer runs it
    (train/engine.py: `streamline_zero`), over the buffers it keeps (`_zero1_gradients`):
    the global norm's sum of squares by one multi-tensor norm over both parameter groups (the
    weights; the biases and norms, the 1-D parameters) and a `dot` of the norms (on CUDA one
    buffer: `joined`); then with torch's fused AdamW (`optim.impl: torch`) DEEPSPEED_SCALAR_OPS
    one-element kernels (the root, the skip's verdict, the clip factor), and per group the
    gradients copied into one flat fp32 buffer by a multi-tensor copy that casts them
    (`flatten_into_fp32`), AdamW on the fp32 master with the unscale and clip as its
    `grad_scale` (the kernel writes the unscaled gradient back) and the skip's verdict as its
    `found_inf` between its step counters' two multi-tensor ops, and the master cast back into
    the low-precision parameters; or with `one_pass` (`optim.impl: master`,
    train/master_step.py) those scalars and the step counts in one kernel
    (`shatter::norm_verdict`), then per group `shatter::master_adamw_` on the gradients where
    they lie. The reduce-scatter or all-reduce of the gradients and the all-gather of the
    updated parameters are communication, left out."""
    dev, low = params[0].device, params[0].dtype
    held = _zero1_gradients(params, world)
    scalar = torch.empty((), device=dev)
    norms = torch._foreach_norm([g for group in held for g in group], 2, dtype=torch.float32)
    joined = torch.empty(len(norms), device=dev)  # the norms' own buffer on CUDA
    squares = torch.dot(joined, joined)
    steps = [torch.empty((), device=dev) for group in held if group]
    if one_pass:
        from shatter.kernels.norm_verdict import norm_verdict

        _, scalar, factor = norm_verdict(squares, scalar, steps, 1.0, False)
    else:
        for _ in range(DEEPSPEED_SCALAR_OPS):
            scalar.add_(1.0)
    for group, step in zip([g for g in held if g], steps, strict=True):
        numel = sum(g.numel() for g in group)
        master, m, v = (torch.empty(numel, device=dev) for _ in range(3))
        weight = torch.empty(numel, dtype=low, device=dev)  # the low-precision partition
        if one_pass:
            _one_pass(group, master, m, v, step, weight, factor, scalar)
            continue
        grad = torch.empty(numel, device=dev)  # cast as it is flattened
        torch._foreach_copy_(list(grad.split([g.numel() for g in group])), group)
        torch._foreach_add_([step], 1)
        adamw([master], [grad], [m], [v], [step], grad_scale=scalar, found_inf=scalar)
        torch._foreach_sub_([step], [scalar])
        weight.copy_(master)  # into the parameters


def _one_pass(group, master, m, v, step, weight, factor, bad) -> None:
    """train/master_step.py's step of one group: the one-pass AdamW on its gradients, its step
    count made by norm_verdict."""
    from shatter.kernels.master_adamw import master_adamw_

    master_adamw_(
        group, master, m, v, step, weight, 1e-4, 0.9, 0.999, 1e-8, 0.01, grad_scale=factor,
        found_inf=bad, step_counted=True,
    )  # fmt: skip


def _zero1_gradients(params: list[torch.Tensor], world: int) -> tuple[list, list]:
    """The gradients of the rank's partition by group (weights, 1-D), as DeepSpeed moves them
    (train/engine.py: contiguous_gradients, skip_one_rank_reduction). On one rank none: they
    stay where autograd put them. On more: every gradient copied into the flat bucket as its
    hook fires (whole), then the rank's 1/world partition (rounded up) copied again, into the
    partition's gradient buffer."""
    from shatter.train.engine import contiguous_gradients

    held: tuple[list, list] = ([], [])
    if not contiguous_gradients(1, world):
        for p in params:
            held[p.dim() < 2].append(p.grad.reshape(-1))
        return held
    numel = sum(p.numel() for p in params)
    part = -(-numel // world)
    bucket = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
    grads = torch.empty(part, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        bucket[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        offset += p.numel()
    offset = 0
    for p in params:  # after the reduce-scatter: the partition's, into its gradient buffer
        n = min(p.numel(), part - offset)
        if n > 0:
            grads[offset : offset + n].copy_(bucket[offset : offset + n])
            held[p.dim() < 2].append(grads[offset : offset + n])
        offset += p.numel()
    return held


def adamw(params, grads, m, v, steps, grad_scale=None, found_inf=None) -> None:
    torch._fused_adamw_(
        params, grads, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
        eps=1e-8, amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip


def fused_step(params: list[torch.Tensor]) -> None:
    """torch.optim.AdamW(fused=True).step() on fp32 parameters: one fused kernel over the list."""
    m = [torch.empty_like(p) for p in params]
    v = [torch.empty_like(p) for p in params]
    steps = [torch.empty((), device=p.device) for p in params]
    adamw(params, [p.grad for p in params], m, v, steps)


def trace_step(
    model,
    length: int,
    rows: int,
    optimizer: str,
    low: torch.dtype = torch.bfloat16,
    flash: bool = True,
    padding_mask: bool = False,
    predicted: float = 0.15,
    world: int = 1,
    family: int | None = None,
) -> StepTrace:
    """One training step of `model` (on the meta device) at `rows` x `length` tokens; the model
    fp32 under autocast with `optimizer="fused"`, or already in `low` with `"zero1"` (ZeRO-1
    stepping torch's fused AdamW) or `"master"` (ZeRO-1 with the one-pass step).
    `padding_mask`: pass an all-ones attention mask (as a padded batch would) instead of None;
    `world`: the ranks ZeRO-1 partitions the optimizer over; `family`: the arch family (90, 80,
    70) whose kernel configurations the custom ops' costs take (their own default without)."""
    dev = torch.device("meta")
    ids = torch.empty(rows, length, dtype=torch.long, device=dev)
    mask = torch.empty(rows, length, dtype=torch.long, device=dev) if padding_mask else None
    labels = torch.empty(rows, length, dtype=torch.long, device=dev)
    count = max(1, round(predicted * rows * length))  # the positions the loader counts
    given = {"predicted": torch.empty(count, dtype=torch.long, device=dev)}
    given = given if "predicted" in inspect.signature(model.forward).parameters else {}
    params = [p for p in model.parameters() if p.requires_grad]
    rec = StepTrace(predicted, family)
    emulate = GpuEmulation(low if optimizer == "fused" else None, flash, low)
    model.train()
    with emulate, rec, _patched_autocast(MetaAutocast(emulate)):
        loss = model(ids, mask, labels, **given)["loss"]
        rec.phase = "backward"
        loss.backward()
        rec.phase = "optimizer"
        if optimizer == "fused":
            fused_step(params)
        else:
            zero1_step(params, world, one_pass=optimizer == "master")
    for p in params:
        p.grad = None
    return rec


@contextlib.contextmanager
def _patched_autocast(autocast):
    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = MetaAutocast.real


ROW_KEYS = ("op", "phase", "kind", "flops", "model_flops", "bytes", "launches", "kernels")


def records(rec: StepTrace, plan: list[dict] | None = None) -> list[dict]:
    """The trace as JSON-able rows: one per distinct (op, phase, kind, FLOPs, bytes), counted;
    with `plan` (inductor_plan.plan_step's kernels for this step), the step compiled
    (`compiled_keys`)."""
    keys = [e[0] for e in rec.events] if plan is None else compiled_keys(rec.events, plan)
    rows = []
    for k, c in Counter(keys).items():
        row = dict(zip(ROW_KEYS, k), count=c)
        row["kernels"] = [list(kernel) for kernel in row["kernels"]]
        rows.append(row)
    return rows


def compiled_keys(events: list[tuple], plan: list[dict]) -> list[tuple]:
    """The row keys of the step as inductor runs it: the optimizer's events, the forward's and
    backward's extern kernels (every kind but "memory": GEMMs, SDPA, custom ops) and eager
    events, then each kernel of inductor's `plan`, one launch each."""
    keys = [key for key, eager in events if key[1] == "optimizer" or key[2] != "memory" or eager]
    for k in plan:
        key = (f"inductor::{k['name']}", k["phase"], "memory", 0.0, 0.0, float(k["bytes"]), 1, ())
        keys += [key] * k["launches"]
    return keys


def build_meta(
    build_model, arch: str, size: str, vocab: int, max_len: int, dtype, impl=None, ffn_impl=None
):
    """`build_model(f"{arch}-{size}", ...)` on the CPU, moved to the meta device in `dtype`, in
    the state of a run's steps after its first: a partition table that the cast left in `dtype`
    (a checkout whose cast does not remake it) is made again in fp32 by the first forward and
    kept (partition.PartitionBuffer), so that one-time copy is made here, not traced as every
    step's. `impl`, `ffn_impl`: the model config's attention_impl and ffn_impl (a GPU's
    choice: on meta tensors `auto` takes the CPU's)."""
    overrides = dict(vocab_size=vocab, max_len=max_len)
    if impl:
        overrides["attention_impl"] = impl
    if ffn_impl:
        overrides["ffn_impl"] = ffn_impl
    model = build_model(f"{arch}-{size}", **overrides).to(device="meta", dtype=dtype)
    for module in model.modules():
        if hasattr(module, "exact_partition"):
            module.exact_partition()
    return model


def main() -> None:
    """Worker mode for another checkout: trace its `shatter.build_model` and print JSON rows."""
    import argparse
    import json

    import shatter

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--arch", required=True)
    p.add_argument("--size", default="base")
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--lengths", required=True, help="comma-separated")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="fused")
    p.add_argument("--padding-mask", action="store_true")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    model = build_meta(shatter.build_model, a.arch, a.size, a.vocab, max(lengths), torch.float32)
    out = {}
    for L in lengths:
        rec = trace_step(model, L, a.tokens // L, a.optimizer, padding_mask=a.padding_mask)
        out[L] = records(rec)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
