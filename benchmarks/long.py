"""The long campaign's learning curve, read from its store: does iteration 20 still teach the model something?

Per iteration, against cumulative CPU-minutes (every stage of every iteration, as the store recorded them):

- broad sealed pass@1 of the champion in effect after the iteration (the broad sealed set: every curriculum
  level and the transfer phrasings, drawn once at the campaign's start, never curated or gated). Promote
  measures the base model once and every new champion on it, so the champion of an iteration without a
  promotion is the one measured earlier; the sealed test and transfer splits are read the same way;
- the curriculum level reached per environment (``curriculum`` table);
- the share of informative groups (rewards not all equal) and distinct completions per group of the
  iteration's scored rollouts (:func:`evertrain.report.diversity`, from the stored rollouts).

And the late gain: broad sealed pass@1 of the last champion minus that of the champion in effect at
``--from-iteration`` (default 6), paired on the same problems, with a 95% bootstrap interval stratified by
the problem's level and source (:func:`evertrain.stats.bootstrap_means`).

    .venv/bin/python benchmarks/long.py --store ducklake:sqlite:/path/evertrain.sqlite --campaign long

The loop ships its champion, and the broad set sees only champions; with ``--measure-trainee
configs/long.toml`` (after the campaign has stopped) the last trainee, promoted or not, is measured on it too
by the campaign's own evaluation code, and its gain over the champion of ``--from-iteration`` is reported
beside (nothing is written to the store).

Writes benchmarks/results/long.json (with the command and machine) and long.png (``--results-name``: another
name). The store is opened read-only, so it may be read while the campaign writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOOTSTRAP_SAMPLES = 4000
BOOTSTRAP_SEED = 20261201


def champions(store: Any, campaign: str, iterations: list[int]) -> dict[int, int | None]:
    """The champion in effect after each iteration (promotions replayed; before the first: the base model)."""
    base = store.scalar("SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'", [campaign])
    decided = store.query("SELECT iteration, promoted, challenger_version, champion_version FROM promotions "
                          "WHERE campaign = ? ORDER BY iteration", [campaign])
    by_iteration = {int(r.iteration): int(r.challenger_version if r.promoted else r.champion_version)
                    for r in decided.itertuples(index=False)}
    current = None if base is None else int(base)
    out = {}
    for iteration in iterations:
        current = by_iteration.get(iteration, current)
        out[iteration] = current
    return out


def sealed_scores(store: Any, campaign: str) -> pd.DataFrame:
    """Greedy rewards of every measured version on the sealed splits (test, transfer, broad), one row a
    problem, version and split, with the broad set's level and source."""
    frame = store.query(
        """SELECT e.model_version, e.env, e.split, e.problem_id, any_value(e.reward) AS reward,
                  any_value(b.level) AS level, any_value(b.source) AS source
           FROM evals e LEFT JOIN broad_sealed b ON b.campaign = e.campaign AND b.problem_id = e.problem_id
           WHERE e.campaign = ? AND e.sample = 0 AND e.split IN ('test', 'transfer', 'broad') GROUP BY ALL""",
        [campaign])
    # a broad problem that is also in the sealed transfer split is answered once, stored under 'transfer'
    # (tasks/evaluate.py: evaluate_sealed): the broad set is every answer to one of its problems
    broad = frame[frame["source"].notna()].drop_duplicates(["model_version", "problem_id"]).assign(split="broad")
    return pd.concat([frame[frame["split"] != "broad"], broad], ignore_index=True)


def pass1(scores: pd.DataFrame, version: int | None, split: str) -> float | None:
    part = scores[(scores["model_version"] == version) & (scores["split"] == split)]
    return float(part["reward"].mean()) if len(part) else None


