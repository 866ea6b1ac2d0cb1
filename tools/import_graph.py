"""The file import graph of disttrain_core, and its strongly connected components (import circles).

Read by tests/unit/test_architecture.py (no circle between two files) and tools/architecture.py (the layer
picture's arrows). Every import statement counts, function-level ones included: a lazy import still ties the
two files together. ``python tools/import_graph.py`` prints any circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "disttrain_core"


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


def circles() -> list[list[str]]:
    """The import circles: strongly connected components of more than one file."""
    return [c for c in strongly_connected(import_graph()) if len(c) > 1]


if __name__ == "__main__":
    found = circles()
    for circle in found:
        print(" <-> ".join(circle))
    print(f"{len(found)} import circle(s) between files of disttrain_core")
