"""Environments from other systems, trained at once: what a finished ``configs/ecosystem.toml`` campaign learned.

Reads the campaign's store and prints, per environment (a verifiers taskset, an OpenEnv server, a built-in):

- the mean training reward of each iteration (the rollouts as graded by the environment's own rubric or server);
- greedy pass@1 of the base model and of the last champion on the same held-out problems, the gate's split and
  the sealed test split (never seen by a promotion), each gain with a 95% paired bootstrap interval;
- the CPU-seconds of the whole campaign, by stage.

    .venv/bin/evertrain run --config configs/ecosystem.toml --iterations 9
    .venv/bin/python benchmarks/ecosystem.py --store ducklake:sqlite:data/evertrain.sqlite

Writes benchmarks/results/ecosystem.json with the command and the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the campaign's store URI")
    parser.add_argument("--campaign", default="ecosystem")
    parser.add_argument("--results-name", default="ecosystem")
    args = parser.parse_args()
    from benchmarks.common import print_table, save
    from evertrain.data.lineage import champion_vs_base
    from evertrain.data.store import Store

    with Store(args.store, read_only=True) as store:
        rewards = store.query("SELECT iteration, env, avg(reward) AS reward, count(*) AS rollouts FROM rollouts "
                              "WHERE campaign = ? AND reward IS NOT NULL GROUP BY ALL ORDER BY ALL", [args.campaign])
        stages = store.query("SELECT stage, sum(cpu_s) AS cpu_s FROM stage_runs WHERE campaign = ? AND "
                             "status = 'completed' GROUP BY stage ORDER BY 2 DESC", [args.campaign])
        held_out = champion_vs_base(store, args.campaign)
    by_iteration = [{"iteration": int(r.iteration), "env": r.env, "reward": round(float(r.reward), 3),
                     "rollouts": int(r.rollouts)} for r in rewards.itertuples()]
    print_table(by_iteration, ["iteration", "env", "reward", "rollouts"])
    rows = [{"env": r["env"], "split": r["split"], "problems": r.get("problems"), "base": round(r["base_pass1"], 3),
             "champion": round(r["champion_pass1"], 3), "gain": round(r["gain"], 3),
             "ci95": [round(r["gain_low"], 3), round(r["gain_high"], 3)], "champion_version": r["champion_version"]}
            for r in held_out]
    print_table(rows, ["env", "split", "problems", "base", "champion", "gain", "ci95", "champion_version"])
    cpu = {r.stage: round(float(r.cpu_s), 1) for r in stages.itertuples()}
    print(f"CPU-seconds by stage: {cpu} (total {sum(cpu.values()):.0f})")
    path = save(args.results_name, {"campaign": args.campaign, "rewards_by_iteration": by_iteration,
                                    "held_out": rows, "stage_cpu_s": cpu})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
