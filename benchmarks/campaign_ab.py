"""Two or more finished campaigns of one task, measured on the same held-out problems: an A/B of a change.

Each campaign's own sealed sets depend on its settings (the broad sealed set is drawn from its ladder's levels), so
two campaigns that differ in their curriculum cannot be compared on their own reports. This measures every run's
delivered champion and last trainee, and the base model once, greedily with the campaign's own evaluation code
(tasks/evaluate.py), on one set of problems that no run trained on or gated on:

- ``held``: ``--held N`` problems of the configured generator's held-out pool after the sealed test split (what
  ``benchmarks/trainee_gain.py --extra`` measures: the gate and the sealed splits come before them);
- ``level-K``: ``--per-level N`` fresh problems of every other curriculum level (the current ladder's), drawn with
  a seed of their own, minus any problem a run trained on or its gate compared on;
- ``transfer``: ``--transfer N`` problems of the sealed transfer split (phrasings never trained on).

Every run must have the same environments (the problems are built from the first run's config). Answers a run's
store already holds for a version and problem are reused; the rest are generated and kept only in the results
file. Gains are paired over problems with a 95% bootstrap interval stratified by set, as the gate's::

    python benchmarks/campaign_ab.py --run base=/scratch/base:long.toml --run easy=/scratch/easy:long.toml \\
        --held 200 --per-level 50 --transfer 60 --results-name long_easy_level

(``NAME=DIR:CONFIG``: the run's working directory and its config, relative to it.) Writes
benchmarks/results/<name>.json with every problem's rewards.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def inside(directory: Path) -> Any:
    """Work in ``directory`` (a campaign's relative paths: its store, MLflow, checkpoints)."""
    here = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(here)


def parse_run(text: str) -> tuple[str, Path, str]:
    name, sep, rest = text.partition("=")
    directory, colon, config = rest.rpartition(":")
    if not sep or not colon or not name or not directory or not config:
        raise argparse.ArgumentTypeError(f"--run {text!r}: expected NAME=DIR:CONFIG")
    if not Path(directory).is_dir():
        raise argparse.ArgumentTypeError(f"--run {text!r}: {directory} is not a directory")
    return name, Path(directory).resolve(), config


def common_problems(rt: Any, held: int, per_level: int, transfer: int, exclude: set[str]) -> dict[str, list[Any]]:
    """The sets every run is measured on (see the module's doc), built from one run's config."""
    from benchmarks.trainee_gain import extra_problems
    from evertrain.curriculum import cached_ladder
    from evertrain.runtime import seed_for

    config, sets = rt.config, {}
    sets["held"] = extra_problems(rt, held) if held else []
    for spec in config.environments:
        env, gate = rt.env(spec.name), config.held_out_size(spec.name)
        ladder = cached_ladder(env)
        if ladder is not None and per_level:
            for level in range(ladder.levels):
                if level == ladder.start:
                    continue  # the configured generator: its held-out pool is "held"
                drawn = ladder.broad(level, 2 * per_level, seed_for(config.seed, "campaign-ab", spec.name, level))
                fresh = [replace(p, split="test") for p in drawn if p.id not in exclude][:per_level]
                sets.setdefault(f"level-{level}", []).extend(fresh)
        if transfer:
            sets.setdefault("transfer", []).extend(env.sealed_problems("transfer", transfer, config.seed, gate))
    return {name: problems for name, problems in sets.items() if problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", type=parse_run, required=True, metavar="NAME=DIR:CONFIG",
                        help="a finished campaign: its working directory and config (repeatable, at least 2)")
    parser.add_argument("--held", type=int, default=200, help="configured-level problems after the sealed test split")
    parser.add_argument("--per-level", type=int, default=50, help="fresh problems of every other curriculum level")
    parser.add_argument("--transfer", type=int, default=60, help="problems of the sealed transfer split")
    parser.add_argument("--results-name", required=True, help="write benchmarks/results/<name>.json")
    args = parser.parse_args()
    if len(args.run) < 2 or len({name for name, _, _ in args.run}) != len(args.run):
        parser.error("give at least two --run, with different names")
    if min(args.held, args.per_level, args.transfer) < 0:
        parser.error("--held, --per-level and --transfer must be 0 or more")
    from benchmarks.common import print_table, save
    from benchmarks.trainee_gain import paired
    from evertrain.config import load_config
    from evertrain.runtime import Runtime
    from evertrain.tasks.evaluate import eval_problems, evaluate_version

    # what any run trained on or gated on is left out of the fresh levels
    exclude: set[str] = set()
    runs: dict[str, dict[str, Any]] = {}
    for name, directory, config_path in args.run:
        with inside(directory), Runtime.open(load_config(config_path, [])) as rt:
            exclude |= set(rt.store.query("SELECT DISTINCT problem_id FROM problems WHERE campaign = ?",
                                          [rt.campaign])["problem_id"])
            exclude |= {p.id for p in eval_problems(rt)}
            state = rt.store.campaign_state(rt.campaign) or {}
            cpu = rt.store.scalar("SELECT coalesce(sum(cpu_s), 0) / 60 FROM stage_runs WHERE campaign = ?",
                                  [rt.campaign])
            iterations = rt.store.scalar("SELECT count(DISTINCT iteration) FROM stage_runs WHERE campaign = ? AND "
                                         "stage = 'promote' AND status = 'completed'", [rt.campaign])
            runs[name] = {"dir": str(directory), "config": config_path, "campaign": rt.campaign,
                          "champion": rt.champion_version(), "trainee": state.get("trainee_version"),
                          "cpu_minutes": float(cpu), "iterations": int(iterations)}
    _, directory, config_path = args.run[0]
    with inside(directory), Runtime.open(load_config(config_path, [])) as rt:
        sets = common_problems(rt, args.held, args.per_level, args.transfer, exclude)
    print("sets: " + ", ".join(f"{name} {len(problems)}" for name, problems in sets.items()))
    frames, models = [], {}
    for index, (name, directory, config_path) in enumerate(args.run):
        versions = {"champion": runs[name]["champion"], "trainee": runs[name]["trainee"]}
        if index == 0:
            versions = {"base": 1, **versions}
        with inside(directory), Runtime.open(load_config(config_path, [])) as rt:
            for role, version in versions.items():
                if version is None or (role == "trainee" and version == versions["champion"]):
                    continue
                label = "base" if role == "base" else f"{name} {role} v{int(version)}"
                models[label] = {"run": name, "role": role, "version": int(version)}
                for set_name, problems in sets.items():
                    rows, _ = evaluate_version(rt, int(version), problems, -1, "sealed")
                    frame = pd.DataFrame(rows)
                    frame = frame[frame["sample"] == 0][["problem_id", "reward"]]
                    frames.append(frame.assign(model_version=label, set=set_name))
                print(f"measured {label}", file=sys.stderr)
    answers = pd.concat(frames)
    table = []
    for label in models:
        mine = answers[answers["model_version"] == label]
        row = {"model": label, "all": float(mine["reward"].mean())}
        row.update({name: float(mine[mine["set"] == name]["reward"].mean()) for name in sets})
        table.append(row)
    print_table(table, ["model", "all", *sets])
    comparisons = {}
    names = [name for name, _, _ in args.run]
    labels = list(models)
    for label in labels[1:]:
        comparisons[f"{label} - base"] = paired(answers, "base", label)
    for role in ("champion", "trainee"):
        mine = {models[label]["run"]: label for label in labels if models[label]["role"] == role}
        for other in names[1:]:
            if names[0] in mine and other in mine:
                comparisons[f"{mine[other]} - {mine[names[0]]}"] = paired(answers, mine[names[0]], mine[other])
    print_table([{"comparison": key, "problems": r["problems"],
                  "gain [95% CI]": f"{r['gain']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]",
                  "P(gain <= 0)": f"{r['p_gain_at_most_0']:.3f}"} for key, r in comparisons.items()],
                ["comparison", "problems", "gain [95% CI]", "P(gain <= 0)"])
    rewards = answers.pivot_table(index=["set", "problem_id"], columns="model_version", values="reward")
    save(args.results_name, {
        "runs": runs, "models": models, "sets": {name: len(problems) for name, problems in sets.items()},
        "pass1": table, "comparisons": comparisons,
        "per_problem": [{"set": s, "problem_id": pid, **{label: float(row[label]) for label in models}}
                        for (s, pid), row in rewards.dropna().iterrows()],
    })


if __name__ == "__main__":
    main()