def late_gain(scores: pd.DataFrame, before: int | None, after: int | None, split: str = "broad",
              samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any] | None:
    """pass@1 of ``after`` minus ``before`` on the problems of ``split`` both answered, with a 95% paired
    bootstrap interval stratified by level and source (the broad set's strata; one stratum elsewhere)."""
    from evertrain.stats import bootstrap_means, percentile_interval

    if before is None or after is None:
        return None
    part = scores[scores["split"] == split]
    paired = part.pivot_table(index="problem_id", columns="model_version", values="reward", aggfunc="first")
    if before not in paired or after not in paired:
        return None
    paired = paired[list(dict.fromkeys([before, after]))].dropna()  # one column when no champion followed
    if paired.empty:
        return None
    strata = part.drop_duplicates("problem_id").set_index("problem_id").reindex(paired.index)
    labels = (strata["source"].fillna("-").astype(str) + ":" + strata["level"].fillna(-1).astype(int).astype(str))
    diff = (paired[after] - paired[before]).to_numpy(dtype=float)
    # the same champion at both ends: the gain is exactly 0 (no bootstrap over a constant)
    means = bootstrap_means(diff, labels.to_numpy(), samples, seed) if diff.any() else np.zeros(1)
    low, high = percentile_interval(means)
    return {"split": split, "before_version": before, "after_version": after, "problems": len(diff),
            "before_pass1": float(paired[before].mean()), "after_pass1": float(paired[after].mean()),
            "gain": float(diff.mean()), "gain_low": low, "gain_high": high, "p_gain_above_0": float((means > 0).mean()),
            "improved": int((diff > 0).sum()), "worsened": int((diff < 0).sum())}


def by_level(scores: pd.DataFrame, version: int | None) -> dict[str, float]:
    """Broad sealed pass@1 of ``version`` per level (and 'transfer')."""
    part = scores[(scores["model_version"] == version) & (scores["split"] == "broad")]
    out = {}
    for (source, level), group in part.groupby([part["source"].fillna("-"), part["level"].fillna(-1)]):
        key = f"{group['env'].iloc[0]}:{'level ' + str(int(level)) if source == 'level' else source}"
        out[key] = float(group["reward"].mean())
    return out


def measure_trainee(config_path: str, sets: list[str], campaign: str) -> tuple[int, pd.DataFrame]:
    """The campaign's last trainee (what the loop trained last, promoted or not) answering the broad sealed set,
    greedily, by the campaign's own evaluation code (tasks/evaluate.py), after the campaign has stopped: the
    store is opened for writing, and nothing is written to it. Its version and its rows."""
    from evertrain.config import load_config
    from evertrain.curriculum import broad_problems
    from evertrain.runtime import Runtime
    from evertrain.tasks.evaluate import evaluate_version

    config = load_config(config_path, sets)
    if config.name != campaign:
        config = config.model_copy(update={"name": campaign})
    with Runtime.open(config) as rt:  # closed (the campaign's claim released) before a reader opens the files
        state = rt.store.campaign_state(rt.campaign) or {}
        version = state.get("trainee_version")
        if version is None:
            raise SystemExit(f"campaign {campaign!r} has no trainee recorded")
        problems = broad_problems(rt)
        last = int(rt.store.scalar("SELECT max(iteration) FROM stage_runs WHERE campaign = ?", [rt.campaign]))
        rows, _ = evaluate_version(rt, int(version), problems, last, "sealed")
        frame = pd.DataFrame(rows)
        frame = frame[frame["sample"] == 0][["model_version", "env", "problem_id", "reward"]]
        levels = rt.store.query("SELECT problem_id, level, source FROM broad_sealed WHERE campaign = ?", [rt.campaign])
        return int(version), frame.merge(levels, on="problem_id").assign(split="broad")


