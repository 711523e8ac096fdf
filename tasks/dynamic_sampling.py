"""DAPO's dynamic sampling, bounded: refill the batch with informative groups (part of the score stage).

A group whose rewards all agree (every sample passed, or none did) gives GRPO no signal: its advantages are
all 0. DAPO (Yu et al., 2025) over-samples and keeps sampling until the batch is full of groups whose rewards
differ. Here, once the score stage has graded the curated batch, each group that carries no signal (the
update's own test: rewards as trained on, :func:`evertrain.tasks.update.informative`) opens one slot of its
environment. Each refill round then, per environment with open slots:

1. draws fresh training problems, seeded by (campaign seed, iteration, environment, "refill", round), and
   keeps as many as there are open slots with curation's own rules (:func:`evertrain.tasks.curate.select`:
   no problem already in this iteration, no near duplicate, nothing held out, gate or sealed, and the
   pass-rate history's too-easy/too-hard filter);
2. samples a group for each with the policy version the iteration's rollouts were sampled with, and grades
   it;
3. closes one slot per informative group.

It stops when every slot is closed, when no fresh problem passes the rules, or after
``update.dynamic_sampling_draws`` rounds (default 2 for ``dapo``, else 0: off). A round draws at most as many
problems as there are open slots, so the batch never holds more informative groups than were curated.

Every drawn problem and rollout is stored (``refill_round`` = the round, 1 or more, in ``problems`` and
``rollouts``), the informative ones and the rest, and the update trains on them like any other group of the
iteration; the curated zero-variance groups stay stored too. The rows belong to the score stage: a rerun
replaces them (the same ones: draws and samples are seeded). Their sampling and grading run inside the stage,
so its CPU (and GPU) seconds, tokens and dollars include them.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from evertrain.curriculum import candidates as curriculum_candidates
from evertrain.data.store import now, to_json
from evertrain.envs.base import Problem
from evertrain.envs.quality import NgramIndex
from evertrain.frontier import Selection
from evertrain.inference.base import SamplingStats
from evertrain.runtime import Runtime, seed_for
from evertrain.scoring import pop_sandbox_runs
from evertrain.tasks.curate import RULES, problem_row, select
from evertrain.tasks.rollout import rollout_version, sample_groups
from evertrain.tasks.update import informative


def group_signal(scored: pd.DataFrame, overlong: str) -> dict[str, bool]:
    """Whether each group (problem_id) of scored rollouts (reward, finish_reason) is informative."""
    return {str(problem_id): informative(rows["reward"].to_numpy(), (rows["finish_reason"] == "length").to_numpy(),
                                         overlong)
            for problem_id, rows in scored.groupby("problem_id", sort=True)}


def refill(rt: Runtime, iteration: int, scored: pd.DataFrame) -> dict[str, Any]:
    """Dynamic sampling for ``iteration`` whose curated rollouts ``scored`` (problem_id, env, reward,
    finish_reason) are graded: draw, sample and grade refill groups (module docstring); store them in place of
    any an earlier run stored; return the stage's ``refill_*`` metrics."""
    config = rt.config
    rounds, overlong = config.update.refill_draws, config.update.overlong_rule
    signal = group_signal(scored, overlong)
    env_of = scored.groupby("problem_id", sort=True)["env"].first()
    open_slots = {spec.name: 0 for spec in config.environments}
    for problem_id, useful in signal.items():
        open_slots[str(env_of[problem_id])] += int(not useful)
    start = sum(signal.values())

    curated = rt.store.curated_problems(rt.campaign, iteration)
    taken = set(curated["problem_id"])
    chosen = NgramIndex(n=3)
    for row in curated.itertuples(index=False):
        if not rt.env(row.env).templated:
            chosen.add(row.prompt)
    dropped = dict.fromkeys(RULES, 0)
    selection = Selection()  # the frontier's decisions (frontier.enabled): the same as curate's, from the same store

    problem_rows: list[dict[str, Any]] = []
    rollout_rows: list[dict[str, Any]] = []
    audit: list[dict[str, Any]] = []
    stats = SamplingStats()
    fanout: dict[str, float] = {}
    version, checkpoint = 0, None
    draws = gained = 0
    for round_ in range(1, rounds + 1):
        if not any(open_slots.values()):
            break
        fresh = _draw(rt, iteration, round_, open_slots, taken, chosen, dropped, selection)
        if not fresh:  # no fresh problem passes curation's rules: another round would draw the same
            break
        draws += 1
        if checkpoint is None:
            version = rollout_version(rt, iteration, default=rt.trainee_version)
            checkpoint = rt.checkpoint(version)
        new_problems = [problem_row(rt, iteration, rt.env(p.env), p, round_, selection.plans.get(p.id))
                        for p in fresh]
        rows, sandbox, round_stats, sample_fanout = sample_groups(
            rt, iteration, pd.DataFrame(new_problems), version, checkpoint, refill_round=round_, label="refill")
        by_id = {p.id: p for p in fresh}
        sandbox, grade_fanout = _grade(rt, iteration, rows, by_id, sandbox)
        round_frame = pd.DataFrame([{key: r[key] for key in ("problem_id", "env", "reward", "finish_reason")}
                                    for r in rows])
        for problem_id, useful in group_signal(round_frame, overlong).items():
            if useful:
                open_slots[by_id[problem_id].env] -= 1
                gained += 1
        problem_rows += new_problems
        rollout_rows += rows
        audit += sandbox
        stats.merge(round_stats)
        for key, value in {**sample_fanout, **grade_fanout}.items():
            fanout[f"refill_{key}"] = fanout.get(f"refill_{key}", 0.0) + float(value)

    if problem_rows or stored_refills(rt, iteration):  # a rerun replaces what an earlier run drew
        rt.store.replace_refills(rt.campaign, iteration, problem_rows, rollout_rows)
    if audit:
        rt.store.append("sandbox_runs", audit)
    metrics: dict[str, Any] = {
        "refill_draws": draws, "refill_groups": len(problem_rows), "refill_completions": len(rollout_rows),
        "refill_informative_groups": gained, "informative_groups": start + gained,
        "informative_target": len(signal), "refill_dropped": sum(dropped.values()),
        "refill_sandbox_runs": len(audit), **fanout,
    }
    if rollout_rows:
        metrics["refill_mean_reward"] = float(sum(r["reward"] for r in rollout_rows) / len(rollout_rows))
    if draws:  # the refill's sampling: counted in the stage's tokens, and its GPU time when on a GPU
        metrics.update({"policy_version": version, "prompt_tokens": stats.prompt_tokens,
                        "cached_prompt_tokens": stats.cached_prompt_tokens,
                        "completion_tokens": stats.completion_tokens, "model_s": stats.forward_seconds})
    return metrics


