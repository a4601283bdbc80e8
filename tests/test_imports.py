"""No import circles among the project's modules, lazy (function-level) imports included: a
cycle hidden behind a lazy import still couples two modules both ways."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("shatter", "pipeline", "train", "tools")
SUBPACKAGES = ("pipeline", "train", "tools")  # installed as shatter.pipeline, ... (setup.py)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("shatter", *parts) if parts[0] in SUBPACKAGES else parts)


def _model_side(module: str) -> bool:
    """shatter/ itself: the model, not the subpackages that live in their own folders."""
    parts = module.split(".")
    return parts[0] == "shatter" and (len(parts) == 1 or parts[1] not in SUBPACKAGES)


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {  # `if TYPE_CHECKING:` imports are for annotations: never run
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports pkg.mod when it is a module, else pkg
                targets = [
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        # a package's __init__ runs before its modules: importing pkg.mod imports pkg too, but
        # that edge only matters when __init__ imports back, which its own edges show
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_real_imports():
    graph = _graph()
    assert "shatter.config" in graph["shatter.model"]
    assert "shatter.train.finetuning.loop" in graph["shatter.train.finetune"]


def test_no_import_cycles():
    cycle = _cycle(_graph())
    if cycle:
        pytest.fail("import cycle: " + " -> ".join(cycle))


def test_annotation_only_imports_are_not_edges():
    """The attention variants name ModelConfig in annotations only, so shatter.config may read
    the registry (its one list of archs) without a cycle."""
    graph = _graph()
    assert "shatter.attention" in graph["shatter.config"]
    assert "shatter.config" not in graph["shatter.attention.multihead"]


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# shatter.remote reaches the object store through shatter.pipeline.store, the store's Beam-side options
MODEL_TO_PIPELINE = {"shatter.remote": {"shatter.pipeline.store"}}


def test_the_model_package_imports_only_the_shard_format_of_the_pipeline():
    """shatter/ (the model) needs no Beam: what it shares with the pipeline (special ids, sha256,
    the tokenizer loader) is in shatter.shards, which imports neither Beam nor torch. Lazy
    imports count; `if TYPE_CHECKING:` ones do not."""
    graph = _graph()
    found = {
        module: {d for d in deps if d.startswith("shatter.pipeline") and not _in_format(d)}
        for module, deps in graph.items()
        if _model_side(module)
    }
    found = {m: deps - MODEL_TO_PIPELINE.get(m, set()) for m, deps in found.items()}
    assert not {m: d for m, d in found.items() if d}, "shatter/ imports the pipeline's Beam side"
    assert "shatter.shards.tokenizer" in graph["shatter.hf.tokenizer"]


def _in_format(module: str) -> bool:
    return module == "shatter.shards" or module.startswith("shatter.shards.")


def test_the_toolkit_s_modules_are_imported_by_their_installed_names():
    """pipeline/, train/ and tools/ install as shatter.pipeline, shatter.train, shatter.tools:
    an import of the bare folder name works only in a checkout (or finds PyPI's `tools`)."""
    stale = []
    for path in [
        *REPO.glob("*.py"),
        *(p for d in ("shatter", *SUBPACKAGES, "tests", ".ci") for p in (REPO / d).rglob("*.py")),
    ]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            stale += [
                f"{path.relative_to(REPO)}:{node.lineno}"
                for n in names
                if n.split(".")[0] in SUBPACKAGES
            ]
    assert not stale, "import shatter.pipeline (not pipeline) etc.: " + ", ".join(stale)


def _defined(path: Path) -> set[str] | None:
    """The names a module defines at its top level (None: it has a module `__getattr__`, so any
    name may resolve)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            names |= {
                n.id
                for t in targets
                if t is not None
                for n in ast.walk(t)
                if isinstance(n, ast.Name)
            }
    return names


def test_every_import_of_the_toolkit_resolves():
    """Every `import shatter.x` names a module of the checkout, and every `from shatter.x import y`
    a submodule or a top-level name of shatter.x: what a static reader (basedpyright, in `make
    test`, for modules) checks, here for the imported names too, tests included."""
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    broken = []
    for path in [*files, *(REPO / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names if a.name.startswith("shatter")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [(node.module, a.name) for a in node.names]
                wanted = [w for w in wanted if node.module.split(".")[0] == "shatter"]
            else:
                continue
            for module, name in wanted:
                names = _defined(modules[module]) if module in modules else set()
                ok = module in modules and (
                    name is None or f"{module}.{name}" in modules or names is None or name in names
                )
                if not ok:
                    broken.append(f"{path.relative_to(REPO)}:{node.lineno} {module} {name or ''}")
    assert not broken, "imports that do not resolve: " + ", ".join(broken)
