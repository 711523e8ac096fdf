"""Stage 3, score: grade every rollout of the iteration with its environment's verifier.

Rewards and verdicts are written onto the rollout rows; sandboxed graders add one audit row per
sandboxed process to ``sandbox_runs``. With DAPO's dynamic sampling (``update.dynamic_sampling_draws``,
on by default for ``dapo``) the stage then refills the batch with informative groups of fresh problems,
sampled and graded here (:mod:`evertrain.tasks.dynamic_sampling`); those rows are the stage's own.

A completion whose grader could not run (no sandbox, bubblewrap missing, a verifier crash: reason
``grader_error``) scores 0, but is not the completion's fault: the share of such verdicts is recorded
(``grader_error_share``, in ``stage_runs.metrics`` and MLflow), and above ``score.max_grader_error_share``
the stage fails, naming the share and the causes, before any reward is written.
"""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.data.store import now, to_json
from evertrain.envs.base import Problem
from evertrain.frontier import score_metrics
from evertrain.progress import progress
from evertrain.runtime import Runtime
from evertrain.scoring import grader_errors, pop_sandbox_runs
from evertrain.tasks.base import run_stage
from evertrain.tasks.dynamic_sampling import drop_refills, refill


def score(rt: Runtime, iteration: int) -> dict[str, Any]:
    frame = rt.store.rollouts_to_score(rt.campaign, iteration)
    if frame.empty:
        raise RuntimeError(f"iteration {iteration} has no rollouts: run the rollout stage first")
    items = [
        (row.env, Problem(row.env, row.problem_id, row.prompt, json.loads(row.payload)), row.completion)
        for row in frame.itertuples(index=False)
    ]
    with progress(len(items), f"score    i={iteration}", "grade") as bar:
        # in this process, or in Ray tasks (each sandboxed on its node) when the campaign has a cluster
        verdicts, fanout = rt.grade(items, progress=bar)
    share = check_grader_errors(rt, iteration, verdicts)
    stamp = now()
    audit: list[dict[str, Any]] = []
    for verdict in verdicts:
        for run in pop_sandbox_runs(verdict):
            audit.append({**run, "campaign": rt.campaign, "iteration": iteration})
    scores = pd.DataFrame({
        "problem_id": frame["problem_id"], "sample": frame["sample"],
        "reward": [v.reward for v in verdicts], "passed": [v.passed for v in verdicts],
        "reason": [v.reason for v in verdicts], "detail": [to_json(v.detail) for v in verdicts],
        "scored_at": stamp,
    })
    rt.store.update_rollout_scores(rt.campaign, iteration, scores)
    if audit:
        rt.store.append("sandbox_runs", audit)
    frame["reward"] = scores["reward"].to_numpy()
    spread = frame.groupby("problem_id")["reward"].agg(lambda r: r.max() - r.min())
    metrics: dict[str, Any] = {
        "mean_reward": float(frame["reward"].mean()),
        "pass_rate": float(scores["passed"].mean()),
        "zero_variance_share": float((spread == 0).mean()),
        "sandbox_runs": len(audit), "grader_error_share": share, **fanout,
    }
    for env, rewards in frame.groupby("env")["reward"]:
        metrics[f"mean_reward_{env}"] = float(rewards.mean())
    if rt.config.frontier.enabled:  # bare and guided groups apart (evertrain.frontier)
        metrics.update(score_metrics(frame.assign(passed=scores["passed"].to_numpy())))
    # DAPO's dynamic sampling (update.dynamic_sampling_draws): refill the zero-variance groups' places with
    # informative groups of fresh problems, a bounded number of rounds; their rows are this stage's own
    if rt.config.update.refill_draws:
        metrics.update(refill(rt, iteration, frame))
    else:
        drop_refills(rt, iteration)
    return metrics


class GraderFailure(RuntimeError):
    """Too many completions could not be graded for reasons that are not theirs."""


def check_grader_errors(rt: Runtime, iteration: int, verdicts: list[Any]) -> float:
    """The share of ``verdicts`` whose grader failed; GraderFailure (the share, the limit, the causes) when it
    exceeds ``score.max_grader_error_share``. The share goes to MLflow either way."""
    failed, causes = grader_errors(verdicts)
    share = failed / len(verdicts) if verdicts else 0.0
    limit = rt.config.score.max_grader_error_share
    if share > limit:
        rt.tracker.log_iteration_metrics(rt.tracker.run_id(iteration), {"score/grader_error_share": share}, iteration)
        named = "; ".join(f"{count}x {cause}" for count, cause in ((c, k) for k, c in causes[:3]))
        raise GraderFailure(
            f"score i={iteration}: {failed} of {len(verdicts)} completions ({share:.1%}) could not be graded "
            f"(grader_error_share {share:.3f} > score.max_grader_error_share = {limit}), which is not the "
            f"completions' fault; no reward was written. Causes: {named}")
    return share


@task(name="score", cache_policy=NO_CACHE)
def score_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, "score", iteration, score)
