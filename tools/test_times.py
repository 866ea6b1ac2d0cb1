"""Where make test's time goes: seconds per test directory and file, and the slowest tests, from the JUnit report
make test writes (outputs/tests/junit.xml).

    python tools/test_times.py                       # per directory, the 15 slowest files and tests
    python tools/test_times.py outputs/tests/junit.xml most=40 format=json
    DISTTRAIN_TEST_RUNLOG=$PWD/outputs/tests/runs.jsonl make test
    python tools/test_times.py runs=outputs/tests/runs.jsonl  # the runs tests started

``runs=`` reads the run log the suite writes with ``DISTTRAIN_TEST_RUNLOG`` set (tests/conftest.py ``log_run``):
one line per ``train.py``/tool run or process group a test started, with its seconds. It says how much of the
suite is such runs, which scripts and layouts cost most, and which identical runs were repeated (each one a
candidate for a shared fixture).
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


def summarize_runs(path: Path, most: int) -> dict:
    """The run log: seconds per script and per test file, and the argument lists run more than once."""
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    scripts, files, same = defaultdict(float), defaultdict(float), defaultdict(list)
    for run in runs:
        scripts[run["script"]] += run["seconds"]
        files[run["test"].split("::", 1)[0]] += run["seconds"]
        same[(run["script"], tuple(a for a in run["args"] if "/tmp" not in a and "pytest-" not in a))].append(run)
    repeated = sorted(((k, v) for k, v in same.items() if len(v) > 1), key=lambda kv: -sum(r["seconds"] for r in kv[1]))
    return {
        "runs": len(runs),
        "seconds": round(sum(run["seconds"] for run in runs), 1),
        "scripts": {k: round(v, 1) for k, v in sorted(scripts.items(), key=lambda x: -x[1])},
        "files": [{"file": f, "seconds": round(v, 1)} for f, v in sorted(files.items(), key=lambda x: -x[1])[:most]],
        "repeated": [
            {"script": k[0], "args": " ".join(k[1]), "times": len(v), "seconds": round(sum(r["seconds"] for r in v), 1)}
            for k, v in repeated[:most]
        ],
    }


def print_runs(summary: dict) -> None:
    print(f"{summary['runs']} runs started by tests, {summary['seconds']:.0f} s")
    for script, seconds in summary["scripts"].items():
        print(f"  {seconds:>8.1f} s  {script}")
    print("files by the seconds of their runs:")
    for row in summary["files"]:
        print(f"  {row['seconds']:>8.1f} s  {row['file']}")
    print("the same arguments run more than once (paths left out):")
    for row in summary["repeated"]:
        print(f"  {row['seconds']:>8.1f} s  {row['times']}x  {row['script']} {row['args'][:150]}")


def main(argv: list[str]) -> int:
    options = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    paths = [arg for arg in argv if "=" not in arg]
    if "runs" in options:
        runs = Path(options["runs"])
        if not runs.is_file():
            print(
                f"error: runs={runs}: no run log; run make test with DISTTRAIN_TEST_RUNLOG={runs.resolve()} first",
                file=sys.stderr,
            )
            return 2
        summary = summarize_runs(runs, int(options.get("most", 15)))
        print(json.dumps(summary, indent=1)) if options.get("format") == "json" else print_runs(summary)
        return 0
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
