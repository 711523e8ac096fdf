"""benchmarks/suite.py's reading of what it measures: pytest's JUnit report, and the machine's CPU counters
(benchmarks/common.py, vs_trl.py's too)."""

from __future__ import annotations

import time

from benchmarks.common import machine_cpu
from benchmarks.suite import _junit

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_fast" name="test_a" time="0.5"/>
<testcase classname="tests.test_slow" name="test_b" time="7.25"><failure message="boom">x</failure></testcase>
<testcase classname="tests.test_slow" name="test_c" time="2.75"/>
<testcase classname="tests.test_fast" name="test_d" time="0.25"><skipped message="no vLLM"/></testcase>
</testsuite></testsuites>
"""


def test_the_report_is_counted_and_files_ranked_by_their_summed_time(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(REPORT)
    counts, files = _junit(path)
    assert counts == {"tests": 4, "failed": 1, "errors": 0, "skipped": 1}
    assert files == [("test_slow.py", 10.0, 2), ("test_fast.py", 0.75, 2)]


def test_busy_cpu_counts_work_done_between_two_readings():
    before = machine_cpu()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # 0.3 CPU-seconds of this process's own work
        pass
    after = machine_cpu()
    assert after["busy"] - before["busy"] >= 0.25
    assert after["idle"] >= before["idle"] and after["steal"] >= before["steal"]
