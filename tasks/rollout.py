"""Stage 2, rollout: the trainee samples G completions for every curated problem.

Each rollout row keeps what the update needs to correct for staleness: the token ids, the log-prob
of every sampled token, and the policy version that produced it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.data.store import now, to_json
from evertrain.envs.base import Problem
from evertrain.inference.base import SampleJob, SamplingStats
from evertrain.inference.episodes import Episode
from evertrain.models.checkpoint import encode_chat
from evertrain.progress import progress
from evertrain.runtime import Runtime, seed_for
from evertrain.tasks.base import run_stage


def sample_groups(rt: Runtime, iteration: int, problems: pd.DataFrame, version: int, checkpoint: Path,
                  refill_round: int = 0, label: str = "rollout", temperature: float | None = None,
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], SamplingStats, dict[str, Any]]:
    """Sample a group of G completions for every row of ``problems`` (columns problem_id, env, prompt, payload,
    messages) with model version ``version``, held in ``checkpoint``, at ``temperature`` (default:
    :func:`rollout_temperature`), on the campaign's inference (``rt.inference``: here or on its Ray workers).

    Returns the ``rollouts`` rows (unscored; ``refill_round`` marks dynamic sampling's draws), the sandbox
    audit rows of tool episodes, the sampling statistics and the cluster fan-out's metrics. Every group is
    seeded by (campaign seed, iteration, problem), so its samples do not depend on its batch or worker.
    """
    if temperature is None:
        temperature = rollout_temperature(rt, iteration)
    config = rt.config
    tokenizer = rt.inference.tokenizer(checkpoint)
    problems = problems.sort_values(["env", "problem_id"]).reset_index(drop=True)
    prompts = [encode_chat(tokenizer, json.loads(m)) for m in problems["messages"]]
    G = config.group_size
    groups: list[list[Episode]] = []
    stats = SamplingStats()
    jobs = []
    # one environment at a time: similar lengths decode together, each with its own length limit
    for env_name, rows in problems.groupby("env", sort=True).indices.items():
        env_problems = [Problem(env_name, problems["problem_id"].iloc[i], problems["prompt"].iloc[i],
                                json.loads(problems["payload"].iloc[i])) for i in rows]
        jobs.append(SampleJob(env_name, env_problems, [prompts[i] for i in rows], config.max_new_tokens(env_name),
                              seeds=[seed_for(config.seed, iteration, "rollout", p.id) for p in env_problems]))
    with progress(len(prompts) * G, f"{label:<8} i={iteration}", "completion") as bar:
        outputs, fanout = rt.inference.sample_groups(checkpoint, version, jobs, G, temperature=temperature,
                                                     progress=bar)
    for env_groups, env_stats in outputs:
        groups += env_groups
        stats.merge(env_stats)
    rows_out = []
    audit = []
    stamp = now()
    for problem, prompt_ids, group in zip(problems.itertuples(index=False), prompts, groups, strict=True):
        prompt_text = tokenizer.decode(prompt_ids)
        for index, e in enumerate(group):
            audit += [{**run, "campaign": rt.campaign, "iteration": iteration} for run in e.sandbox_runs]
            rows_out.append({
                "campaign": rt.campaign, "iteration": iteration, "problem_id": problem.problem_id, "sample": index,
                "env": problem.env, "policy_version": version, "prompt_text": prompt_text, "completion": e.text,
                "prompt_ids": prompt_ids, "completion_ids": e.completion_ids, "logprobs": e.logprobs,
                "loss_mask": e.loss_mask, "turns": to_json(e.turns), "finish_reason": e.finish_reason,
                "prompt_tokens": len(prompt_ids), "completion_tokens": sum(e.loss_mask),
                "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "rework": e.rework, "generated_at": stamp,
                # the distribution the behaviour log-probs belong to: a replay recomputes under the same settings
                "temperature": temperature, "top_p": config.generation.top_p,
                "refill_round": refill_round,
            })
    return rows_out, audit, stats, fanout


def rollout(rt: Runtime, iteration: int, version: int | None = None) -> dict[str, Any]:
    """Sample the iteration's groups from the trainee, or from policy ``version`` where one is given (async mode's
    prefetch pins the trainee as it was before the update it overlaps: one version old, whichever finishes first)."""
    # the curated problems (those dynamic sampling drew in the score stage are the score stage's own)
    problems = rt.store.curated_problems(rt.campaign, iteration)
    if problems.empty:
        raise RuntimeError(f"iteration {iteration} has no curated problems: run the curate stage first")
    version = rollout_version(rt, iteration, default=rt.trainee_version if version is None else lambda: version)
    checkpoint = rt.checkpoint(version)
    began = time.perf_counter()
    rows, audit, stats, fanout = sample_groups(rt, iteration, problems, version, checkpoint)
    seconds = time.perf_counter() - began
    rt.store.replace("rollouts", {"campaign": rt.campaign, "iteration": iteration}, pd.DataFrame(rows))
    if audit:
        rt.store.append("sandbox_runs", audit)
    return {
        "policy_version": version, "completions": len(rows), "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens, "completion_tokens": stats.completion_tokens,
        "model_s": stats.forward_seconds, "tokens_per_s": stats.completion_tokens / max(seconds, 1e-9),
        "truncated_share": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "tool_calls": sum(r["tool_calls"] for r in rows) / len(rows), "temperature": rows[0]["temperature"],
        **fanout,
    }


def rollout_temperature(rt: Runtime, iteration: int) -> float:
    """The temperature the iteration samples at: ``generation.temperature``, or with ``generation.target_entropy``
    the one the entropy of the iteration before it asks for (:func:`next_temperature`; without its rollouts, the
    configured temperature).

    Read from the stored rollouts only, so a rerun (and dynamic sampling's refill draws) samples at the temperature
    the iteration's rollouts were first sampled at, and a resumed campaign goes on where it stopped.
    """
    gen = rt.config.generation
    if gen.target_entropy is None:
        return gen.temperature
    history = rt.store.sampling_history(rt.campaign, iteration)
    if history and int(history[0]["iteration"]) == iteration and _present(history[0]["temperature"]):
        return float(history[0]["temperature"])  # the iteration was sampled already
    last = next((h for h in history if int(h["iteration"]) == iteration - 1), None)
    if last is None or not _present(last["entropy"]):
        return gen.temperature
    before = float(last["temperature"]) if _present(last["temperature"]) else gen.temperature
    return next_temperature(before, float(last["entropy"]), gen.target_entropy, low=gen.temperature,
                            high=gen.max_temperature, step=gen.temperature_step)


def next_temperature(temperature: float, entropy: float, target: float, *, low: float, high: float,
                     step: float) -> float:
    """One step of the entropy-targeted temperature: up by ``step`` where ``entropy`` fell below ``target``, down
    where it rose above twice the target (a band, so that the noise of one iteration's estimate does not make the
    temperature oscillate), else unchanged; always within [low, high]."""
    if entropy < target:
        temperature *= step
    elif entropy > 2 * target:
        temperature /= step
    return round(min(max(temperature, low), high), 6)


def _present(value: Any) -> bool:
    return value is not None and value == value  # not NULL, not NaN


def rollout_version(rt: Runtime, iteration: int, default: Callable[[], int]) -> int:
    """The policy version the iteration's rollouts were first sampled with, else ``default()``.

    A rerun samples from the policy the iteration's rollouts were first made with, not from a trainee that has
    moved on since (the update's rerun would then find every rollout too stale and train nothing); dynamic
    sampling's refill draws use it too, so every group of the batch comes from one policy.
    """
    earlier = rt.store.first_policy_version(rt.campaign, iteration)
    return default() if earlier is None else earlier


@task(name="rollout", cache_policy=NO_CACHE)
def rollout_task(rt: Runtime, iteration: int, version: int | None = None) -> dict[str, Any]:
    return run_stage(rt, "rollout", iteration, lambda rt, iteration: rollout(rt, iteration, version))
