"""Stage 1, curate: choose this iteration's training problems from the campaign's environments.

The draw is seeded by (campaign seed, iteration, environment), so rerunning curate for an iteration
chooses the same problems. Each environment's share follows its weight. Problems that also appear
in any environment's held-out set are dropped (decontamination by id), as are duplicates.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.data.store import now, to_json
from evertrain.runtime import Runtime, get_runtime, seed_for
from evertrain.tasks.base import allocate, run_stage


def curate(rt: Runtime, iteration: int) -> dict[str, Any]:
    config = rt.config
    shares = allocate(config.problems_per_iteration, [spec.weight for spec in config.environments])
    held_out = {p.id for spec in config.environments
                for p in rt.env(spec.name).problems("eval", config.eval.problems_per_env, config.seed)}
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"dropped_held_out": 0, "dropped_duplicate": 0}
    seen: set[str] = set()
    for spec, share in zip(config.environments, shares, strict=True):
        env = rt.env(spec.name)
        candidates = env.problems("train", share, seed_for(config.seed, iteration, spec.name)) if share else []
        kept = 0
        for problem in candidates:
            if problem.id in held_out:
                metrics["dropped_held_out"] += 1
                continue
            if problem.id in seen:
                metrics["dropped_duplicate"] += 1
                continue
            seen.add(problem.id)
            kept += 1
            rows.append({
                "campaign": rt.campaign, "iteration": iteration, "problem_id": problem.id, "env": env.name,
                "split": problem.split, "prompt": problem.prompt, "payload": to_json(problem.payload),
                "messages": to_json(env.messages(problem)), "created_at": now(),
            })
        metrics[f"problems_{spec.name}"] = kept
    rt.store.replace("problems", {"campaign": rt.campaign, "iteration": iteration}, rows)
    metrics["problems"] = len(rows)
    return metrics


@task(name="curate", cache_policy=NO_CACHE)
def curate_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "curate", iteration, curate)
