"""tools/test_times.py: seconds per directory and the slowest tests, from make test's JUnit report."""

from __future__ import annotations

import importlib.util

from ..conftest import REPO

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.unit.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.unit.test_a" name="test_two" time="0.5"/>
<testcase classname="tests.distributed.test_b" name="test_three[x]" time="12.25"/>
</testsuite></testsuites>"""


def test_seconds_add_up_per_directory_and_the_slowest_come_first(tmp_path):
    spec = importlib.util.spec_from_file_location("test_times", REPO / "tools" / "test_times.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = tmp_path / "junit.xml"
    path.write_text(REPORT)
    summary = tool.summarize(tool.read(path), most=2)
    assert summary["total_s"] == 14.2 and summary["tests"] == 3
    assert summary["directories"] == {
        "tests/distributed": {"seconds": 12.2, "tests": 1},
        "tests/unit": {"seconds": 2.0, "tests": 2},
    }
    assert summary["tests_slowest"][0] == {"test": "tests/distributed/test_b.py::test_three[x]", "seconds": 12.2}
    assert [row["file"] for row in summary["files"]] == ["tests/distributed/test_b.py", "tests/unit/test_a.py"]
    assert tool.main([str(tmp_path / "none.xml")]) == 2
