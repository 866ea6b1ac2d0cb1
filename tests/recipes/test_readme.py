"""The README's front page says only what make test runs: its commands are cookbook commands (each run, reduced,
by test_cookbook.py), and every test its capability table names exists and is part of the default suite."""

from __future__ import annotations

import ast
import re
import shlex

from ..conftest import REPO
from .test_cookbook import COMMANDS

README = (REPO / "README.md").read_text()


def readme_commands() -> list[str]:
    block = README.split("## The commands people come for", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [" ".join(shlex.split(line, comments=True)) for line in lines]


def table_proofs() -> list[str]:
    """The last column of the capability table: test files (globs allowed) and test functions."""
    table = README.split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| capability")]
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.rstrip(" |").rsplit("|", 1)[1])]


def _slow(tree: ast.Module, function: str | None) -> bool:
    marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)]
    if any("slow" in mark for mark in marks):
        return True
    if function is None:
        return False
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return any(
        ast.unparse(d) == "pytest.mark.slow" for d in node.decorator_list
    )  # slow cases of a parametrize: some run


def test_the_front_page_commands_are_cookbook_commands():
    commands = readme_commands()
    assert len(commands) >= 6
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, f"README commands not in docs/COOKBOOK.md (so not run by make test): {missing}"


def test_every_proof_the_table_names_runs_in_make_test():
    proofs = table_proofs()
    assert len(proofs) >= 17
    for proof in proofs:
        if proof in (".importlinter",):
            assert (REPO / proof).is_file()
            continue
        path, _, function = proof.partition("::")
        pattern = path if path.startswith("tests/") else f"tests/**/{path}"
        files = [p for p in REPO.glob(pattern) if p.is_file()] or [p for p in REPO.glob(pattern.rstrip("/") + "/*.py")]
        assert files, f"{proof}: no such test file"
        for file in files:
            tree = ast.parse(file.read_text())
            if function:
                assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body), proof
            assert not _slow(tree, function or None), f"{proof}: marked slow, so make test does not run it"
