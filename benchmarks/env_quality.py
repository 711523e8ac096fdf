"""The environment quality check over every shipped environment and level: the share of items each probe passes.

    python benchmarks/env_quality.py [--per-split N] [--rg-per-split M] [--out benchmarks/results/env_quality.json]

Every built-in environment on N train and N held-out items (the terminal: every vendored task and N tasks of each
generated level-0 template, train and held-out numbers), every reasoning-gym generator on M of each; prints a
table and saves the report with the command and the machine. Items a probe passes are flagged; a probe that
passes more than the threshold's share flags the whole kind (every item dropped from training by
``evertrain.envs.quality.drop_flagged``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path


def _one(name: str, per_split: int) -> dict:
    from evertrain.envs import registry
    from evertrain.envs.quality import probe

    # a reasoning-gym generator's held-out pool is built whole (100 items) on first use; the first items of a
    # smaller pool are the same items, at a fraction of the cost
    env = registry.get(name, eval_size=per_split) if name.startswith("rg:") else registry.get(name)
    started = time.monotonic()
    try:
        if name == "terminal":
            from evertrain.envs.terminal_levels import TEMPLATES, task_names

            problems = env.problems("train", env.count("train") or 0, 0)
            problems += env.problems("eval", env.count("eval") or 0, 0)
            each = max(1, per_split // 2) * len(TEMPLATES)  # generated level 0: train and held-out numbers
            generated = task_names(each, 0) + task_names(each, 0, held_out=True)
            problems += env.generated_problems(generated, "train")
        else:
            problems = env.problems("train", per_split, 0) + env.problems("eval", per_split, 0)
        report = probe(env, problems).as_dict()
    except Exception as error:  # an environment that cannot produce problems here: reported, not hidden
        report = {"env": name, "error": f"{type(error).__name__}: {error}"[:300]}
    report["wall_s"] = round(time.monotonic() - started, 1)
    for result in report.get("probes", {}).values():
        result.pop("passed_ids", None)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-split", type=int, default=4)
    parser.add_argument("--rg-per-split", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/env_quality.json")
    args = parser.parse_args()
    from evertrain.envs import registry

    names = [(n, args.per_split) for n in registry.names()]
    names += [(n, args.rg_per_split) for n in registry.names(include_rg=True) if n.startswith("rg:")]
    started = time.monotonic()
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(_one, name, n) for name, n in names]
        for future in as_completed(futures):
            row = future.result()
            rows.append(row)
            _save(args, rows, started)  # after every environment: a long run's partial report survives
            flagged = row.get("flagged_probes", row.get("error"))
            print(f"{row['env']:36s} items {row.get('items', '-'):>4} flagged {flagged}", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: r["env"])
    print(f"{'environment':36s} {'items':>5} {'graded':>6} {'kind flagged by':28s} {'items flagged':>13}")
    for row in rows:
        print(f"{row['env']:36s} {row.get('items', 0):>5} {row.get('graded', 0):>6} "
              f"{', '.join(row.get('flagged_probes', [])) or row.get('error', '-')[:28]:28s} "
              f"{row.get('flagged_items', 0):>13}")
    _save(args, rows, started, complete=len(rows) == len(names))
    return 0


def _save(args: argparse.Namespace, rows: list[dict], started: float, complete: bool = False) -> None:
    from evertrain.envs.quality import PROBE_MIN_PASSED, PROBE_THRESHOLD

    out = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, {platform.platform()}, shared with other work",
           "wall_s": round(time.monotonic() - started, 1), "complete": complete, "threshold": PROBE_THRESHOLD,
           "min_passed": PROBE_MIN_PASSED, "environments": sorted(rows, key=lambda r: r["env"])}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
