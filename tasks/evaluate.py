"""Stage 5, evaluate: challenger and champion answer the same held-out problems.

Sample 0 of every problem is greedy: its reward is the pass@1 that the promotion gate compares. With
``eval.samples = n`` each problem also gets n sampled attempts, from which pass@n is estimated with
the unbiased estimator. A model version's answers never change (greedy decoding, a fixed eval set,
seeded sampling), so a version that was already evaluated, typically the champion, reuses its earlier
rows instead of being run again: each iteration usually costs one evaluation, not two.

The challenger is evaluated in ``eval.looks`` slices, each holding a share of every environment's
problems. After each slice but the last, a paired bootstrap against the champion's answers on the
problems so far gives P(challenger not worse); below ``promotion.futility`` the evaluation stops and the
promote stage keeps the champion. Stopping for futility can only reject a challenger, never promote
one, so it does not raise the chance of promoting a worse model; it saves most of the evaluation of
challengers that are clearly worse (a diverged trainee, a broken update).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.data.store import StoreError, now, to_json
from evertrain.envs.base import Problem
from evertrain.models.episodes import sample_episodes
from evertrain.models.policy import encode_chat, load_policy
from evertrain.runtime import Runtime, get_runtime, seed_for
from evertrain.scoring import pop_sandbox_runs, verify_many
from evertrain.tasks.base import progress, run_stage


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n attempts of which c passed (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} attempts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def paired_bootstrap(challenger: np.ndarray, champion: np.ndarray, strata: np.ndarray, samples: int,
                     seed: int) -> dict[str, float]:
    """Gain of challenger over champion on paired per-problem scores, with a stratified bootstrap."""
    diff = challenger.astype(float) - champion.astype(float)
    rng = np.random.default_rng(seed)
    totals = np.zeros(samples)
    for stratum in np.unique(strata):
        values = diff[strata == stratum]
        picks = rng.integers(0, len(values), size=(samples, len(values)))
        totals += values[picks].sum(axis=1)
    means = totals / len(diff)
    return {
        "gain": float(diff.mean()), "p_better": float((means > 0).mean()),
        "p_not_worse": float((means >= 0).mean()),
        "gain_low": float(np.quantile(means, 0.025)), "gain_high": float(np.quantile(means, 0.975)),
    }


def slices(problems: list[Problem], looks: int) -> list[list[Problem]]:
    """``looks`` slices of ``problems``, each holding the same share of every environment's problems."""
    by_env: dict[str, list[Problem]] = {}
    for problem in problems:
        by_env.setdefault(problem.env, []).append(problem)
    out: list[list[Problem]] = [[] for _ in range(looks)]
    for group in by_env.values():
        for look in range(looks):
            out[look] += group[len(group) * look // looks: len(group) * (look + 1) // looks]
    return [part for part in out if part]


def eval_problems(rt: Runtime) -> list[Problem]:
    """The campaign's fixed held-out set: the first ``eval_size(env)`` problems of every environment."""
    config = rt.config
    return [p for spec in config.environments
            for p in rt.env(spec.name).problems("eval", config.eval_size(spec.name), config.seed)]


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


def _attempts(rt: Runtime, model: Any, tokenizer: Any, problems: list[Problem], samples: int,
              version: int, bar: Any) -> list[tuple[Problem, int, Any]]:
    """(problem, sample, episode) for every attempt: greedy sample 0, then ``samples`` sampled ones."""
    config = rt.config
    out: list[tuple[Problem, int, Any]] = []
    for env_name in sorted({p.env for p in problems}):
        env = rt.env(env_name)
        batch = [p for p in problems if p.env == env_name]
        prompts = [encode_chat(tokenizer, env.messages(p)) for p in batch]
        limit = config.max_new_tokens(env_name, evaluation=True)
        greedy, _ = sample_episodes(model, tokenizer, env, batch, prompts, 1, greedy=True, max_new_tokens=limit,
                                    batch_size=config.generation.batch_size, progress=bar)
        out += [(p, 0, g[0]) for p, g in zip(batch, greedy, strict=True)]
        if samples:
            sampled, _ = sample_episodes(
                model, tokenizer, env, batch, prompts, samples, max_new_tokens=limit,
                temperature=config.generation.temperature, top_p=config.generation.top_p,
                batch_size=config.generation.batch_size, seed=seed_for(config.seed, "eval", version, env_name))
            out += [(p, i + 1, e) for p, g in zip(batch, sampled, strict=True) for i, e in enumerate(g)]
    return out


def evaluate_version(rt: Runtime, version: int, problems: list[Problem], iteration: int, role: str,
                     stop: Callable[[list[dict[str, Any]]], str | None] | None = None,
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Eval rows of ``version`` on ``problems``: reused where this version answered before, else generated.

    With ``stop``, the problems are evaluated in ``eval.looks`` slices and ``stop(rows so far)`` is asked
    after each but the last; a reason string ends the evaluation there.
    """
    config = rt.config
    wanted = config.eval.samples + 1
    earlier = rt.store.query(
        """SELECT * FROM evals WHERE campaign = ? AND model_version = ? AND iteration <> ? AND sample < ?
           AND problem_id IN (SELECT unnest(?::VARCHAR[]))
           QUALIFY row_number() OVER (PARTITION BY problem_id, sample ORDER BY iteration DESC) = 1""",
        [rt.campaign, version, iteration, wanted, [p.id for p in problems]],
    )
    complete = earlier.groupby("problem_id")["sample"].nunique()
    reusable = set(complete[complete == wanted].index)
    stamp = now()
    rows = [{**row, "iteration": iteration, "role": role, "reused_from": row["iteration"], "created_at": stamp}
            for row in earlier.to_dict("records") if row["problem_id"] in reusable]
    todo = [p for p in problems if p.id not in reusable]
    stats: dict[str, Any] = {"generated": float(len(todo)), "reused": float(len(reusable)),
                             "completion_tokens": 0.0, "model_s": 0.0, "sandbox_runs": 0.0}
    if not todo:
        return rows, stats
    model, tokenizer = load_policy(rt.checkpoint(version), dtype=getattr(torch, config.model.rollout_dtype),
                                   device=config.model.device)
    parts = slices(todo, config.eval.looks) if stop is not None else [todo]
    with progress(len(todo), f"evaluate i={iteration} v{version}", "problem") as bar:
        for look, part in enumerate(parts):
            rows += _evaluate_part(rt, model, tokenizer, part, version, iteration, role, stamp, bar, stats)
            reason = stop(rows) if stop is not None and look < len(parts) - 1 else None
            if reason:
                stats["generated"] = float(sum(len(done) for done in parts[:look + 1]))
                stats["stopped"] = reason
                break
    return rows, stats


def _evaluate_part(rt: Runtime, model: Any, tokenizer: Any, problems: list[Problem], version: int,
                   iteration: int, role: str, stamp: Any, bar: Any, stats: dict[str, Any]) -> list[dict[str, Any]]:
    began = time.perf_counter()
    attempts = _attempts(rt, model, tokenizer, problems, rt.config.eval.samples, version, bar)
    stats["model_s"] += time.perf_counter() - began
    verdicts = verify_many([(rt.env(p.env), p, e.text) for p, _, e in attempts])
    audit = [{**run, "campaign": rt.campaign, "iteration": iteration}
             for (_, _, e), v in zip(attempts, verdicts, strict=True) for run in e.sandbox_runs + pop_sandbox_runs(v)]
    if audit:
        rt.store.append("sandbox_runs", audit)
    stats["sandbox_runs"] += float(len(audit))
    rows = []
    for (p, index, e), v in zip(attempts, verdicts, strict=True):
        stats["completion_tokens"] += sum(e.loss_mask)
        rows.append({
            "campaign": rt.campaign, "iteration": iteration, "model_version": version, "role": role,
            "problem_id": p.id, "sample": index, "env": p.env, "completion": e.text,
            "completion_tokens": sum(e.loss_mask), "turns": to_json(e.turns), "tool_calls": e.tool_calls,
            "tool_errors": e.tool_errors, "rework": e.rework, "reward": v.reward, "passed": v.passed,
            "reason": v.reason, "reused_from": None, "created_at": stamp,
        })
    return rows


def futility_check(rt: Runtime, iteration: int, champion_rows: list[dict[str, Any]], total: int,
                   ) -> Callable[[list[dict[str, Any]]], str | None]:
    """``stop(challenger rows so far)``: a reason once P(challenger not worse) falls below promotion.futility.

    Ties count as "not worse": a challenger that differs from the champion on a single problem so far is
    no evidence of futility, although every bootstrap mean of its gain is then <= 0.
    """
    rule = rt.config.promotion
    champion = {row["problem_id"]: row["reward"] for row in champion_rows if row["sample"] == 0}

    def stop(rows: list[dict[str, Any]]) -> str | None:
        mine = [row for row in rows if row["sample"] == 0 and row["problem_id"] in champion]
        if not mine:
            return None
        test = paired_bootstrap(np.array([row["reward"] for row in mine]),
                                np.array([champion[row["problem_id"]] for row in mine]),
                                np.array([row["env"] for row in mine]), rule.bootstrap_samples,
                                seed_for(rt.config.seed, iteration, "futility", len(mine)))
        if test["p_not_worse"] >= rule.futility:
            return None
        return (f"stopped for futility after {len(mine)} of {total} problems: gain {test['gain']:+.3f}, "
                f"P(not worse) = {test['p_not_worse']:.3f} < {rule.futility:.3f}")

    return stop


def env_metrics(frame: pd.DataFrame, samples: int) -> dict[str, float]:
    """pass@1 (greedy), pass@k, tool calls, rework and tokens per attempt, for one version on one env."""
    greedy = frame[frame["sample"] == 0]
    metrics = {"pass1": float(greedy["reward"].mean()), "tool_calls": float(frame["tool_calls"].mean()),
               "rework": float(frame["rework"].mean()), "tokens": float(frame["completion_tokens"].mean())}
    if samples:
        sampled = frame[frame["sample"] > 0].groupby("problem_id")["passed"]
        metrics[f"pass{samples}"] = float(sampled.apply(lambda p: pass_at_k(len(p), int(p.sum()), samples)).mean())
        metrics["pass1_sampled"] = float(frame[frame["sample"] > 0]["passed"].mean())
    return metrics


def evaluate(rt: Runtime, iteration: int) -> dict[str, Any]:
    problems = eval_problems(rt)
    challenger, champion = challenger_of(rt, iteration), champion_of(rt, iteration)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"challenger_version": challenger, "champion_version": champion,
                               "eval_problems": len(problems)}
    roles = ([("champion", champion)] if champion != challenger else []) + [("challenger", challenger)]
    for role, version in roles:
        stop = None
        if role == "challenger" and champion != challenger and rt.config.eval.looks > 1 and \
                rt.config.promotion.futility:
            stop = futility_check(rt, iteration, rows, len(problems))
        version_rows, stats = evaluate_version(rt, version, problems, iteration, role, stop)
        rows += version_rows
        if "stopped" in stats:
            metrics["stopped"] = stats.pop("stopped")
        metrics.update({f"{role}_{key}": value for key, value in stats.items()})
    metrics["challenger_eval_share"] = sum(
        1 for row in rows if row["model_version"] == challenger and row["sample"] == 0) / len(problems)
    frame = pd.DataFrame(rows)
    rt.store.replace("evals", {"campaign": rt.campaign, "iteration": iteration}, frame)
    for role, version in roles:
        mine = frame[frame["model_version"] == version]
        metrics[f"pass1_{role}"] = float(mine[mine["sample"] == 0]["reward"].mean())
        for env, part in mine.groupby("env"):
            for key, value in env_metrics(part, rt.config.eval.samples).items():
                metrics[f"{key}_{role}_{env}"] = value
    if champion == challenger:
        metrics["pass1_champion"] = metrics["pass1_challenger"]
    return metrics


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "evaluate", iteration, evaluate)
