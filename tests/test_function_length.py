"""No function or method in pipeline/, shatter/ or train/ is longer than 80 lines (its `def`
line to its last line, docstring and comments included): one job per function."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 80


def longest(packages=("pipeline", "shatter", "train")) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function, longest first."""
    found = []
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    found.append((lines, f"{path.relative_to(REPO)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_no_function_is_longer_than_80_lines():
    over = [f"{where} ({lines} lines)" for lines, where in longest() if lines > LIMIT]
    assert not over, f"split these into functions of one job each: {', '.join(over)}"
