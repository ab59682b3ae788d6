"""The house's shape, checked: small files, short functions where the hard code lives, and no
import circle between the package's modules (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tunix_mcjax"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_ROOMS = ("engine", "runtime", "bench")  # where the hardest code lives
DECODE_LOOP_LINES = 300


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level
                                            + (path.name == "__init__.py")]
                base = ".".join([*package, *([base] if base else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_file_over_the_limit():
    over = [f"{p.relative_to(PACKAGE.parent)} ({n} lines)" for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not over, f"files over {MAX_FILE_LINES} lines: {over}"


@pytest.mark.parametrize("room", SHORT_FUNCTION_ROOMS)
def test_no_long_function(room):
    over = [line for p in sorted((PACKAGE / room).rglob("*.py")) for line in long_functions(p)]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines in {room}/: {over}"


def test_decode_loop_is_only_the_loop():
    lines = len((PACKAGE / "engine" / "decode_loop.py").read_text().splitlines())
    assert lines < DECODE_LOOP_LINES, f"engine/decode_loop.py has {lines} lines"


def test_no_import_circle():
    found = modules()
    # A package's __init__ that re-exports its modules is its face, not a room of its own.
    graph = {name: {t for t in imported(path, name, set(found))
                    if not (path.name == "__init__.py" and t.startswith(name + "."))}
             for name, path in found.items()}
    assert not circles(graph), f"import circles: {circles(graph)}"