def curve(store: Any, campaign: str) -> tuple[list[dict[str, Any]], pd.DataFrame, dict[int, int | None]]:
    from evertrain.curriculum import levels_over_iterations
    from evertrain.data.lineage import diversity

    stages = store.query("SELECT iteration, sum(coalesce(cpu_s, 0)) AS cpu_s, sum(coalesce(wall_s, 0)) AS wall_s, "
                         "bool_and(status = 'completed') AS done FROM stage_runs WHERE campaign = ? "
                         "GROUP BY iteration ORDER BY iteration", [campaign])
    if stages.empty:
        raise SystemExit(f"campaign {campaign!r} has no stage runs in this store")
    iterations = [int(i) for i in stages["iteration"]]
    held = champions(store, campaign, iterations)
    scores = sealed_scores(store, campaign)
    levels: dict[int, dict[str, int]] = {}
    for row in levels_over_iterations(store, campaign):
        levels.setdefault(int(row["iteration"]), {})[row["env"]] = int(row["level"])
    diverse = {r["iteration"]: r for r in diversity(store, campaign)}
    # why a group carries no signal: every sample failed, or every sample passed
    groups = store.query(
        """SELECT iteration, avg(mean) AS mean_reward, avg((hi = 0)::INTEGER) AS all_failed_share,
                  avg((lo > 0 AND lo = hi)::INTEGER) AS all_passed_share
           FROM (SELECT iteration, problem_id, avg(reward) AS mean, min(reward) AS lo, max(reward) AS hi
                 FROM rollouts WHERE campaign = ? AND reward IS NOT NULL GROUP BY iteration, problem_id)
           GROUP BY iteration""", [campaign])
    outcome = {int(r.iteration): r for r in groups.itertuples(index=False)}
    promoted = dict(store.query("SELECT iteration, promoted FROM promotions WHERE campaign = ?",
                                [campaign]).itertuples(index=False))
    rows, cpu, wall = [], 0.0, 0.0
    for r in stages.itertuples(index=False):
        it = int(r.iteration)
        cpu += float(r.cpu_s)
        wall += float(r.wall_s)
        d, o = diverse.get(it, {}), outcome.get(it)
        rows.append({"iteration": it, "completed": bool(r.done), "cpu_minutes": cpu / 60,
                     "wall_minutes": wall / 60, "champion_version": held[it],
                     "promoted": None if it not in promoted else bool(promoted[it]),
                     "broad_pass1": pass1(scores, held[it], "broad"),
                     "test_pass1": pass1(scores, held[it], "test"),
                     "transfer_pass1": pass1(scores, held[it], "transfer"),
                     "levels": levels.get(it, {}), "informative_share": d.get("informative_share"),
                     "distinct_completions": d.get("distinct_completions"), "token_entropy": d.get("token_entropy"),
                     "mean_reward": None if o is None else float(o.mean_reward),
                     "all_failed_share": None if o is None else float(o.all_failed_share),
                     "all_passed_share": None if o is None else float(o.all_passed_share)})
    return rows, scores, held


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["cpu_minutes"] for r in rows]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    for key, label in (("broad_pass1", "broad sealed"), ("test_pass1", "sealed test"),
                       ("transfer_pass1", "sealed transfer")):
        ys = [r[key] for r in rows]
        if any(y is not None for y in ys):
            ax.step(x, [np.nan if y is None else y for y in ys], where="post", marker="o", ms=3, label=label)
    ax.set_ylabel("champion pass@1 (greedy)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[0][1]
    envs = sorted({env for r in rows for env in r["levels"]})
    for env in envs:
        ax.step(x, [r["levels"].get(env, np.nan) for r in rows], where="post", marker="o", ms=3, label=env)
    ax.set_ylabel("curriculum level")
    if envs:
        ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(x, [np.nan if r["informative_share"] is None else r["informative_share"] for r in rows], marker="o", ms=3)
    ax.set_ylabel("informative-group share")
    ax.set_ylim(0, 1)
    ax = axes[1][1]
    ax.plot(x, [np.nan if r["distinct_completions"] is None else r["distinct_completions"] for r in rows],
            marker="o", ms=3)
    ax.set_ylabel("distinct completions per group")
    for ax in axes[1]:
        ax.set_xlabel("cumulative CPU-minutes (all stages)")
    for ax in (a for pair in axes for a in pair):
        ax.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=os.environ.get("EVERTRAIN_STORE"),
                        help="the campaign's store URI (default: $EVERTRAIN_STORE)")
    parser.add_argument("--campaign", default="long")
    parser.add_argument("--from-iteration", type=int, default=6,
                        help="the late gain is measured from the champion in effect after this iteration")
    parser.add_argument("--results-name", default="long")
    parser.add_argument("--results-dir", default=None, help="where to write (default: benchmarks/results)")
    parser.add_argument("--measure-trainee", metavar="CONFIG", default=None,
                        help="also measure the last trainee (promoted or not) on the broad sealed set, with the "
                        "campaign's config (after the campaign has stopped; paths from --set or the environment)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --measure-trainee: config overrides, as `evertrain run --set`")
    args = parser.parse_args()
    if not args.store:
        parser.error("--store is required (or set EVERTRAIN_STORE)")
    from benchmarks.common import RESULTS, machine, save
    from evertrain.data.store import Store

    trainee = None
    if args.measure_trainee:  # before the read-only store is opened: the context opens it for writing (and closes it)
        os.environ["EVERTRAIN_STORE"] = args.store
        trainee, trainee_rows = measure_trainee(args.measure_trainee, args.set, args.campaign)
    store = Store(args.store, read_only=True)
    rows, scores, held = curve(store, args.campaign)
    last = rows[-1]["iteration"]
    if args.from_iteration not in held:
        raise SystemExit(f"iteration {args.from_iteration} has not run (last: {last})")
    before, after = held[args.from_iteration], held[last]
    gains = {split: late_gain(scores, before, after, split) for split in ("broad", "test", "transfer")}
    base = store.scalar("SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'",
                        [args.campaign])
    from_base = late_gain(scores, None if base is None else int(base), after, "broad")
    if trainee is not None:
        theirs = trainee_rows.assign(model_version=-trainee)  # apart from the same version's stored rows
        scores = pd.concat([scores, theirs], ignore_index=True)
        gains["trainee_broad"] = late_gain(scores, before, -trainee, "broad")
        if gains["trainee_broad"]:
            gains["trainee_broad"]["after_version"] = trainee
    refusals = store.records("SELECT iteration, reason FROM promotions WHERE campaign = ? AND NOT promoted "
                             "ORDER BY iteration", [args.campaign])
    payload = {
        "campaign": args.campaign, "iterations": len(rows), "last_iteration": last,
        "from_iteration": args.from_iteration, "late_gain": gains["broad"], "late_gain_by_split": gains,
        "gain_over_base_broad": from_base, "broad_by_level": {
            "from": by_level(scores, before), "last": by_level(scores, after),
            "base": by_level(scores, None if base is None else int(base))},
        "cpu_minutes": rows[-1]["cpu_minutes"], "wall_minutes": rows[-1]["wall_minutes"],
        "refusals": refusals, "curve": rows,
    }
    out_dir = Path(args.results_dir) if args.results_dir else RESULTS
    if args.results_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{args.results_name}.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "machine": machine(), **payload}, indent=2, default=str) + "\n")
    else:
        save(args.results_name, payload)
    plot(out_dir / f"{args.results_name}.png", rows, f"campaign {args.campaign}: {len(rows)} iterations")
    for r in rows:
        print(f"i={r['iteration']:>2} cpu {r['cpu_minutes']:6.1f} min  champion v{r['champion_version']}  broad "
              f"{_f(r['broad_pass1'])}  test {_f(r['test_pass1'])}  transfer {_f(r['transfer_pass1'])}  levels "
              f"{r['levels']}  reward {_f(r['mean_reward'])}  informative {_f(r['informative_share'])} (all failed "
              f"{_f(r['all_failed_share'])}, all passed {_f(r['all_passed_share'])})  distinct "
              f"{_f(r['distinct_completions'])}")
    g = gains["broad"]
    if g:
        print(f"late gain (broad sealed, champion after iteration {args.from_iteration} v{before} -> v{after}): "
              f"{g['gain']:+.3f} [95% CI {g['gain_low']:+.3f}, {g['gain_high']:+.3f}] on {g['problems']} problems")
    else:
        print("late gain: not measurable (no broad sealed rows for both champions)")


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
