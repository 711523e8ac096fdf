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
challengers that are clearly worse (a diverged trainee, a broken update). With ``promotion.efficacy`` it
also stops a challenger that is clearly better: its gain's z statistic crosses a group-sequential
boundary that spends the gate's error 1 - ``promotion.confidence`` across the looks (O'Brien-Fleming-type
Lan-DeMets spending), so looking early does not raise the chance of promoting a challenger that is not
better.

The gate is made cheaper in two more ways: ``eval.every = k`` evaluates every k-th update only, and an
environment on which the champion scores 0 (it cannot regress) is evaluated for the challenger only
every ``eval.zero_recheck`` iterations. An update that trained on nothing registers no challenger, and
this stage then records itself as skipped.

Rows are reused only when they were generated the same way (``gen_key``: token limit, dtype, the
prompt's messages, decoding). The sealed splits (``test``, ``transfer``) are evaluated here too, by
:func:`evaluate_sealed`, but only for the base model and new champions, after the gate has decided.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.curriculum import broad_problems, gate_problems
from evertrain.data.store import StoreError, now, to_json
from evertrain.envs.base import Problem
from evertrain.inference.base import SampleJob
from evertrain.models.checkpoint import encode_chat
from evertrain.models.precision import sampling_dtype
from evertrain.progress import progress
from evertrain.runtime import Runtime, seed_for
from evertrain.scoring import pop_sandbox_runs
from evertrain.stats import efficacy_boundaries, paired_bootstrap, z_statistic
from evertrain.tasks.base import run_stage


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n attempts of which c passed (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} attempts, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def generation_key(rt: Runtime, problem: Problem) -> str:
    """How an answer to ``problem`` is generated: token and turn limits, dtype, the prompt's messages and the
    decoding. Rows are reused only under the same key: a changed template or limit means new answers."""
    config, env = rt.config, rt.env(problem.env)
    decoding: dict[str, Any] = {"greedy": True, "samples": config.eval.samples}
    if config.eval.samples:
        decoding.update(temperature=config.generation.temperature, top_p=config.generation.top_p, seed=config.seed)
    blob = {"max_new_tokens": config.max_new_tokens(problem.env, evaluation=True), "max_turns": env.max_turns,
            "dtype": sampling_dtype(config.model.rollout_dtype, config.model.device),
            "messages": env.messages(problem), "decoding": decoding}
    identity = rt.inference.capabilities.answers_identity
    if identity:  # another engine's answers are other answers (none for the in-house sampler: keys stay stable)
        blob["backend"] = identity
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


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


def eval_problems(rt: Runtime, iteration: int | None = None) -> list[Problem]:
    """The gate's held-out problems of every environment, from its own held-out pool or across its curriculum levels
    (``eval.levels``, :func:`evertrain.curriculum.gate_problems`): those the gate of ``iteration`` compares on
    (``eval_size(env)`` each, the iteration's ``eval.rotations`` set), or every rotation's (None)."""
    rotation = None if iteration is None else rt.config.gate_rotation(iteration)
    return [p for spec in rt.config.environments for p in gate_problems(rt.env(spec.name), rt.config, rotation)]


def sealed_problems(rt: Runtime) -> list[Problem]:
    """Every environment's sealed test split and, where it has one, its transfer split: never the gate's."""
    config = rt.config
    gate = {p.id for p in eval_problems(rt)}
    out: list[Problem] = []
    for spec in config.environments:
        env, size = rt.env(spec.name), config.sealed_size(spec.name)
        for split in ("test", "transfer"):
            out += [p for p in env.sealed_problems(split, size, config.seed, config.held_out_size(spec.name))
                    if p.id not in gate]
    return out


def split_of(problem: Problem) -> str:
    """The ``evals.split`` of a problem: ``gate`` for the held-out set the promotion gate compares."""
    return "gate" if problem.split == "eval" else problem.split


def stage_metrics(rt: Runtime, iteration: int, stage: str) -> dict[str, Any]:
    """The recorded metrics of ``stage`` for ``iteration`` ({} when it has not completed)."""
    return rt.store.stage_metrics(rt.campaign, iteration, stage)


def skip_reason(rt: Runtime, iteration: int) -> str | None:
    """Why this iteration's gate does not run, if it does not."""
    update = stage_metrics(rt, iteration, "update")
    if update.get("skipped"):
        return f"skipped: the update registered no challenger ({update['skipped']})"
    every = rt.config.eval.every
    if every > 1 and (iteration + 1) % every:
        following = iteration + every - (iteration + 1) % every
        return f"skipped: the gate runs every {every} updates (next at iteration {following})"
    return None


def challenger_of(rt: Runtime, iteration: int) -> int:
    frame = rt.store.iteration_versions(rt.campaign, iteration)
    if frame.empty:
        raise StoreError(f"iteration {iteration} has no challenger: run the update stage first")
    return int(frame["version"].iloc[0])


def champion_of(rt: Runtime, iteration: int) -> int:
    """The champion that iteration ``iteration`` is judged against (stable when a stage is rerun)."""
    decided = rt.store.decided_champion(rt.campaign, iteration)
    return rt.champion_version() if decided is None else decided


def _attempts(rt: Runtime, checkpoint: Path, tokenizer: Any, problems: list[Problem], samples: int,
              version: int, bar: Any) -> list[tuple[Problem, int, Any]]:
    """(problem, sample, episode) for every attempt of ``version`` (held in ``checkpoint``): greedy sample 0, then
    ``samples`` sampled ones, on the campaign's inference (here or on its Ray workers)."""
    config = rt.config
    out: list[tuple[Problem, int, Any]] = []
    jobs = []
    for env_name in sorted({p.env for p in problems}):
        batch = [p for p in problems if p.env == env_name]
        prompts = [encode_chat(tokenizer, rt.env(env_name).messages(p)) for p in batch]
        # sampled attempts are seeded per problem, so they are the same in one process and on a cluster
        jobs.append(SampleJob(env_name, batch, prompts, config.max_new_tokens(env_name, evaluation=True),
                              seeds=[seed_for(config.seed, "eval", version, p.id) for p in batch]))
    greedy, _ = rt.inference.sample_groups(checkpoint, version, jobs, 1, greedy=True, progress=bar)
    for job, (groups, _) in zip(jobs, greedy, strict=True):
        out += [(p, 0, g[0]) for p, g in zip(job.problems, groups, strict=True)]
    if samples:
        sampled, _ = rt.inference.sample_groups(checkpoint, version, jobs, samples)
        for job, (groups, _) in zip(jobs, sampled, strict=True):
            out += [(p, i + 1, e) for p, g in zip(job.problems, groups, strict=True) for i, e in enumerate(g)]
    return out


StopRule = Callable[[list[dict[str, Any]], int, tuple[float, ...]], str | None]


def evaluate_version(rt: Runtime, version: int, problems: list[Problem], iteration: int, role: str,
                     stop: StopRule | None = None,
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Eval rows of ``version`` on ``problems``: reused where this version answered before, else generated.

    With ``stop``, the problems are evaluated in ``eval.looks`` slices and ``stop(rows so far, look,
    fractions)`` is asked after each but the last (``fractions``: the share of ``problems`` answered at each
    look, reused rows included); a reason string ends the evaluation there.
    """
    config = rt.config
    wanted = config.eval.samples + 1
    keys = {p.id: generation_key(rt, p) for p in problems}
    splits = {p.id: split_of(p) for p in problems}
    earlier = rt.store.reusable_evals(rt.campaign, version, iteration, wanted, list(keys), sorted(set(keys.values())))
    # only answers generated the same way as now (same limits, dtype, prompt, decoding) are reused
    earlier = earlier[earlier["problem_id"].map(keys).eq(earlier["gen_key"])]
    complete = earlier.groupby("problem_id")["sample"].nunique()
    reusable = set(complete[complete == wanted].index)
    stamp = now()
    rows = [{**row, "iteration": iteration, "role": role, "reused_from": row["iteration"], "created_at": stamp,
             "split": splits[row["problem_id"]]}
            for row in earlier.to_dict("records") if row["problem_id"] in reusable]
    todo = [p for p in problems if p.id not in reusable]
    stats: dict[str, Any] = {"generated": float(len(todo)), "reused": float(len(reusable)),
                             "completion_tokens": 0.0, "model_s": 0.0, "sandbox_runs": 0.0}
    if not todo:
        return rows, stats
    checkpoint = rt.checkpoint(version)
    tokenizer = rt.inference.tokenizer(checkpoint)
    parts = slices(todo, config.eval.looks) if stop is not None else [todo]
    fractions = tuple((len(reusable) + sum(len(done) for done in parts[:look + 1])) / len(problems)
                      for look in range(len(parts)))
    if len(parts) > 1:
        stats["look_fractions"] = list(fractions)
    with progress(len(todo), f"evaluate i={iteration} v{version}", "problem") as bar:
        for look, part in enumerate(parts):
            rows += _evaluate_part(rt, checkpoint, tokenizer, part, version, iteration, role, stamp, bar, stats)
            reason = stop(rows, look, fractions) if stop is not None and look < len(parts) - 1 else None
            if reason:
                stats["generated"] = float(sum(len(done) for done in parts[:look + 1]))
                stats["stopped"] = reason
                stats["stopped_look"] = look
                break
    return rows, stats


def _evaluate_part(rt: Runtime, checkpoint: Path, tokenizer: Any, problems: list[Problem], version: int,
                   iteration: int, role: str, stamp: Any, bar: Any, stats: dict[str, Any]) -> list[dict[str, Any]]:
    began = time.perf_counter()
    attempts = _attempts(rt, checkpoint, tokenizer, problems, rt.config.eval.samples, version, bar)
    stats["model_s"] += time.perf_counter() - began
    verdicts, _ = rt.grade([(p.env, p, e.text) for p, _, e in attempts])
    keys = {p.id: generation_key(rt, p) for p in problems}
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
            "reason": v.reason, "reused_from": None, "created_at": stamp, "split": split_of(p), "gen_key": keys[p.id],
        })
    return rows


def sequential_check(rt: Runtime, iteration: int, champion_rows: list[dict[str, Any]], total: int) -> StopRule:
    """``stop(challenger rows so far, look, fractions)``: a reason to end the challenger's evaluation early.

    Efficacy (``promotion.efficacy``): the gain's z statistic reaches the look's group-sequential boundary
    (error 1 - confidence spent across the looks), the gain exceeds min_gain and no environment has dropped
    beyond max_regression so far. Futility (``promotion.futility``): P(challenger not worse) is below it.
    Ties count as "not worse": a challenger that differs from the champion on a single problem so far is
    no evidence of futility, although every bootstrap mean of its gain is then <= 0.
    """
    rule = rt.config.promotion
    champion = {row["problem_id"]: row["reward"] for row in champion_rows if row["sample"] == 0}

    def stop(rows: list[dict[str, Any]], look: int, fractions: tuple[float, ...]) -> str | None:
        mine = [row for row in rows if row["sample"] == 0 and row["problem_id"] in champion]
        if not mine:
            return None
        challenger = np.array([row["reward"] for row in mine], dtype=float)
        baseline = np.array([champion[row["problem_id"]] for row in mine], dtype=float)
        envs = np.array([row["env"] for row in mine])
        if rule.efficacy:
            bound = efficacy_boundaries(fractions, round(1 - rule.confidence, 6))[look]
            z, gain = z_statistic(challenger, baseline, envs), float((challenger - baseline).mean())
            drops = {env: float((baseline[envs == env] - challenger[envs == env]).mean()) for env in np.unique(envs)}
            if bound < math.inf and z >= bound and gain > rule.min_gain and max(drops.values()) <= rule.max_regression:
                return (f"stopped for efficacy after {len(mine)} of {total} problems: gain {gain:+.3f}, "
                        f"z = {z:.2f} >= {bound:.2f} (look {look + 1} of {len(fractions)})")
        if not rule.futility:
            return None
        test = paired_bootstrap(challenger, baseline, envs, rule.bootstrap_samples,
                                seed_for(rt.config.seed, iteration, "futility", len(mine)))
        if test["p_not_worse"] >= rule.futility:
            return None
        return (f"stopped for futility after {len(mine)} of {total} problems: gain {test['gain']:+.3f}, "
                f"P(not worse) = {test['p_not_worse']:.3f} < {rule.futility:.3f}")

    return stop


def zero_skipped(rt: Runtime, iteration: int) -> dict[str, str]:
    """Guard environments (weight 0) left out of this gate: at their last gate, within ``eval.zero_recheck``
    iterations, champion and challenger both scored 0 on every problem. A model at 0 cannot regress, and
    the last ones measured were at 0, so re-evaluating them every iteration (GSM8K for SmolLM2-135M: two
    thirds of the demo's evaluation) buys nothing until the recheck. Trained environments are always
    evaluated: a gain there is what the gate is looking for."""
    window = rt.config.eval.zero_recheck
    guards = {spec.name for spec in rt.config.environments if spec.weight == 0}
    if window <= 1 or not guards:
        return {}
    frame = rt.store.last_gate_per_env(rt.campaign, iteration)
    return {row.env: f"champion and challenger both scored 0 at iteration {row.iteration}; "
                     f"rechecked at iteration {row.iteration + window}"
            for row in frame.itertuples(index=False)
            if row.env in guards and row.best == 0 and row.versions >= 2 and iteration - row.iteration < window}


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
    skipped = skip_reason(rt, iteration)
    if skipped:
        rt.store.replace("evals", {"campaign": rt.campaign, "iteration": iteration, "split": "gate"}, [])
        return {"skipped": skipped}
    left_out = zero_skipped(rt, iteration)
    problems = [p for p in eval_problems(rt, iteration) if p.env not in left_out]
    if not problems:  # every environment is a guard at 0: the gate still needs something to compare
        left_out, problems = {}, eval_problems(rt, iteration)
    challenger, champion = challenger_of(rt, iteration), champion_of(rt, iteration)
    rows: list[dict[str, Any]] = []
    metrics: dict[str, Any] = {"challenger_version": challenger, "champion_version": champion,
                               "eval_problems": len(problems)}
    if rt.config.eval.rotations > 1:
        metrics["gate_rotation"] = rt.config.gate_rotation(iteration)
    metrics.update({f"skipped_env_{env}": why for env, why in left_out.items()})
    roles = ([("champion", champion)] if champion != challenger else []) + [("challenger", challenger)]
    for role, version in roles:
        stop = None
        if role == "challenger" and champion != challenger and rt.config.eval.looks > 1 and \
                (rt.config.promotion.futility or rt.config.promotion.efficacy):
            stop = sequential_check(rt, iteration, rows, len(problems))
        version_rows, stats = evaluate_version(rt, version, problems, iteration, role, stop)
        rows += version_rows
        for key in ("stopped", "stopped_look", "look_fractions"):
            if key in stats:
                metrics[key] = stats.pop(key)
        metrics.update({f"{role}_{key}": value for key, value in stats.items()})
    if rt.config.promotion.efficacy and "look_fractions" in metrics:
        # a look that may spend no error has an infinite boundary: stored as null (never crossed)
        metrics["efficacy_bounds"] = [b if b < math.inf else None for b in efficacy_boundaries(
            tuple(metrics["look_fractions"]), round(1 - rt.config.promotion.confidence, 6))]
    metrics["challenger_eval_share"] = sum(
        1 for row in rows if row["model_version"] == challenger and row["sample"] == 0) / max(len(problems), 1)
    frame = pd.DataFrame(rows)
    rt.store.replace("evals", {"campaign": rt.campaign, "iteration": iteration, "split": "gate"}, frame)
    for role, version in roles:
        mine = frame[frame["model_version"] == version]
        metrics[f"pass1_{role}"] = float(mine[mine["sample"] == 0]["reward"].mean())
        for env, part in mine.groupby("env"):
            for key, value in env_metrics(part, rt.config.eval.samples).items():
                metrics[f"{key}_{role}_{env}"] = value
    if champion == challenger:
        metrics["pass1_champion"] = metrics["pass1_challenger"]
    return metrics


def evaluate_sealed(rt: Runtime, iteration: int, versions: list[int]) -> dict[str, Any]:
    """Answers of ``versions`` on the sealed splits (reused where they exist), stored as split test/transfer.

    Called by promote after the gate has decided, for the base model and each new champion: what is
    learned is measured on problems that no decision ever looked at.
    """
    problems = sealed_problems(rt)
    # the broad sealed set (every curriculum level, drawn once): measured beside the test and transfer splits
    seen = {p.id for p in problems} | {p.id for p in eval_problems(rt)}
    problems += [p for p in broad_problems(rt) if p.id not in seen]
    metrics: dict[str, Any] = {"sealed_problems": len(problems), "sealed_generated": 0.0, "sealed_s": 0.0}
    if not problems:
        return metrics
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for version in dict.fromkeys(versions):
        version_rows, stats = evaluate_version(rt, version, problems, iteration, "sealed")
        rows += version_rows
        metrics["sealed_generated"] += stats["generated"]
        metrics["sealed_completion_tokens"] = metrics.get("sealed_completion_tokens", 0.0) + stats["completion_tokens"]
    frame = pd.DataFrame(rows)
    for split in ("test", "transfer", "broad"):
        rt.store.replace("evals", {"campaign": rt.campaign, "iteration": iteration, "split": split},
                         frame[frame["split"] == split])
    metrics["sealed_s"] = time.perf_counter() - began
    return metrics


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, "evaluate", iteration, evaluate)
