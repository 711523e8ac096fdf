"""What keeps a campaign's samples diverse: several runs of one campaign, each with one setting changed, side by side.

Per run and iteration, read from its store (opened read-only): the training reward, the curriculum level, distinct
completions per group, token entropy, the share of informative groups and the temperature sampled at
(:func:`evertrain.report.diversity`); per run, the CPU-minutes of every stage and, where
``benchmarks/trainee_gain.py`` measured the run's last trainee (``--gains PREFIX``: the results file
``PREFIX<name>.json``, where there is one), its gain over the base model on the broad sealed set and the
gate's problems.

    python benchmarks/diversity.py --campaign agent \
        --run no_sft=ducklake:sqlite:/scratch/no_sft/data/evertrain.sqlite \
        --run t13=ducklake:sqlite:/scratch/t13/data/evertrain.sqlite \
        --gains diversity_agent_ --results-name diversity_agent

Writes benchmarks/results/<name>.json (with the command and machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_rows(store_uri: str, campaign: str) -> tuple[list[dict[str, Any]], float]:
    """Per iteration: reward, level, diversity and temperature; and the campaign's stage CPU-minutes."""
    from evertrain.data.lineage import diversity
    from evertrain.data.store import Store

    with Store(store_uri, read_only=True) as store:
        rewards = {int(r["iteration"]): float(r["reward"]) for r in store.records(
            "SELECT iteration, avg(reward) AS reward FROM rollouts WHERE campaign = ? AND reward IS NOT NULL "
            "GROUP BY 1", [campaign])}
        levels = {int(r["iteration"]): int(r["level"]) for r in store.records(
            "SELECT iteration, max(level) AS level FROM curriculum WHERE campaign = ? GROUP BY 1", [campaign])}
        cpu = float(store.scalar("SELECT coalesce(sum(cpu_s), 0) / 60 FROM stage_runs WHERE campaign = ?",
                                 [campaign]))
        rows = [{"iteration": d["iteration"], "reward": rewards.get(d["iteration"]),
                 "level": levels.get(d["iteration"]), "temperature": d["temperature"],
                 "distinct": d["distinct_completions"], "entropy": d["token_entropy"],
                 "informative": d["informative_share"]} for d in diversity(store, campaign)]
    return rows, cpu


def gates(store_uri: str, campaign: str) -> list[dict[str, Any]]:
    """Every gate's decision: iteration, the two versions, their pass@1 on the gate's problems, promoted."""
    from evertrain.data.store import Store

    with Store(store_uri, read_only=True) as store:
        return [{key: (value.item() if hasattr(value, "item") else value) for key, value in row.items()}
                for row in store.records(
                    "SELECT iteration, challenger_version, champion_version, challenger_pass1, champion_pass1, "
                    "promoted FROM promotions WHERE campaign = ? ORDER BY iteration", [campaign])]


def broad_by_level(store_uri: str, campaign: str) -> dict[str, Any]:
    """Greedy pass@1 on the broad sealed set per curriculum level (or source), of the base model and of the last
    version measured on it (the last champion), as promote stored them; {} without a broad set."""
    from evertrain.data.store import Store

    with Store(store_uri, read_only=True) as store:
        rows = store.records(
            "SELECT e.model_version AS version, coalesce(CAST(b.level AS VARCHAR), b.source) AS level, "
            "avg(e.reward) AS pass1, count(*) AS problems FROM evals e JOIN broad_sealed b "
            "ON b.campaign = e.campaign AND b.problem_id = e.problem_id "
            "WHERE e.campaign = ? AND e.split = 'broad' AND e.sample = 0 GROUP BY 1, 2 ORDER BY 1, 2", [campaign])
    if not rows:
        return {}
    last = max(int(r["version"]) for r in rows)
    out: dict[str, Any] = {"base": 1, "champion": last}
    for role, version in (("base", 1), ("champion", last)):
        mine = [r for r in rows if int(r["version"]) == version]
        out[f"{role}_by_level"] = {str(r["level"]): round(float(r["pass1"]), 4) for r in mine}
        total = sum(int(r["problems"]) for r in mine)
        out[f"{role}_pass1"] = sum(float(r["pass1"]) * int(r["problems"]) for r in mine) / total if total else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", required=True, help="the campaign's name in every store")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=STORE",
                        help="a run's name and store URI (repeatable)")
    parser.add_argument("--gains", default=None, metavar="PREFIX",
                        help="read each run's trainee_gain result from benchmarks/results/PREFIX<name>.json")
    parser.add_argument("--results-name", required=True, help="write benchmarks/results/<name>.json")
    args = parser.parse_args()
    from benchmarks.common import RESULTS, print_table, save

    runs: dict[str, Any] = {}
    summary = []
    for spec in args.run:
        name, sep, uri = spec.partition("=")
        if not sep or not name or not uri:
            parser.error(f"--run {spec!r}: expected NAME=STORE")
        rows, cpu = run_rows(uri, args.campaign)
        if not rows:
            raise SystemExit(f"run {name!r}: campaign {args.campaign!r} has no scored rollouts in {uri}")
        print(f"\n{name} ({cpu:.1f} CPU-minutes in the stages)")
        print_table(rows, ["iteration", "reward", "level", "temperature", "distinct", "entropy", "informative"])
        gain = None
        if args.gains:
            path = RESULTS / f"{args.gains}{name}.json"
            if path.exists():
                gain = json.loads(path.read_text())
            else:
                print(f"(no trainee_gain result at {path})")
        broad = broad_by_level(uri, args.campaign)
        if broad:
            print(f"broad sealed set: base v1 {broad['base_pass1']:.2f} {broad['base_by_level']}; champion "
                  f"v{broad['champion']} {broad['champion_pass1']:.2f} {broad['champion_by_level']}")
        later = rows[1:] or rows
        summary.append({
            "run": name, "cpu_minutes": cpu,
            "entropy_after_0": sum(r["entropy"] or 0.0 for r in later) / len(later),
            "distinct_after_0": sum(r["distinct"] for r in later) / len(later),
            "informative_after_0": sum(r["informative"] for r in later) / len(later),
            "last_level": rows[-1]["level"],
            **({} if not broad else {"champion": broad["champion"], "champion_broad": broad["champion_pass1"]}),
            **({} if gain is None else {
                "trainee": gain["trainee_version"],
                "broad_gain": gain["broad"]["gain"] if "broad" in gain else None,
                "broad_ci95": gain["broad"]["ci95"] if "broad" in gain else None,
                "trainee_broad": gain["broad"]["trainee_pass1"] if "broad" in gain else None,
                "gate_gain": gain["gate"]["gain"]})})
        decided = gates(uri, args.campaign)
        for gate in decided:
            print(f"gate i={gate['iteration']}: v{gate['challenger_version']} {gate['challenger_pass1']:.2f} against "
                  f"v{gate['champion_version']} {gate['champion_pass1']:.2f}, "
                  f"{'promoted' if gate['promoted'] else 'refused'}")
        runs[name] = {"store": uri, "cpu_minutes": cpu, "iterations": rows, "broad": broad, "gates": decided}
    print("\nafter iteration 0 (means over the later iterations)")
    print_table(summary, ["run", "cpu_minutes", "entropy_after_0", "distinct_after_0", "informative_after_0",
                          "last_level", "champion", "champion_broad", "trainee_broad", "broad_gain", "gate_gain"])
    save(args.results_name, {"campaign": args.campaign, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
