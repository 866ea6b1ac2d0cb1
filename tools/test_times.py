"""Where make test's time goes: seconds per test directory and file, and the slowest tests, from the JUnit report
make test writes (outputs/tests/junit.xml).

    python tools/test_times.py                       # per directory, the 15 slowest files and tests
    python tools/test_times.py outputs/tests/junit.xml most=40 format=json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

DEFAULT = Path("outputs/tests/junit.xml")


def read(path: Path) -> list[tuple[str, str, float]]:
    """(file, test, seconds) of every test case in a JUnit report (setup and teardown included)."""
    root = ElementTree.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        module = case.get("classname", "")
        file = module.replace(".", "/") + ".py"
        cases.append((file, case.get("name", ""), float(case.get("time", 0.0))))
    return cases


def summarize(cases: list[tuple[str, str, float]], most: int) -> dict:
    directories, files = defaultdict(float), defaultdict(float)
    counts = defaultdict(int)
    for file, _, seconds in cases:
        directory = str(Path(file).parent)
        directories[directory] += seconds
        counts[directory] += 1
        files[file] += seconds
    slowest = sorted(cases, key=lambda case: -case[2])[:most]
    return {
        "total_s": round(sum(seconds for _, _, seconds in cases), 1),
        "tests": len(cases),
        "directories": {d: {"seconds": round(s, 1), "tests": counts[d]} for d, s in sorted(directories.items())},
        "files": [{"file": f, "seconds": round(s, 1)} for f, s in sorted(files.items(), key=lambda x: -x[1])[:most]],
        "tests_slowest": [{"test": f"{f}::{n}", "seconds": round(s, 1)} for f, n, s in slowest],
    }


def main(argv: list[str]) -> int:
    options = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    paths = [arg for arg in argv if "=" not in arg]
    path = Path(paths[0]) if paths else DEFAULT
    if not path.is_file():
        print(f"error: {path}: no JUnit report; run make test first (it writes {DEFAULT})", file=sys.stderr)
        return 2
    summary = summarize(read(path), int(options.get("most", 15)))
    if options.get("format") == "json":
        print(json.dumps(summary, indent=1))
        return 0
    print(f"{summary['tests']} tests, {summary['total_s']:.0f} s in tests (collection and start-up not included)")
    for directory, row in summary["directories"].items():
        print(f"  {directory:<24} {row['seconds']:>8.1f} s  {row['tests']:>4} tests")
    print("slowest files:")
    for row in summary["files"]:
        print(f"  {row['seconds']:>8.1f} s  {row['file']}")
    print("slowest tests:")
    for row in summary["tests_slowest"]:
        print(f"  {row['seconds']:>8.1f} s  {row['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
