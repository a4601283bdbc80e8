"""shatter.eager: what torch.compile leaves to eager, marked without importing torch._dynamo when
shatter is imported (1.5-3 s of every CLI's and data-pipeline worker's start)."""

import subprocess
import sys

import torch

from shatter.eager import EAGER, constant_under_compile, eager


def test_importing_shatter_does_not_import_dynamo():
    code = "import sys, shatter, shatter.config, shatter.partition; print('torch._dynamo' in sys.modules)"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "an import-time torch.compiler decorator is back"


def test_constant_under_compile_marks_as_torch_s_own_decorator_does():
    def mine():
        return 1

    def theirs():
        return 1

    torch.compiler.assume_constant_result(theirs)
    marks = {k: v for k, v in vars(theirs).items() if k.startswith("_dynamo")}
    assert marks and vars(constant_under_compile(mine)) == marks


def test_an_eager_function_breaks_the_graph_and_runs_in_its_profiler_range():
    @eager
    def doubled(x):
        return x * 2

    def f(x):
        return doubled(x + 1) - 1

    x = torch.randn(4)
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 1 and explained.graph_count == 2
    with torch.profiler.profile() as prof:
        torch.testing.assert_close(torch.compile(f, backend="eager")(x), (x + 1) * 2 - 1)
    assert any(e.name == EAGER for e in prof.events())
