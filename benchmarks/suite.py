"""The test suite's time, and how fast the machine was while it ran.

Runs `make test`'s pytest command (the same workers, files distributed whole, EVERTRAIN_REQUIRE_VLLM=1) in a
checkout, and records beside its wall time what the machine did over the run (``/proc/stat``: CPU-seconds busy,
idle and stolen by the host) and a fixed reference workload measured before and after it: single-threaded
torch training steps and a plain Python loop, in CPU-seconds. On a shared virtual machine the host's speed moves
from hour to hour (docs/benchmarks/tests.md has the development machine's), and a suite time means little without
it. Prints a table (the run, then the files that took longest) and
saves ``benchmarks/results/<name>.json``.

    .venv/bin/python benchmarks/suite.py                      # the working tree, three workers
    .venv/bin/python benchmarks/suite.py --repo /tmp/clone    # a checkout already set up (`make setup vllm`)
    .venv/bin/python benchmarks/suite.py --probe-only         # the reference workload alone

Run it with nothing else on the machine: the suite is bound by CPU, so any other work lengthens it.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_cpu, print_table, save

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 3  # the Makefile's TEST_WORKERS


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def probe() -> dict[str, float]:
    """CPU-seconds of a fixed single-threaded workload: 1,500 forward and backward passes of an 8-layer MLP
    (256 wide, batch 64) in torch, then 4 million steps of a Python loop over a dict. Lower is a faster host."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
        batch = torch.randn(64, 256)
        start = _cpu()
        for _ in range(1500):
            model(batch).sum().backward()
        torch_s = _cpu() - start
        start = _cpu()
        table: dict[int, int] = {}
        total = 0
        for i in range(4_000_000):
            table[i % 1000] = i
            total += i * i % 7
        python_s = _cpu() - start
    finally:
        torch.set_num_threads(threads)
    return {"torch_s": round(torch_s, 3), "python_s": round(python_s, 3), "total_s": round(torch_s + python_s, 3)}


def _junit(path: Path) -> tuple[dict[str, int], list[tuple[str, float, int]]]:
    """Counts (tests, failed, errors, skipped) and each file's summed test time (set-up, call and tear-down)."""
    counts = collections.Counter()
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for case in ET.parse(path).getroot().iter("testcase"):
        counts["tests"] += 1
        for outcome in ("failure", "error", "skipped"):
            if case.find(outcome) is not None:
                counts[outcome] += 1
        name = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        files[name][0] += float(case.get("time") or 0)
        files[name][1] += 1
    ranked = sorted(((name, seconds, int(n)) for name, (seconds, n) in files.items()), key=lambda f: -f[1])
    return {"tests": counts["tests"], "failed": counts["failure"], "errors": counts["error"],
            "skipped": counts["skipped"]}, ranked


def run_suite(repo: Path, workers: int, extra: list[str]) -> dict[str, Any]:
    """`make test`'s pytest command in ``repo``, timed, with the machine's CPU over it."""
    junit = Path(tempfile.mkdtemp(prefix="evertrain-suite-")) / "junit.xml"
    command = [str(repo / ".venv" / "bin" / "pytest"), "-q", "-n", str(workers), "--dist", "loadfile",
               "--no-loadscope-reorder", f"--junitxml={junit}", *extra]
    env = {**os.environ, "EVERTRAIN_REQUIRE_VLLM": "1"}
    before, began = machine_cpu(), time.perf_counter()
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - began, machine_cpu()
    if not junit.exists():
        raise SystemExit(f"pytest wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    counts, files = _junit(junit)
    used = {key: round(after[key] - before[key], 1) for key in before}
    lines = done.stdout.strip().splitlines()
    shown = [c for c in command if not c.startswith("--junitxml=")]
    return {"exit_code": done.returncode, "summary": lines[-1] if lines else "",
            "pytest_command": " ".join(["EVERTRAIN_REQUIRE_VLLM=1", *shown]),
            "wall_s": round(wall, 1), **counts, "cpu_busy_s": used["busy"], "cpu_idle_s": used["idle"],
            "cpu_steal_s": used["steal"], "files": [
                {"file": name, "seconds": round(seconds, 1), "tests": n} for name, seconds, n in files]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to test (set up: .venv, .venv-vllm)")
    parser.add_argument("--workers", type=int, default=WORKERS, help="pytest-xdist workers (the Makefile's: 3)")
    parser.add_argument("--probe-only", action="store_true", help="measure the reference workload alone")
    parser.add_argument("--results-name", default="suite", help="benchmarks/results/<name>.json")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest files to print")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. a test file")
    args = parser.parse_args(argv)
    if not (args.repo / ".venv" / "bin" / "pytest").exists() and not args.probe_only:
        parser.error(f"{args.repo} has no .venv/bin/pytest: run `make setup vllm` there first")

    first = probe()
    if args.probe_only:
        print_table([first], ["torch_s", "python_s", "total_s"])
        return
    result = run_suite(args.repo.resolve(), args.workers, args.pytest_args)
    last = probe()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True,
                            text=True).stdout.strip()
    row = {"commit": commit, "workers": args.workers, "tests": result["tests"],
           "failed": result["failed"] + result["errors"], "wall_s": result["wall_s"],
           "cpu_busy_s": result["cpu_busy_s"], "cpu_idle_s": result["cpu_idle_s"], "steal_s": result["cpu_steal_s"],
           "probe_before_s": first["total_s"], "probe_after_s": last["total_s"]}
    print_table([row], list(row))
    print()
    print_table(result["files"][:args.top], ["file", "seconds", "tests"])
    path = save(args.results_name, {"commit": commit, "repo": str(args.repo), **result,
                                    "probe_before": first, "probe_after": last})
    print(f"\n{result['summary']}\nsaved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if result["exit_code"] != 0:
        sys.exit(result["exit_code"])


if __name__ == "__main__":
    main()
