"""A campaign's last trainee against the base model on its held-out tasks: greedy pass@1, paired, 95% interval.

The gate ships a champion only when it is sure (``promotion.confidence``); this measures what the loop learned
whether or not the gate passed it, with the campaign's own evaluation code (tasks/evaluate.py): the base model
(version 1) and the last trainee answer the sealed test split greedily (never curated, never gated), and the gate's
stored answers of the last gate for both versions are added (never trained on either). Paired bootstrap over
problems. Run it in the campaign's working directory after the campaign has stopped (the store is opened for
writing; nothing is written)::

    python benchmarks/trainee_gain.py --config configs/terminal.toml --results-name terminal

Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 20261202


def paired(frame: pd.DataFrame, before: int, after: int, rng: np.random.Generator) -> dict[str, float | list[float]]:
    """Gain of ``after`` over ``before`` on the problems both answered, with a 95% bootstrap interval."""
    wide = frame.pivot_table(index="problem_id", columns="model_version", values="reward").dropna()
    a, b = wide[before].to_numpy(), wide[after].to_numpy()
    diffs = b - a
    boots = np.array([diffs[rng.integers(0, len(diffs), len(diffs))].mean() for _ in range(BOOTSTRAP_SAMPLES)])
    low, high = np.percentile(boots, [2.5, 97.5])
    return {"problems": len(diffs), "base_pass1": float(a.mean()), "trainee_pass1": float(b.mean()),
            "gain": float(diffs.mean()), "ci95": [float(low), float(high)],
            "p_gain_at_most_0": float(np.mean(boots <= 0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the campaign's config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--results-name", required=True, help="write benchmarks/results/<name>.json")
    args = parser.parse_args()
    from benchmarks.common import print_table, save
    from evertrain.config import load_config
    from evertrain.runtime import Runtime
    from evertrain.tasks.evaluate import evaluate_version, sealed_problems

    config = load_config(args.config, args.set)
    with Runtime.open(config) as rt:
        state = rt.store.campaign_state(rt.campaign) or {}
        if state.get("trainee_version") is None:
            raise SystemExit(f"campaign {rt.campaign!r} has no trainee recorded")
        trainee = int(state["trainee_version"])
        last = rt.store.scalar("SELECT max(iteration) FROM evals WHERE campaign = ? AND split = 'gate'", [rt.campaign])
        problems = [p for p in sealed_problems(rt) if p.split == "test"]
        frames = []
        for version in (1, trainee):
            rows, _ = evaluate_version(rt, version, problems, int(last or 0), "sealed")
            frame = pd.DataFrame(rows)
            frames.append(frame[frame["sample"] == 0][["model_version", "problem_id", "reward"]])
        gate = rt.store.query("SELECT model_version, problem_id, reward FROM evals WHERE campaign = ? AND "
                              "split = 'gate' AND sample = 0 AND iteration = ? AND model_version IN (1, ?)",
                              [rt.campaign, last, trainee])
        cpu = rt.store.scalar("SELECT sum(cpu_s) / 60 FROM stage_runs WHERE campaign = ?", [rt.campaign])
        iterations = rt.store.scalar("SELECT count(DISTINCT iteration) FROM stage_runs WHERE campaign = ? AND "
                                     "stage = 'promote' AND status = 'completed'", [rt.campaign])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    sealed = pd.concat(frames)
    results = {name: paired(frame, 1, trainee, rng) for name, frame in
               (("sealed_test", sealed), ("gate", gate), ("held_out", pd.concat([sealed, gate])))}
    print_table([{"tasks": name, "problems": r["problems"], "base": f"{r['base_pass1']:.3f}",
                  "trainee": f"{r['trainee_pass1']:.3f}",
                  "gain [95% CI]": f"{r['gain']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]",
                  "P(gain <= 0)": f"{r['p_gain_at_most_0']:.3f}"} for name, r in results.items()],
                ["tasks", "problems", "base", "trainee", "gain [95% CI]", "P(gain <= 0)"])
    save(args.results_name, {"campaign": config.name, "trainee_version": trainee, "last_gate_iteration": last,
                             "iterations_completed": iterations, "campaign_cpu_minutes": cpu,
                             "bootstrap_samples": BOOTSTRAP_SAMPLES, "bootstrap_seed": BOOTSTRAP_SEED, **results})


if __name__ == "__main__":
    main()
