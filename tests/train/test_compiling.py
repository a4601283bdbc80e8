"""run.compile: `auto` (unset) compiles on a CUDA GPU where inductor can run and stays eager on a
CPU; an explicit true/false wins. The compiled model equals the eager one: values and gradients of
bert (fused QKV) and shatter (the folded W^O, the batched weight products) through Dynamo and
AOTAutograd (the aot_eager backend: inductor's CPU build takes minutes on two cores; the GPU
lane and the Triton path's test in tests/shatter/test_kernel_ops.py run inductor)."""

import pytest
import torch

import shatter
from shatter.train import compiling
from shatter.train.config import ConfigError, RunArgs


def test_compile_defaults_to_auto():
    assert RunArgs().compile is None


@pytest.mark.parametrize(
    ("setting", "device", "problem", "want"),
    [
        (None, "cpu", None, False),
        (None, "cuda", None, True),
        (None, "cuda", "no triton", False),
        (True, "cpu", None, True),
        (False, "cuda", None, False),
    ],
)
def test_auto_is_on_for_cuda_only(monkeypatch, setting, device, problem, want):
    monkeypatch.setattr(compiling, "compile_problem", lambda _: problem)
    assert compiling.wants_compile(setting, device) is want


def test_zero3_runs_eager_and_refuses_a_compile_in_one_line(monkeypatch):
    """torch.compile traced ZeRO-3's partitioned parameters as 1-D placeholders and failed at the
    first step on an H200 ("b must be 2D"): auto is off there, and `true` is refused."""
    monkeypatch.setattr(compiling, "compile_problem", lambda _: None)
    assert compiling.wants_compile(None, "cuda", zero_stage=3) is False
    assert compiling.wants_compile(None, "cuda", zero_stage=2) is True
    with pytest.raises(ConfigError, match="run.compile: true cannot run under ZeRO-3"):
        compiling.wants_compile(True, "cuda", zero_stage=3)