def _draw(rt: Runtime, iteration: int, round_: int, open_slots: dict[str, int], taken: set[str],
          chosen: NgramIndex, dropped: dict[str, int], selection: Selection) -> list[Problem]:
    """Fresh problems for this round's open slots, per environment, through curation's rules."""
    config, fresh = rt.config, []
    for env_name, need in open_slots.items():
        if need <= 0:
            continue
        env = rt.env(env_name)
        # at the iteration's curriculum level, like curate's draw (evertrain.curriculum)
        candidates = curriculum_candidates(rt, iteration, env, need * config.curation.oversample,
                                           seed_for(config.seed, iteration, env_name, "refill", round_))
        fresh += select(rt, iteration, env, candidates, need, taken, chosen, dropped, selection)
    return fresh


def _grade(rt: Runtime, iteration: int, rows: list[dict[str, Any]], by_id: dict[str, Problem],
           sandbox: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Grade a round's rows in place (reward, passed, reason, detail, scored_at); return the sandbox audit rows
    (``sandbox`` and the graders' own) and the graders' fan-out metrics."""
    verdicts, grade_fanout = rt.grade([(r["env"], by_id[r["problem_id"]], r["completion"]) for r in rows])
    stamp = now()
    for row, verdict in zip(rows, verdicts, strict=True):
        sandbox += [{**run, "campaign": rt.campaign, "iteration": iteration} for run in pop_sandbox_runs(verdict)]
        row.update(reward=verdict.reward, passed=verdict.passed, reason=verdict.reason,
                   detail=to_json(verdict.detail), scored_at=stamp)
    return sandbox, grade_fanout


def stored_refills(rt: Runtime, iteration: int) -> int:
    """How many refill rows (``refill_round >= 1``) of ``iteration`` the store holds, problems and rollouts."""
    return rt.store.refill_row_count(rt.campaign, iteration)


def drop_refills(rt: Runtime, iteration: int) -> None:
    """Remove the refill rows an earlier run of the score stage stored (dynamic sampling now off)."""
    if stored_refills(rt, iteration):
        rt.store.replace_refills(rt.campaign, iteration, [], [])

