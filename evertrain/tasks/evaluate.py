"""Stage 5, evaluate: challenger and champion answer the same held-out problems, greedily.

A model version's answers to a held-out problem never change (greedy decoding, fixed eval set), so a
version that was already evaluated, typically the champion, reuses its earlier rows instead of being
run again: each iteration usually costs one evaluation, not two.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.data.store import StoreError, now
from evertrain.envs.base import Problem
from evertrain.models.policy import encode_chat, load_policy, sample
from evertrain.runtime import Runtime, get_runtime
from evertrain.scoring import pop_sandbox_runs, verify_many
from evertrain.tasks.base import progress, run_stage


def eval_problems(rt: Runtime) -> list[Problem]:
    """The campaign's fixed held-out set: the first ``eval.problems_per_env`` of every environment."""
    config = rt.config
    return [p for spec in config.environments
            for p in rt.env(spec.name).problems("eval", config.eval.problems_per_env, config.seed)]


def challenger_of(rt: Runtime, iteration: int) -> int:
    frame = rt.store.query("SELECT version FROM model_versions WHERE campaign = ? AND iteration = ?",
                           [rt.campaign, iteration])
    if frame.empty:
        raise StoreError(f"iteration {iteration} has no challenger: run the update stage first")
    return int(frame["version"].iloc[0])


def champion_of(rt: Runtime, iteration: int) -> int:
    """The champion that iteration ``iteration`` is judged against (stable when a stage is rerun)."""
    decided = rt.store.query("SELECT champion_version FROM promotions WHERE campaign = ? AND iteration = ?",
                             [rt.campaign, iteration])
    if not decided.empty:
        return int(decided["champion_version"].iloc[0])
    return rt.champion_version()


def evaluate_version(rt: Runtime, version: int, problems: list[Problem], iteration: int, role: str,
                     ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Eval rows of ``version`` on ``problems``: reused where this version answered before, else generated."""
    config = rt.config
    ids = [p.id for p in problems]
    earlier = rt.store.query(
        """SELECT * FROM evals WHERE campaign = ? AND model_version = ? AND iteration <> ? AND sample = 0
           AND problem_id IN (SELECT unnest(?::VARCHAR[]))
           QUALIFY row_number() OVER (PARTITION BY problem_id ORDER BY iteration DESC) = 1""",
        [rt.campaign, version, iteration, ids],
    )
    reused = {row["problem_id"]: row for row in earlier.to_dict("records")}
    stamp = now()
    rows = [{**reused[p.id], "iteration": iteration, "role": role, "reused_from": reused[p.id]["iteration"],
             "created_at": stamp} for p in problems if p.id in reused]
    todo = sorted((p for p in problems if p.id not in reused), key=lambda p: p.env)
    stats = {"generated": float(len(todo)), "reused": float(len(rows)), "completion_tokens": 0.0, "model_s": 0.0}
    if todo:
        model, tokenizer = load_policy(rt.checkpoint(version), dtype=getattr(torch, config.model.rollout_dtype),
                                       device=config.model.device)
        began = time.perf_counter()
        completions = []
        with progress(len(todo), f"evaluate i={iteration} v{version}", "problem") as bar:
            for env in sorted({p.env for p in todo}):
                batch = [p for p in todo if p.env == env]
                groups, sampling = sample(
                    model, tokenizer, [encode_chat(tokenizer, rt.env(env).messages(p)) for p in batch], 1,
                    greedy=True, batch_size=config.generation.batch_size,
                    max_new_tokens=config.max_new_tokens(env, evaluation=True), progress=bar,
                )
                completions += [group[0] for group in groups]
                stats["completion_tokens"] += sampling.completion_tokens
        stats["model_s"] = time.perf_counter() - began
        verdicts = verify_many([(rt.env(p.env), p, c.text) for p, c in zip(todo, completions, strict=True)])
        audit = [{**row, "campaign": rt.campaign, "iteration": iteration}
                 for v in verdicts for row in pop_sandbox_runs(v)]
        if audit:
            rt.store.append("sandbox_runs", audit)
        stats["sandbox_runs"] = float(len(audit))
        for p, c, v in zip(todo, completions, verdicts, strict=True):
            rows.append({
                "campaign": rt.campaign, "iteration": iteration, "model_version": version, "role": role,
                "problem_id": p.id, "sample": 0, "env": p.env, "completion": c.text,
                "completion_tokens": len(c.completion_ids), "reward": v.reward, "passed": v.passed,
                "reason": v.reason, "reused_from": None, "created_at": stamp,
            })
    return rows, stats


def evaluate(rt: Runtime, iteration: int) -> dict[str, Any]:
    problems = eval_problems(rt)
    challenger, champion = challenger_of(rt, iteration), champion_of(rt, iteration)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"challenger_version": challenger, "champion_version": champion,
                               "eval_problems": len(problems)}
    roles = [("challenger", challenger)] + ([("champion", champion)] if champion != challenger else [])
    for role, version in roles:
        version_rows, stats = evaluate_version(rt, version, problems, iteration, role)
        rows += version_rows
        for key, value in stats.items():
            metrics[f"{role}_{key}"] = value
    frame = pd.DataFrame(rows)
    rt.store.replace("evals", {"campaign": rt.campaign, "iteration": iteration}, frame)
    for role, version in roles:
        mine = frame[frame["model_version"] == version]
        metrics[f"pass1_{role}"] = float(mine["reward"].mean())
        for env, rewards in mine.groupby("env")["reward"]:
            metrics[f"pass1_{role}_{env}"] = float(rewards.mean())
    if champion == challenger:
        metrics["pass1_champion"] = metrics["pass1_challenger"]
    return metrics


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "evaluate", iteration, evaluate)