@pytest.mark.parametrize("arch", ["bert", "shatter"])
def test_compiled_model_equals_eager(arch):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=50, max_len=32, dropout=0.0, attention_dropout=0.0)
    eager = shatter.build_model(f"{arch}-tiny", **kwargs)
    compiled = shatter.build_model(f"{arch}-tiny", **kwargs)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="aot_eager", fullgraph=False)
    x = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, 12:] = 0
    labels = torch.where(x % 3 == 0, x, -100)
    outs = []
    for model in (compiled, eager):
        out = model(x, mask, labels)
        out["loss"].backward()
        outs.append((out["logits"], [p.grad for p in model.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_validation_compiles_nothing():
    """Validation of a compiled model (eval mode, no grad, a last shorter batch) compiles no new
    graph, and the training step after it reuses the training step's graphs; its figures are
    the eager model's."""
    from torch._dynamo.testing import CompileCounter

    from shatter.train.evaluate import evaluate

    torch.manual_seed(0)
    kwargs = dict(vocab_size=50, max_len=32, layers=1)
    eager = shatter.build_model("bert-tiny", **kwargs)
    compiled = shatter.build_model("bert-tiny", **kwargs)
    compiled.load_state_dict(eager.state_dict())
    counter = CompileCounter()
    compiled.compile(backend=counter)
    g = torch.Generator().manual_seed(1)

    def batch(rows: int) -> dict:
        x = torch.randint(5, 50, (rows, 16), generator=g)
        labels = torch.full_like(x, -100)
        labels[:, ::3] = x[:, ::3]  # as many predicted tokens in every training batch
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": labels}

    def train_step() -> None:
        compiled(**batch(4))["loss"].backward()

    compiled.train()
    train_step()
    frames = counter.frame_count
    split = [batch(4), batch(4), batch(3)]
    result = evaluate(compiled, split, torch.device("cpu"), distributed=False)
    train_step()
    assert counter.frame_count == frames, f"{counter.frame_count - frames} new graphs"
    assert compiled.training
    want = evaluate(eager, split, torch.device("cpu"), distributed=False)
    assert result == pytest.approx(want, rel=1e-6)


class GraphCalls:
    """A Dynamo backend that runs each graph as traced and counts the graphs a call runs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


def module_cast(model):
    model.bfloat16()


def data_cast(model):
    """As a DeepSpeed engine with data_types.buffer_dtype casts: each tensor's .data, the
    module never told."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.bfloat16)


def graphs_a_forward(layers: int, cast, impl: str) -> int:
    """The graphs one forward of a fresh compile runs (Dynamo's caches emptied first: the frames
    other tests compiled, with their recompiles and shapes marked dynamic, change the count)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    kwargs = dict(vocab_size=50, max_len=32, layers=layers, attention_impl=impl)
    model = shatter.build_model("shatter-tiny", **kwargs)
    cast(model)
    counter = GraphCalls()
    model.compile(backend=counter)
    x = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.where(x % 3 == 0, x, -100)
    for _ in range(2):  # the first call makes the cast tables exact; the second recompiles
        model(x, None, labels)
    counter.calls = 0
    model(x, None, labels)
    torch._dynamo.reset()  # leave no frame compiled with this backend to the tests after
    return counter.calls


@pytest.mark.parametrize(
    ("impl", "cast"),
    [("naive", module_cast), ("naive", data_cast), ("lean", module_cast), ("chunked", data_cast)],
)
def test_compiled_graphs_a_forward_do_not_grow_with_the_layers(impl, cast):
    """A graph break inside the encoder's loop over the layers makes Dynamo run the loop in
    Python from then on, each layer's forward a few graphs of its own (a host-bound step on a
    GPU). Two did: a bf16 cast rounds each layer's partition table, which was made exact again
    inside the loop (now by the cast itself, or in one call before the loop), and lean's and
    chunked's skew read a storage offset. As many graphs for 4 layers as for 2."""
    assert graphs_a_forward(4, cast, impl) == graphs_a_forward(2, cast, impl)


@pytest.mark.parametrize("arch", ["bert", "shatter"])
def test_the_loader_s_predicted_positions_compile_once_and_break_nothing(arch):
    """With the loader's `predicted` (marked varying, as the trainer marks it) the masked-LM
    head runs inside the forward's graphs: fewer graphs a forward than the model's own boolean
    gather (a `nonzero`: a graph break, and a host sync on a GPU), and three batches of
    different counts compile one set of graphs."""
    from torch._dynamo.testing import CompileCounter

    from shatter.model import predicted_positions
    from shatter.partition import relative_index

    def batch(seed: int) -> dict:
        x = torch.randint(5, 50, (2, 16), generator=torch.Generator().manual_seed(seed))
        labels = torch.full_like(x, -100)
        labels[:, 1 : 1 + 3 * seed] = x[:, 1 : 1 + 3 * seed]  # 6, 12, 18 predicted
        return {"input_ids": x, "labels": labels, "predicted": predicted_positions(labels)}

    def graphs(given: bool) -> tuple[int, int]:
        torch._dynamo.reset()
        model = shatter.build_model(f"{arch}-tiny", vocab_size=50, max_len=32, layers=2)
        relative_index(16, 32, torch.device("cpu"))  # cached before: its first fill recompiles
        counter, calls = CompileCounter(), GraphCalls()
        model.compile(backend=lambda gm, inputs: (counter(gm, inputs), calls(gm, inputs))[1])
        counts = []
        for seed in (1, 2, 3):
            inputs = batch(seed)
            if not given:
                del inputs["predicted"]
            compiling.mark_varying(inputs)
            calls.calls = 0
            model(**inputs)["loss"].backward()
            counts.append(counter.frame_count)
        torch._dynamo.reset()
        assert len({len(batch(s)["predicted"]) for s in (1, 2, 3)}) == 3
        return counts, calls.calls

    given, own = graphs(True), graphs(False)
    assert given[0][0] == given[0][2], f"recompiled: {given[0]}"
    assert given[1] < own[1], (given, own)
