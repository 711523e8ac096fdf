"""The store, measured: DuckLake on a SQLite catalog (the embedded default) against one DuckDB file (before).

A simulated campaign writes what the real stages write, with the same calls, per iteration: 16 problems,
128 rollouts (token ids, log-probs, loss mask, turns), their scores, 230 evals, 12 stage_runs records
(running, then completed), a model version, a promotion and the campaign state. Reported:

- rows per second of a stage's bulk write (the rollout stage's ``replace`` of 128 rows);
- rows per second a reader's query scans (reward by iteration and environment over every rollout),
  after the campaign, and after compaction;
- size on disk and file count after N iterations, before and after compaction (DuckLake's
  ``merge_adjacent_files``, ``expire_snapshots``, ``cleanup_old_files``).

    .venv/bin/python benchmarks/store.py [--iterations 100] [--output benchmarks/results/store.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from evertrain.data.store import Store, now
from evertrain.stats import percentile

READER_SQL = ("SELECT iteration, env, avg(reward) AS reward, avg(completion_tokens) AS tokens "
              "FROM rollouts WHERE campaign = 'bench' GROUP BY ALL ORDER BY ALL")


def _rollouts(iteration: int, rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for p in range(16):
        for s in range(8):
            n = int(rng.integers(16, 64))
            rows.append({
                "campaign": "bench", "iteration": iteration, "problem_id": f"p{iteration}-{p}", "sample": s,
                "env": "arithmetic", "policy_version": iteration + 1, "prompt_text": "What is 12 + 30? " * 10,
                "completion": "12 + 30 = 42\n#### 42", "prompt_ids": rng.integers(0, 49152, 180).tolist(),
                "completion_ids": rng.integers(0, 49152, n).tolist(), "logprobs": rng.normal(-1, 1, n).tolist(),
                "loss_mask": [1] * n, "turns": json.dumps([{"role": "assistant", "start": 0, "end": n}]),
                "finish_reason": "stop", "prompt_tokens": 180, "completion_tokens": n, "tool_calls": 0,
                "tool_errors": 0, "rework": 0, "generated_at": now()})
    return pd.DataFrame(rows)


def simulate(uri: str, iterations: int, seed: int = 0) -> dict[str, Any]:
    """Write ``iterations`` iterations the way the stages do; time the rollout stage's write."""
    rng = np.random.default_rng(seed)
    store = Store(uri)
    write_rates = []
    started = time.perf_counter()
    for i in range(iterations):
        for stage in ("curate", "rollout", "score", "update", "evaluate", "promote"):
            store.record_stage("bench", i, stage, "running", started_at=now())
            if stage == "curate":
                store.replace("problems", {"campaign": "bench", "iteration": i}, [
                    {"campaign": "bench", "iteration": i, "problem_id": f"p{i}-{p}", "env": "arithmetic",
                     "split": "train", "prompt": "What is 12 + 30?", "payload": "{}", "messages": "[]",
                     "created_at": now()} for p in range(16)])
            elif stage == "rollout":
                frame = _rollouts(i, rng)
                t0 = time.perf_counter()
                store.replace("rollouts", {"campaign": "bench", "iteration": i}, frame)
                write_rates.append(len(frame) / (time.perf_counter() - t0))
            elif stage == "score":
                scores = pd.DataFrame({"problem_id": [f"p{i}-{p}" for p in range(16) for _ in range(8)],
                                       "sample": [s for _ in range(16) for s in range(8)],
                                       "reward": rng.integers(0, 2, 128).astype(float), "passed": True,
                                       "reason": "ok", "detail": "{}", "scored_at": now()})
                store.update_rollout_scores("bench", i, scores)
            elif stage == "update":
                store.replace("model_versions", {"campaign": "bench", "version": i + 2}, [
                    {"campaign": "bench", "version": i + 2, "iteration": i, "kind": "lora", "path": "/x",
                     "parent_version": i + 1, "created_at": now()}])
                store.set_campaign_state("bench", trainee_version=i + 2)
            elif stage == "evaluate":
                store.replace("evals", {"campaign": "bench", "iteration": i}, pd.DataFrame([
                    {"campaign": "bench", "iteration": i, "model_version": i + 2, "role": "challenger",
                     "problem_id": f"e{k}", "sample": 0, "env": "arithmetic", "completion": "#### 4",
                     "completion_tokens": 12, "reward": float(k % 2), "passed": bool(k % 2), "reason": "ok",
                     "created_at": now()} for k in range(230)]))
            else:
                store.replace("promotions", {"campaign": "bench", "iteration": i}, [
                    {"campaign": "bench", "iteration": i, "challenger_version": i + 2, "champion_version": 1,
                     "promoted": False, "reason": "bench", "decided_at": now()}])
            store.record_stage("bench", i, stage, "completed", started_at=now(), wall_s=0.0)
    elapsed = time.perf_counter() - started
    store.close()
    return {"campaign_s": round(elapsed, 1), "write_rows_per_s": round(statistics.median(write_rates)),
            "write_rows_per_s_p10": round(percentile(write_rates, 10))}


def read_rate(uri: str, repeats: int = 5) -> dict[str, Any]:
    """A reader process's view: open read-only, run the query a few times, rows scanned per second."""
    store = Store(uri, read_only=True)
    rows = int(store.scalar("SELECT count(*) FROM rollouts"))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.query(READER_SQL)
        times.append(time.perf_counter() - t0)
    store.close()
    best = min(times)
    return {"rows": rows, "query_s": round(best, 4), "read_rows_per_s": round(rows / best)}


def disk(path: Path) -> dict[str, int]:
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.endswith("lock")]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--output", default="benchmarks/results/store.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="evertrain-store-bench-"))
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), no GPU",
        "iterations": args.iterations, "rollouts_per_iteration": 128, "reader_query": READER_SQL}
    try:
        for name, uri, folder in (
            ("duckdb_file", str(scratch / "file" / "evertrain.duckdb"), scratch / "file"),
            ("ducklake_sqlite", f"ducklake:sqlite:{scratch / 'lake' / 'evertrain.sqlite'}", scratch / "lake"),
        ):
            print(f"{name}: simulating {args.iterations} iterations ...", flush=True)
            load_before = os.getloadavg()[0]
            entry: dict[str, Any] = simulate(uri, args.iterations)
            # a shared machine: the 1-minute load average says how much of it this run had
            entry["load_average"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
            entry["read"] = read_rate(uri)
            entry["disk"] = disk(folder)
            if name == "ducklake_sqlite":
                store = Store(uri)
                t0 = time.perf_counter()
                store.compact(keep_seconds=0)
                entry["compact_s"] = round(time.perf_counter() - t0, 2)
                store.close()
                entry["disk_after_compaction"] = disk(folder)
                entry["read_after_compaction"] = read_rate(uri)
            results[name] = entry
            print(json.dumps(entry), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
