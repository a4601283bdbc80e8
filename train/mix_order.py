"""Inductor's mix-order reductions finished by one kernel a LayerNorm, not four.

torch.compile's inductor folds a LayerNorm backward's weight and bias gradients (sums down the
tokens) into the kernel that sums each token's row (a "mix-order reduction", on CUDA). That
kernel leaves each gradient as partial sums, one row per split of the tokens, side by side in one
fp32 workspace; the wrapper inductor generates finishes each gradient with a torch sum, and the
casts to the parameters' bf16 are kernels of their own after it:

    buf2 = workspace_0[0 * (128) * (768) : (0 + 1) * (128) * (768)].view(128, 768).sum(dim=0).view([768])
    buf3 = workspace_0[1 * (128) * (768) : (1 + 1) * (128) * (768)].view(128, 768).sum(dim=0).view([768])
    triton_poi_fused_native_layer_norm_backward_1.run(buf2, buf5, 768)    # buf5 = bf16(buf2)
    triton_poi_fused_native_layer_norm_backward_2.run(buf3, buf6, 768)    # buf6 = bf16(buf3)

four launches of a few KB each (25 LayerNorms a step at base size: 0.6 ms of an H100's step in
launches). `finish_in_one()` makes inductor write, for this process,

    workspace_0_cast = torch.ops.shatter.partial_sums.default(workspace_0[0 * (128) * (768) : (1 + 1) * (128) * (768)], 2, 128, 768, torch.bfloat16)
    buf5 = workspace_0_cast[0].view([768])
    buf6 = workspace_0_cast[1].view([768])

one kernel (shatter/kernels/partial_sums.py), the cast nodes taken out of the schedule and the
fp32 gradients, which nothing else reads, not made. Where something else reads them, or the
sums are not sums (amax) or the kernel cannot import, the rows are one torch reduction and the
casts one `.to` (`merged`). It wraps the scheduler's mix-order code generation, rewriting each
kernel's final lines; lines in another wording (another torch) are written as inductor wrote
them. The same fp32 sums of the same partial rows (a row's additions in another order), cast as
before.
"""

from __future__ import annotations

import functools
import re
import warnings

# the custom ops the rewritten lines call: inductor's wrapper runs them, the model never does
WRAPPER_CUSTOM_OPS = ("shatter::partial_sums",)
FINAL = re.compile(
    r"(?P<buf>\w+) = (?P<ws>\w+)\[(?P<start>[^\[\]]+?) : (?P<end>[^\[\]]+?)\]"
    r"\.view\((?P<n>[^,]+), (?P<r>.+?)\)\.(?P<op>sum|amin|amax)\(dim=0\)"
    r"(?P<view>\.view\(\[[^\]]*\]\))?(?P<to>\.to\([\w.]+\))?"
)


def merged(
    lines: list[str], casts: dict[str, tuple[str, str, str]] | None = None, unread: bool = False
) -> list[str]:
    """Inductor's final-reduction lines of one mix-order kernel (`FINAL`, in order), as one
    reduction over all of them and a row each (module doc); lines that are not such a run (one
    line, other workspaces, sizes, ops or casts, parts out of order) come back unchanged.
    `casts`: {gradient's buffer: (its cast's buffer, dtype, shape)}, casts (to one dtype) that
    scheduler nodes would run, made here: by one `.to` of the rows, or, `unread` (nothing reads
    the fp32 gradients but their casts) where every gradient is a sum with a cast, with the sums
    in one kernel (shatter::partial_sums), the fp32 gradients not made at all."""
    found = [FINAL.fullmatch(line) for line in lines]
    if len(lines) < 2 or not all(found):
        return list(lines)
    first, last = found[0], found[-1]
    same = ("ws", "n", "r", "op", "to")
    parts = [m["start"].split(" * ")[0].strip("()") for m in found]
    if any(m.group(*same) != first.group(*same) for m in found) or parts != [
        str(int(parts[0]) + i) for i in range(len(found))
    ]:
        return list(lines)
    casts = casts or {}
    span, shape = f"{first['ws']}[{first['start']} : {last['end']}]", f"{first['n']}, {first['r']}"
    rows, cast = f"{first['ws']}_sums", f"{first['ws']}_cast"
    cast_rows = [
        f"{casts[m['buf']][0]} = {cast}[{i}].view({casts[m['buf']][2]})"
        for i, m in enumerate(found)
        if m["buf"] in casts
    ]
    dtype = next(iter(casts.values()))[1] if casts else None
    if unread and first["op"] == "sum" and not first["to"] and len(cast_rows) == len(found):
        return [
            f"{cast} = torch.ops.shatter.partial_sums.default({span}, {len(found)}, {shape}, {dtype})",  # noqa: E501
            *cast_rows,
            f"del {cast}",
        ]
    out = [f"{rows} = {span}.view({len(found)}, {shape}).{first['op']}(dim=1){first['to'] or ''}"]
    out += [f"{m['buf']} = {rows}[{i}]{m['view'] or ''}" for i, m in enumerate(found)]
    if cast_rows:
        out += [f"{cast} = {rows}.to({dtype})", *cast_rows, f"del {cast}"]
    return out + [f"del {rows}"]


CONVERTS = ("prims.convert_element_type.default", "aten._to_copy.default")


