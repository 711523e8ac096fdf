"""A campaign's last trainee against the base model on held-out tasks: greedy pass@1, paired, 95% interval.

The gate ships a champion only when it is sure (``promotion.confidence``); this measures what the loop learned
whether or not the gate passed it, with the campaign's own evaluation code (tasks/evaluate.py). The base model
(version 1) and the trainee answer greedily, on three sets of tasks that training never saw:

- ``gate``: the gate's held-out set (curation keeps it out of training);
- ``sealed_test``: the sealed test split (never curated, never gated);
- ``broad``: the campaign's broad sealed set (``curriculum.broad_per_level``: every level, drawn once), if any;
- ``extra``: with ``--extra N``, the next ``N`` problems of the sealed test split's pool: problems nothing in
  the campaign ever drew, for more power where an environment generates held-out problems without end (the
  terminal's ``held_out = "generated"``). Refused where a larger draw would not keep the sealed split as its
  prefix.

Answers the store already holds for a version and problem (the gate's, the sealed split's) are reused, as the
gate reuses them; the rest are generated and kept only in the results file (the store is opened for writing,
nothing is written to it). The gain's interval is a paired bootstrap over problems, stratified by set
(``evertrain.stats.bootstrap_means``, the gate's). Run it in the campaign's working directory after the
campaign has stopped::

    python benchmarks/trainee_gain.py --config configs/terminal.toml --extra 78 --results-name terminal

``--baseline V`` measures against version V instead of the base model, e.g. whether the gate saw what fresh
problems see when it refused a trainee against its champion. ``--config`` also takes a JSON config, such as
the ``config`` of a ``benchmarks/vs_trl.py`` worker's result (``<scratch>/seed-N/evertrain.json``)::

    python benchmarks/trainee_gain.py --config vs_s0_config.json --baseline 3 --trainee 10 --extra 420 \
        --results-name gate_vs_fresh_v10

Writes benchmarks/results/<name>.json with every problem's two rewards, so intervals can be recomputed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 20261202


def paired(frame: pd.DataFrame, before: int, after: int) -> dict[str, Any]:
    """Gain of ``after`` over ``before`` on ``frame``'s problems (columns: set, problem_id, model_version,
    reward), with a 95% bootstrap interval stratified by ``set``."""
    from evertrain.stats import bootstrap_means, percentile_interval

    wide = frame.pivot_table(index=["set", "problem_id"], columns="model_version", values="reward").dropna()
    a, b = wide[before].to_numpy(), wide[after].to_numpy()
    diffs = b - a
    means = bootstrap_means(diffs, wide.index.get_level_values("set").to_numpy(), BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
    low, high = percentile_interval(means)
    return {"problems": len(diffs), "base_pass1": float(a.mean()), "trainee_pass1": float(b.mean()),
            "gain": float(diffs.mean()), "ci95": [float(low), float(high)],
            "p_gain_at_most_0": float(np.mean(means <= 0))}


def extra_problems(rt: Any, n: int) -> list[Any]:
    """The ``n`` problems after each environment's sealed test split in its pool (see the module's doc)."""
    from dataclasses import replace

    config, out = rt.config, []
    for spec in config.environments:
        env, size, gate = rt.env(spec.name), config.sealed_size(spec.name), config.held_out_size(spec.name)
        sealed = env.sealed_problems("test", size, config.seed, gate)
        larger = env.sealed_problems("test", size + n, config.seed, gate)
        if [p.id for p in larger[:len(sealed)]] != [p.id for p in sealed]:
            raise SystemExit(f"--extra: environment {spec.name!r} draws a different sealed split when asked for "
                             "more, so its extra problems could overlap it; measure without --extra")
        out += [replace(p, split="test") for p in larger[len(sealed):]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the campaign's config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--extra", type=int, default=0, metavar="N",
                        help="also N never-drawn problems after each environment's sealed test split")
    parser.add_argument("--trainee", type=int, default=None, help="the version to measure (default: the trainee)")
    parser.add_argument("--baseline", type=int, default=1,
                        help="the version it is measured against (default 1, the base model), e.g. a champion")
    parser.add_argument("--results-name", required=True, help="write benchmarks/results/<name>.json")
    args = parser.parse_args()
    if args.extra < 0:
        parser.error("--extra must be 0 or more")
    from benchmarks.common import print_table, save
    from evertrain.config import load_config
    from evertrain.curriculum import broad_problems
    from evertrain.runtime import Runtime
    from evertrain.tasks.evaluate import eval_problems, evaluate_version, sealed_problems

    config = load_config(args.config, args.set)
    with Runtime.open(config) as rt:
        state = rt.store.campaign_state(rt.campaign) or {}
        trainee = args.trainee if args.trainee is not None else state.get("trainee_version")
        if trainee is None:
            raise SystemExit(f"campaign {rt.campaign!r} has no trainee recorded")
        trainee, baseline = int(trainee), args.baseline
        if trainee == baseline:
            raise SystemExit(f"--trainee and --baseline are both version {trainee}")
        sets = {"gate": eval_problems(rt), "sealed_test": [p for p in sealed_problems(rt) if p.split == "test"],
                "extra": extra_problems(rt, args.extra), "broad": broad_problems(rt)}
        frames, generated = [], {}
        for version in (baseline, trainee):
            for name, problems in sets.items():
                if not problems:
                    continue
                # iteration -1: no iteration's, so every stored answer of this version is reusable
                rows, stats = evaluate_version(rt, version, problems, -1, "sealed")
                generated[f"v{version} {name}"] = int(stats["generated"])
                frame = pd.DataFrame(rows)
                frame = frame[frame["sample"] == 0][["model_version", "problem_id", "reward"]]
                frames.append(frame.assign(set=name))
        cpu = rt.store.scalar("SELECT sum(cpu_s) / 60 FROM stage_runs WHERE campaign = ?", [rt.campaign])
        iterations = rt.store.scalar("SELECT count(DISTINCT iteration) FROM stage_runs WHERE campaign = ? AND "
                                     "stage = 'promote' AND status = 'completed'", [rt.campaign])
    answers = pd.concat(frames)
    results = {name: paired(answers[answers["set"] == name], baseline, trainee)
               for name in sets if sets[name]}
    results["held_out"] = paired(answers, baseline, trainee)
    print(f"v{trainee} against v{baseline}" + (" (the base model)" if baseline == 1 else ""))
    print_table([{"tasks": name, "problems": r["problems"], "baseline": f"{r['base_pass1']:.3f}",
                  "trainee": f"{r['trainee_pass1']:.3f}",
                  "gain [95% CI]": f"{r['gain']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]",
                  "P(gain <= 0)": f"{r['p_gain_at_most_0']:.3f}"} for name, r in results.items()],
                ["tasks", "problems", "baseline", "trainee", "gain [95% CI]", "P(gain <= 0)"])
    rewards = answers.pivot_table(index=["set", "problem_id"], columns="model_version", values="reward")
    save(args.results_name, {
        "campaign": config.name, "trainee_version": trainee, "baseline_version": baseline,
        "iterations_completed": iterations,
        "campaign_cpu_minutes": cpu, "extra": args.extra, "answers_generated": generated,
        "bootstrap": {"samples": BOOTSTRAP_SAMPLES, "seed": BOOTSTRAP_SEED, "stratified_by": "set"},
        **results,
        "per_problem": [{"set": s, "problem_id": pid, "base": float(row[baseline]), "trainee": float(row[trainee])}
                        for (s, pid), row in rewards.dropna().iterrows()],
    })


if __name__ == "__main__":
    main()
