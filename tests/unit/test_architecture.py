"""The shape of disttrain_core (docs/ARCHITECTURE.md): no import circle between two files, few loose modules at
the top, files and functions small enough to read. The layers themselves are import-linter's contract
(.importlinter, run by make test and make lint); these are what it does not check."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.import_graph import ROOT, circles, strongly_connected  # noqa: E402

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_strongly_connected_finds_a_circle():
    """The detector itself: a planted circle is one component, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    components = sorted(strongly_connected(graph), key=len)
    assert components[-1] == ["a", "b", "c"] and all(len(c) == 1 for c in components[:-1])


def test_no_import_circle_between_files():
    found = circles()
    assert not found, f"import circles (break each by moving what both need below both): {found}"


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
