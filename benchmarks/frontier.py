"""The frontier against the same campaign without it: informative groups, CPU, and what the champion learned.

Reads two finished stores of one config (e.g. ``configs/long.toml``, run with and without ``--set
frontier.enabled=true``, same seed) and prints, per run:

- the share of informative groups (rewards that disagree) over iterations ``--from-iteration``..end, on all
  groups, on bare groups and on guided ones (the store's ``problems.guidance``), and the share where every
  sample failed;
- the CPU-minutes of every stage (as the store recorded them), and candidates skipped as uninformative;
- greedy pass@1 of the base model and of the last champion on the broad sealed set (bare, drawn once at the
  start: every curriculum level and the transfer phrasings, never curated or gated), on all of it and on its
  problems with a negative answer, each gain with a 95% paired bootstrap interval (``benchmarks/long.py``'s,
  stratified by level and source).

    .venv/bin/python benchmarks/frontier.py --run frontier=ducklake:sqlite:/a/evertrain.sqlite \\
        --run baseline=ducklake:sqlite:/b/evertrain.sqlite --campaign long

Writes benchmarks/results/frontier_long.json (``--results-name``) with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def negative_ids(store: Any, campaign: str) -> set[str]:
    """The broad sealed problems whose expected answer is a negative number."""
    out = set()
    for row in store.records("SELECT problem_id, payload FROM broad_sealed WHERE campaign = ?", [campaign]):
        answer = json.loads(row["payload"]).get("answer")
        try:
            if float(answer) < 0:
                out.add(row["problem_id"])
        except (TypeError, ValueError):
            continue
    return out


def groups_summary(store: Any, campaign: str, first: int) -> dict[str, Any]:
    """Informative and all-failed shares of the scored groups of iterations >= ``first``: all, bare, guided."""
    frame = store.query(
        """SELECT r.iteration, r.problem_id, coalesce(p.guidance, 0) AS guidance,
                  max(r.reward) > min(r.reward) AS informative, max(r.reward) = 0 AS all_failed
           FROM rollouts r JOIN problems p
             ON p.campaign = r.campaign AND p.iteration = r.iteration AND p.problem_id = r.problem_id
           WHERE r.campaign = ? AND r.iteration >= ? AND r.reward IS NOT NULL
           GROUP BY r.iteration, r.problem_id, coalesce(p.guidance, 0)""", [campaign, first])
    out: dict[str, Any] = {}
    for name, part in (("all", frame), ("bare", frame[frame["guidance"] == 0]),
                       ("guided", frame[frame["guidance"] > 0])):
        out[name] = {"groups": len(part),
                     "informative_share": float(part["informative"].mean()) if len(part) else None,
                     "all_failed_share": float(part["all_failed"].mean()) if len(part) else None}
    return out


def summarise(uri: str, campaign: str, first: int) -> dict[str, Any]:
    from benchmarks.long import curve, late_gain
    from evertrain.data.store import Store

    store = Store(uri, read_only=True)
    try:
        rows, scores, held = curve(store, campaign)
        last = rows[-1]["iteration"]
        base = store.scalar("SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'",
                            [campaign])
        base = None if base is None else int(base)
        negative = negative_ids(store, campaign)
        skipped = store.query("SELECT sum(coalesce(json_extract(metrics, '$.dropped_uninformative')::INTEGER, 0)) "
                              "AS n FROM stage_runs WHERE campaign = ? AND stage = 'curate'", [campaign])
        return {
            "store": uri, "iterations": len(rows), "last_iteration": last, "cpu_minutes": rows[-1]["cpu_minutes"],
            "wall_minutes": rows[-1]["wall_minutes"], "base_version": base, "last_champion": held[last],
            "groups": groups_summary(store, campaign, first),
            "skipped_uninformative": int(skipped["n"].iloc[0] or 0),
            "broad_from_base": late_gain(scores, base, held[last], "broad"),
            "negative_from_base": late_gain(scores[scores["problem_id"].isin(negative)], base, held[last], "broad"),
            "negative_problems": len(negative),
            "curve": [{k: r[k] for k in ("iteration", "cpu_minutes", "champion_version", "broad_pass1",
                                         "informative_share", "all_failed_share")} for r in rows],
        }
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=STORE",
                        help="a finished campaign's store (repeat: one per run)")
    parser.add_argument("--campaign", default="long")
    parser.add_argument("--from-iteration", type=int, default=6)
    parser.add_argument("--results-name", default="frontier_long")
    args = parser.parse_args()
    from benchmarks.common import save

    runs = {}
    for item in args.run:
        name, _, uri = item.partition("=")
        if not uri:
            parser.error(f"--run {item!r}: expected NAME=STORE")
        runs[name] = summarise(uri, args.campaign, args.from_iteration)
    save(args.results_name, {"campaign": args.campaign, "from_iteration": args.from_iteration, "runs": runs})

    def f(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    def gain(g: dict[str, Any] | None) -> str:
        if not g:
            return "-"
        return (f"{g['before_pass1']:.3f} -> {g['after_pass1']:.3f} ({g['gain']:+.3f} [{g['gain_low']:+.3f}, "
                f"{g['gain_high']:+.3f}], {g['problems']} problems)")

    print(f"{'run':<10} {'CPU-min':>8} {'informative (all/bare/guided)':>30} {'all failed':>10} {'skipped':>8}  "
          "broad sealed base -> last champion | negative answers")
    for name, r in runs.items():
        g = r["groups"]
        informative = "/".join(f(g[k]["informative_share"]) for k in ("all", "bare", "guided"))
        print(f"{name:<10} {r['cpu_minutes']:8.1f} {informative:>30} {f(g['all']['all_failed_share']):>10} "
              f"{r['skipped_uninformative']:>8}  {gain(r['broad_from_base'])} | {gain(r['negative_from_base'])}")


if __name__ == "__main__":
    main()