def cast_of(node, buf: str) -> tuple[str, str, str] | None:
    """(output buffer, dtype, shape) of a scheduler `node` that only casts the buffer `buf` to
    another dtype, contiguous (a LayerNorm's gradient made bf16 from the fp32 sums), else None."""
    from torch._inductor.scheduler import SchedulerNode

    if type(node) is not SchedulerNode or node.is_reduction() or len(node.get_outputs()) != 1:
        return None
    if {dep.name for dep in node.read_writes.reads} != {buf}:
        return None
    origins = node.node.get_origins() if node.node is not None else ()
    if not origins or any(str(o.target) not in CONVERTS for o in origins):
        return None
    out = node.get_outputs()[0].node
    layout = out.get_layout()
    try:
        size = [int(s) for s in layout.size]
    except TypeError:  # a symbolic size: left to inductor
        return None
    if not layout.is_contiguous() or layout.offset != 0:
        return None
    return out.get_name(), str(layout.dtype), str(size)


def _casts(scheduler, node2, bufs: list[str]) -> dict:
    """{buffer: (scheduler node, `cast_of` it)} for each of a mix-order kernel's gradient
    buffers that one node casts, all to the first one's dtype: a node of the kernel's epilogue,
    a top-level node, or the nodes of a top-level fusion that are all such casts or already
    taken out (inductor fuses a LayerNorm's two casts side by side where they are adjacent, or
    a cast with the last step of a split reduction that the mix-order kernel made)."""
    groups = [(n, None) for n in node2.get_nodes() if not n.is_reduction()]
    for top in scheduler.nodes:
        if type(top).__name__ == "SchedulerNode":
            groups.append((top, None))
        elif type(top).__name__ == "FusedSchedulerNode":
            groups += [(n, top) for n in top.get_nodes()]
    found, matched = {}, set()
    for buf in bufs:
        hits = [(n, top, cast) for n, top in groups if (cast := cast_of(n, buf))]
        if len(hits) == 1:
            found[buf] = hits[0]
            matched.add(hits[0][0])
    gone = scheduler.removed_ops  # e.g. a split reduction's last step, which the kernel made

    def whole(top) -> bool:
        return top is None or all(n in matched or n.get_name() in gone for n in top.get_nodes())

    found = {buf: (n, cast) for buf, (n, top, cast) in found.items() if whole(top)}
    dtypes = [cast[1] for _, cast in found.values()]
    return {buf: hit for buf, hit in found.items() if hit[1][1] == dtypes[0]}


def finished_or_as_is(scheduler, node2, held: list[str]) -> list[str]:
    """`_finished`'s lines, or inductor's own (`held`) where this torch's scheduler is not as
    `_finished` reads it: launches more, never a wrong gradient (and a warning)."""
    try:
        return _finished(scheduler, node2, held)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        warnings.warn(
            f"train/mix_order.py: inductor's mix-order lines kept as written, this torch's "
            f"scheduler differs ({type(e).__name__}: {e})",
            stacklevel=2,
        )
        return list(held)


def _finished(scheduler, node2, held: list[str]) -> list[str]:
    """`merged`'s lines for a kernel's final lines `held`, the casts it makes taken out of the
    schedule (their nodes no longer run, their buffers are made here) and the fp32 gradients
    it does not make out of the graph's buffers (the schedule changed only once all is read)."""
    from torch._inductor.virtualized import V

    bufs = [FINAL.fullmatch(line)["buf"] for line in held]
    casts = _casts(scheduler, node2, bufs)
    unread = _kernel_runs() and all(
        buf in casts and _read_by(scheduler, buf) == {casts[buf][0].get_name()} for buf in bufs
    )
    lines = merged(held, {buf: cast for buf, (_, cast) in casts.items()}, unread)
    if lines == held:
        return lines
    for node, (name, _, _) in casts.values():
        scheduler.removed_ops.add(node.get_name())
        V.graph.wrapper_code.allocated.add(name)
    made = {line.split(" = ")[0] for line in lines}
    V.graph.removed_buffers |= {buf for buf in bufs if buf not in made}
    return lines


def _read_by(scheduler, buf: str) -> set[str]:
    """The names of the scheduler nodes that read `buf` (the graph's output among them)."""
    return {user.get_name() for user in scheduler.name_to_buf[buf].users}


def _kernel_runs() -> bool:
    """Whether shatter::partial_sums is registered here (it imports triton)."""
    try:
        import shatter.kernels.partial_sums  # noqa: F401
    except ImportError:
        return False
    return True


def finish_in_one() -> bool:
    """Install `merged` into inductor's mix-order code generation for this process (once);
    False where this torch has none (nothing to finish)."""
    try:
        from torch._inductor.codegen.simd import SIMDScheduling
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    codegen = getattr(SIMDScheduling, "_codegen_mix_order_reduction", None)
    if codegen is None:
        return False
    if getattr(codegen, "finishes_in_one", False):
        return True

    @functools.wraps(codegen)
    def gathered(self, node1, node2):
        wrapper = V.graph.wrapper_code
        write, held = wrapper.writeline, []

        def flush():
            if held:
                for line in finished_or_as_is(self.scheduler, node2, held):
                    write(line)
            held.clear()

        def writeline(line, *args, **kwargs):
            if isinstance(line, str) and not args and not kwargs and FINAL.fullmatch(line):
                held.append(line)
                return
            flush()
            write(line, *args, **kwargs)

        wrapper.writeline = writeline  # an instance attribute: the class's method is untouched
        try:
            return codegen(self, node1, node2)
        finally:
            del wrapper.writeline
            flush()

    gathered.finishes_in_one = True
    SIMDScheduling._codegen_mix_order_reduction = gathered
    _keyed()
    return True


def _keyed() -> None:
    """Inductor's FX graph cache keys a compiled graph on its config and custom passes, not on
    this module: a graph cached by a process without `finish_in_one` would come back unfinished,
    and one with it (which calls shatter::partial_sums) could come back to a process that never
    registered that op. A post-grad pass that does nothing, whose uuid is this file's hash, puts
    it in the key (where no other post-grad pass is set)."""
    import torch._inductor.config as config
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class Keyed(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self):
            return get_hash_for_files((__file__,))

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = Keyed()
