"""The README's front page says only what make test runs: its commands are cookbook commands (each run, reduced,
by test_cookbook.py), and every test its capability table names exists and is part of the default suite."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from ..conftest import COLLECTED_SLOW, REPO
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


def collected_cases(files: list[Path]) -> dict[str, bool]:
    """Node id -> marked slow, for every test case in ``files``: from this session's collection (tests/conftest.py
    ``COLLECTED_SLOW``, taken before ``-m`` deselects any), else from pytest's own collection of the files."""
    wanted = {str(file.relative_to(REPO)) for file in files}
    known = {node: slow for node, slow in COLLECTED_SLOW.items() if node.split("::", 1)[0] in wanted}
    missing = sorted(wanted - {node.split("::", 1)[0] for node in known})
    if missing:
        command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
        every = subprocess.run(command + missing, cwd=REPO, capture_output=True, text=True, timeout=300)
        slow = subprocess.run(command + ["-m", "slow", *missing], cwd=REPO, capture_output=True, text=True, timeout=300)
        slow_ids = {line for line in slow.stdout.splitlines() if "::" in line}
        known |= {line: line in slow_ids for line in every.stdout.splitlines() if "::" in line}
    return known


def slow_cases(proof: str, cases: dict[str, bool]) -> tuple[list[str], list[str]]:
    """(the cases ``proof`` names, those of them marked slow). ``file.py`` names every case of the file and is
    slow only when all of them are; ``file.py::test`` names every parametrized case of the test, and one slow case
    makes it slow; ``file.py::test[case]`` names that case."""
    path, _, function = proof.partition("::")
    if not function:
        named = list(cases)
        return named, named if named and all(cases[n] for n in named) else []
    named = [n for n in cases if n.split("::", 1)[1] == function or n.split("::", 1)[1].startswith(function + "[")]
    if "[" in function:
        named = [n for n in cases if n.split("::", 1)[1] == function]
    return named, [n for n in named if cases[n]]


def test_the_front_page_commands_are_cookbook_commands():
    commands = readme_commands()
    assert len(commands) >= 6
    missing = [c for c in commands if c not in COMMANDS]
    assert not missing, f"README commands not in docs/COOKBOOK.md (so not run by make test): {missing}"


def test_every_proof_the_table_names_runs_in_make_test():
    """Each name in the table's last column resolves to test cases pytest collects, and none of the cases it names
    is marked slow (make test deselects those)."""
    proofs = table_proofs()
    assert len(proofs) >= 17
    cited = {}
    for proof in proofs:
        if proof in (".importlinter",):
            assert (REPO / proof).is_file()
            continue
        path = proof.partition("::")[0]
        pattern = path if path.startswith("tests/") else f"tests/**/{path}"
        files = [p for p in REPO.glob(pattern) if p.is_file()] or list(REPO.glob(pattern.rstrip("/") + "/test_*.py"))
        assert files, f"{proof}: no such test file"
        cited[proof] = (path, files)
    cases = collected_cases(sorted({file for _, files in cited.values() for file in files}))
    for proof, (path, files) in cited.items():
        for file in files:
            name = str(file.relative_to(REPO))
            in_file = {node: slow for node, slow in cases.items() if node.split("::", 1)[0] == name}
            named, slow = slow_cases(name + proof[len(path) :], in_file)
            assert named, f"{proof}: names no test case pytest collects in {name}"
            assert not slow, f"{proof}: {slow[0]} is marked slow, so make test does not run it"


def test_a_proof_that_names_a_slow_parametrized_case_is_refused():
    """The rule above on a made-up collection: a test with one slow case among its parameters cannot back a claim,
    its other cases can, one by one; a file can unless every case in it is slow."""
    cases = {"t.py::test_a[x]": False, "t.py::test_a[y]": True, "t.py::test_b": False, "s.py::test_c": True}
    assert slow_cases("t.py::test_a", cases)[1] == ["t.py::test_a[y]"]
    assert slow_cases("t.py::test_a[x]", cases) == (["t.py::test_a[x]"], [])
    assert slow_cases("t.py::test_a[y]", cases)[1] == ["t.py::test_a[y]"]
    assert slow_cases("t.py::test_b", cases) == (["t.py::test_b"], [])
    assert slow_cases("t.py", {n: s for n, s in cases.items() if n.startswith("t.py")})[1] == []
    assert slow_cases("s.py", {"s.py::test_c": True})[1] == ["s.py::test_c"]
    assert slow_cases("t.py::test_missing", cases) == ([], [])
