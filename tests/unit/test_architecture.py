"""The shape of disttrain_core (docs/ARCHITECTURE.md): no import circle between two files, few loose modules at
the top, files and functions small enough to read. The layers themselves are import-linter's contract
(.importlinter, run by make test and make lint); these are what it does not check."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "disttrain_core"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The modules of disttrain_core one import statement (anywhere in a file, function bodies included) loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
    return [t for t in targets if t in known and t != name]


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_imported(name, path, node, known))
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the strongly connected components of ``graph``."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def test_strongly_connected_finds_a_circle():
    """The detector itself: a planted circle is one component, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    components = sorted(strongly_connected(graph), key=len)
    assert components[-1] == ["a", "b", "c"] and all(len(c) == 1 for c in components[:-1])


def test_no_import_circle_between_files():
    circles = [c for c in strongly_connected(import_graph()) if len(c) > 1]
    assert not circles, f"import circles (break each by moving what both need below both): {circles}"


def test_few_loose_modules_at_the_top():
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 4, f"modules directly in disttrain_core/ (put each in the package of its layer): {loose}"


def test_no_file_too_long():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines (split by concept): {long}"


def test_no_function_too_long():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split by step): {sorted(long)}"
