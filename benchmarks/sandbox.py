"""How fast the sandbox and the code grader are: grades per second over MBPP, and the cost of isolation.

Measures, on this machine:
- the wall time of starting a bare ``python -c pass`` (and ``python -S -c pass``) subprocess, of one
  sandboxed run of ``pass`` (bwrap + prelude + job), and their ratio;
- one grade (two sandboxes: the candidate's and the tests') run alone: wall and CPU time;
- sandboxed grades per second over every MBPP reference solution, on thread pools one and two times
  as wide as the machine (a grade waits on its sandboxes, so more threads than cores keeps the cores
  busier), and which references fail (they must be exactly ``MBPP_EXCLUDED``).

Prints a table and writes the numbers to ``benchmarks/results/sandbox.json``.
Run: ``.venv/bin/python benchmarks/sandbox.py [--workers N ...] [--limit N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import save  # noqa: E402
from evertrain.envs.code import MBPP_EXCLUDED, grade_code, mbpp_entry_point  # noqa: E402
from evertrain.sandbox import bwrap, run_python  # noqa: E402


def _median_ms(run: Any, repeats: int) -> float:
    run()  # warm the page cache
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _grade_reference(row: dict[str, Any]) -> tuple[int, bool, str, float]:
    payload = {"tests": row["test_list"], "test_setup": row["test_setup_code"],
               "entry_point": mbpp_entry_point(row["code"], row["test_list"][0])}
    verdict, records = grade_code(payload, row["code"])
    return row["task_id"], verdict.passed, verdict.reason, sum(r.cpu_s for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--workers", type=int, nargs="+", default=[cores, 2 * cores], help="grading threads")
    parser.add_argument("--limit", type=int, default=None, help="grade only the first N references")
    parser.add_argument("--repeats", type=int, default=30, help="runs per startup timing")
    args = parser.parse_args()

    python = bwrap.interpreter()
    startup = {
        "bare_python_ms": _median_ms(lambda: subprocess.run([python, "-c", "pass"]), args.repeats),
        "bare_python_S_ms": _median_ms(lambda: subprocess.run([python, "-S", "-c", "pass"]), args.repeats),
        "sandboxed_pass_ms": _median_ms(lambda: run_python("pass"), args.repeats),
    }
    startup["sandbox_over_bare_python"] = startup["sandboxed_pass_ms"] / startup["bare_python_ms"]
    startup["sandbox_over_bare_python_S"] = startup["sandboxed_pass_ms"] / startup["bare_python_S_ms"]

    add = {"tests": ["assert add(1, 2) == 3", "assert add(5, 7) == 12"], "entry_point": "add"}
    solution = "def add(a, b):\n    return a + b"
    one_grade_ms = _median_ms(lambda: grade_code(add, solution), args.repeats)
    one_grade_cpu_ms = 1000 * statistics.median(
        sum(record.cpu_s for record in grade_code(add, solution)[1]) for _ in range(args.repeats))

    with open(ROOT / "data" / "mbpp" / "mbpp.jsonl") as lines:
        rows = [json.loads(line) for line in lines][: args.limit]
    grading = [_grade_all(rows, workers) for workers in args.workers]

    path = save("sandbox", {
        "cpu_count": os.cpu_count(), "bwrap": _bwrap_version(),  # beside common.machine()'s platform, cpu
        "startup": startup, "one_grade": {"wall_ms": one_grade_ms, "cpu_ms": one_grade_cpu_ms},
        "mbpp_references": grading,
    })

    table = [
        ("bare `python -c pass`", f"{startup['bare_python_ms']:.1f} ms"),
        ("bare `python -S -c pass`", f"{startup['bare_python_S_ms']:.1f} ms"),
        ("sandboxed run of `pass`", f"{startup['sandboxed_pass_ms']:.1f} ms"),
        ("sandboxed / bare python -c pass", f"{startup['sandbox_over_bare_python']:.2f} x"),
        ("sandboxed / bare python -S -c pass", f"{startup['sandbox_over_bare_python_S']:.2f} x"),
        ("one grade (2 sandboxes), wall", f"{one_grade_ms:.1f} ms"),
        ("one grade (2 sandboxes), CPU", f"{one_grade_cpu_ms:.1f} ms"),
    ]
    for run in grading:
        table += [
            (f"MBPP references, {run['workers']} threads", f"{len(rows)} in {run['seconds']:.1f} s"),
            (f"grades per second, {run['workers']} threads", f"{run['grades_per_s']:.1f}"),
            ("references failing", f"{len(run['failed'])} {sorted(run['failed'])}"),
            ("failing = MBPP_EXCLUDED", str(run["failed_exactly_the_excluded"])),
        ]
    width = max(len(name) for name, _ in table)
    print(f"{'measure':<{width}}  value\n{'-' * width}  -----")
    for name, value in table:
        print(f"{name:<{width}}  {value}")
    cpu = json.loads(path.read_text())["machine"]["cpu"]
    print(f"\n{cpu}, {os.cpu_count()} CPUs; written to {path}")


def _grade_all(rows: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(_grade_reference, rows))
    elapsed = time.perf_counter() - started
    failed = {task: reason for task, passed, reason, _ in results if not passed}
    return {
        "references": len(rows), "workers": workers, "seconds": elapsed,
        "grades_per_s": len(rows) / elapsed, "sandboxes_per_s": 2 * len(rows) / elapsed,
        "sandbox_cpu_s_total": sum(cpu for *_, cpu in results),
        "failed": failed,
        "failed_exactly_the_excluded": set(failed) == set(MBPP_EXCLUDED) & {row["task_id"] for row in rows},
    }


def _bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "missing"


if __name__ == "__main__":
    main()
