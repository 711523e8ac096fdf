"""Whether two campaign stores hold the same numbers: a refactor's before and after (issue 42).

Compares, row for row, the problems, rollouts (token ids and log-probs included), evaluations, promotion decisions
and model versions, and every stage metric that is not a timing (keys ending in ``_s``, or naming wall, cpu, gpu,
seconds, dollars or tokens per second). Prints one line per table and the metrics that differ; exits 1 on any
difference.

Run ``python benchmarks/compare_stores.py BEFORE.duckdb AFTER.duckdb`` (DuckDB-file stores, read only).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import duckdb

TABLES = {
    "problems": ("iteration, problem_id, env, prompt, payload", "ALL"),
    "rollouts": ("iteration, problem_id, sample, policy_version, completion, completion_ids, logprobs, finish_reason, "
                 "reward, passed, reason, temperature, top_p", "iteration, problem_id, sample"),
    "evals": ("iteration, model_version, role, problem_id, sample, completion, reward, split, gen_key", "ALL"),
    "promotions": ("iteration, challenger_version, champion_version, promoted, reason, challenger_pass1, "
                   "champion_pass1", "ALL"),
    "model_versions": ("version, iteration, kind, parent_version", "ALL"),
}
TIMING = ("wall", "cpu", "gpu", "seconds", "dollars", "tokens_per_s")


def untimed(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.endswith("_s") and not any(t in k for t in TIMING)}


def load(path: str) -> dict[str, Any]:
    con = duckdb.connect(path, read_only=True)
    out: dict[str, Any] = {name: con.execute(f"SELECT {columns} FROM {name} ORDER BY {order}").df()
                           for name, (columns, order) in TABLES.items()}
    stages = con.execute("SELECT iteration, stage, metrics FROM stage_runs ORDER BY iteration, stage").df()
    out["metrics"] = {(int(r.iteration), r.stage): untimed(json.loads(r.metrics or "{}"))
                      for r in stages.itertuples(index=False)}
    con.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    before, after = load(args.before), load(args.after)
    same = True
    for name in TABLES:
        equal = before[name].equals(after[name])
        same &= equal
        print(f"{name:<15} {len(before[name]):>5} rows  {'identical' if equal else 'DIFFERENT'}")
    differing = {key: {k: (a.get(k), after["metrics"].get(key, {}).get(k)) for k in set(a) | set(after["metrics"].get(
        key, {})) if a.get(k) != after["metrics"].get(key, {}).get(k)} for key, a in before["metrics"].items()}
    differing = {key: diff for key, diff in differing.items() if diff}
    keys = sum(len(m) for m in before["metrics"].values())
    print(f"{'stage metrics':<15} {keys:>5} values in {len(before['metrics'])} stage runs  "
          f"{'identical' if not differing and before['metrics'].keys() == after['metrics'].keys() else 'DIFFERENT'}")
    for key, diff in differing.items():
        print(f"    {key}: {diff}")
    same &= not differing and before["metrics"].keys() == after["metrics"].keys()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
