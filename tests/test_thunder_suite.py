"""benchmarks/correctness/thunder_suite.py: outcomes and failures' messages read from a hand-written JUnit report,
differences found between two hand-made runs, and a real run of part of Thunder's test_autocast with and without the
transform, where the plugin must have added the transform to each compilation and seen it run."""

import json

from benchmarks.correctness.thunder_suite import compare, failures, main, outcomes

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="thunder.tests.test_a" name="test_ok" />
<testcase classname="thunder.tests.test_a" name="test_bad"><failure message="AssertionError: 1 != 2">def test_bad():
&gt;   assert 1 == 2
E   AssertionError: 1 != 2</failure></testcase>
<testcase classname="thunder.tests.test_a" name="test_cuda"><skipped message="no cuda" /></testcase>
<testcase classname="thunder.tests.test_a" name="test_broken"><error message="fixture" /></testcase>
<testcase classname="" file="thunder/tests/test_b.py" name="test_ok" />
</testsuite></testsuites>"""


def test_outcomes_from_a_junit_report(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)
    assert outcomes(path) == {
        "thunder.tests.test_a::test_ok": "passed",
        "thunder.tests.test_a::test_bad": "failed",
        "thunder.tests.test_a::test_cuda": "skipped",
        "thunder.tests.test_a::test_broken": "error",
        "thunder/tests/test_b.py::test_ok": "passed",  # a --pyargs run: no class name, the file tells
    }
    assert outcomes(tmp_path / "missing.xml") == {}


def test_failures_keep_the_message_and_the_traceback(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(JUNIT)
    assert failures(path) == {
        "thunder.tests.test_a::test_bad": {
            "message": "AssertionError: 1 != 2",
            "tail": "def test_bad():\n>   assert 1 == 2\nE   AssertionError: 1 != 2",
        },
        "thunder.tests.test_a::test_broken": {"message": "fixture", "tail": ""},
    }


def test_differences_between_two_runs():
    without = {"a": "passed", "b": "failed", "c": "skipped"}
    with_ = {"a": "failed", "b": "failed", "d": "passed"}
    assert compare(without, with_) == [("a", "passed", "failed"), ("c", "skipped", "absent"), ("d", "absent", "passed")]
    assert compare(without, dict(without)) == []


def test_part_of_thunders_autocast_tests_with_and_without_the_transform(tmp_path):
    out = tmp_path / "suite.json"
    code = main(["--files", "test_autocast", "--jobs", "1", "-k", "mixed_dtype_inputs", "--out", str(out)])
    found = json.loads(out.read_text())
    assert code == 0 and found["changed"] == []
    assert found["without"] == found["with"] and len(found["with"]) >= 2
    assert found["failures"] == {"without": {}, "with": {}}
    assert "passed" in found["with"].values()
    record = found["record"]
    assert record["jitted"] >= 2 and record["transformed"] >= record["jitted"]  # it ran on every compilation
    assert record["warnings"] == [] and record["raised"] == []
