"""Stage 6, promote: move ``champion`` to the challenger only if it is better on the same problems.

The gate is a paired bootstrap over the held-out problems (resampled within each environment): the
challenger is promoted when the probability that its mean pass@1 beats the champion's reaches
``promotion.confidence``, its gain exceeds ``promotion.min_gain``, and no environment drops by more
than ``promotion.max_regression``. When the challenger was evaluated in looks with efficacy stopping on,
the gain's z statistic must also reach the group-sequential boundary of the look where the evaluation
ended (see ``tasks/evaluate.py``), so the error 1 - confidence is spent across the looks, not at each.
The decision and its numbers go to DuckDB, MLflow tags and a Prefect markdown artifact.

A promoted challenger (and the base model, the first time) is then measured on the sealed splits, which
no decision looks at: the report's champion-vs-base line shows them beside the gate's split.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from evertrain.approval import request_approval
from evertrain.config import PromotionConfig
from evertrain.data.lineage import iteration_report, sealed_curve
from evertrain.data.store import StoreError, now, to_json
from evertrain.plots import progress_figure
from evertrain.runtime import Runtime, seed_for
from evertrain.serving.auth import actor_name
from evertrain.stats import paired_bootstrap, z_statistic
from evertrain.tasks.base import current_flow_run_id, run_stage
from evertrain.tasks.evaluate import challenger_of, champion_of, evaluate_sealed, stage_metrics


def decide(frame: pd.DataFrame, rule: PromotionConfig, seed: int, boundary: float | None = None,
           stopped_early: bool = False) -> dict[str, Any]:
    """The promotion decision from paired eval rows (columns: problem_id, env, challenger, champion).

    ``boundary``: the group-sequential z boundary of the look where the evaluation ended (None: a single
    look). ``stopped_early``: the evaluation stopped for efficacy at an interim look, where the boundary,
    not P(better), is the test.
    """
    test = paired_bootstrap(frame["challenger"].to_numpy(), frame["champion"].to_numpy(),
                            frame["env"].to_numpy(), rule.bootstrap_samples, seed)
    test["z"] = z_statistic(frame["challenger"].to_numpy(), frame["champion"].to_numpy(), frame["env"].to_numpy())
    per_env = {
        env: {"challenger": float(g["challenger"].mean()), "champion": float(g["champion"].mean()),
              "problems": len(g)}
        for env, g in frame.groupby("env")
    }
    regressed = regressions(per_env, rule)
    if regressed:
        worst = max(regressed, key=regressed.get)
        promoted = False
        reason = f"kept champion: {worst} regressed by {regressed[worst]:.3f} > {rule.max_regression:.3f}"
    elif test["gain"] <= rule.min_gain:
        promoted = False
        reason = f"kept champion: gain {test['gain']:+.3f} is not above {rule.min_gain:.3f}"
    elif test["p_better"] < rule.confidence and not stopped_early:
        promoted = False
        reason = f"kept champion: P(better) = {test['p_better']:.3f} < {rule.confidence:.3f}"
    elif boundary is not None and test["z"] < boundary:
        promoted = False
        reason = (f"kept champion: z = {test['z']:.2f} < {boundary:.2f}, the group-sequential boundary "
                  f"(P(better) = {test['p_better']:.3f})")
    else:
        promoted = True
        reason = (f"promoted: gain {test['gain']:+.3f} (95% CI [{test['gain_low']:+.3f}, "
                  f"{test['gain_high']:+.3f}]), P(better) = {test['p_better']:.3f} >= {rule.confidence:.3f}")
    return {"promoted": promoted, "reason": reason, "per_env": per_env, **test}


def regressions(per_env: dict[str, Any], rule: PromotionConfig) -> dict[str, float]:
    """The environments on which the challenger dropped by more than ``max_regression``, with the drop."""
    return {env: v["champion"] - v["challenger"] for env, v in per_env.items()
            if v["champion"] - v["challenger"] > rule.max_regression}


def ahead(challenger_pass1: float, champion_pass1: float, per_env: dict[str, Any], rule: PromotionConfig) -> bool:
    """A refused challenger that was ahead: its gain exceeded ``min_gain`` and no environment regressed beyond
    ``max_regression``, so it was kept out only for want of evidence (P(better) or the boundary). Such a
    gate does not count toward ``reset_after_failures``: resetting would throw away a trainee that, by the
    gate's best estimate, is better than the champion (in a 6-iteration demo run here, seed 2, two such
    refusals, P(better) 0.80 and 0.89, reset a trainee whose sealed test gain was +0.13)."""
    return challenger_pass1 - champion_pass1 > rule.min_gain and not regressions(per_env, rule)


def _consecutive_failures(rt: Runtime, iteration: int) -> int:
    """Refused gates in a row before ``iteration`` that count toward a reset (see :func:`ahead`)."""
    earlier = rt.store.gate_history(rt.campaign, iteration)
    count = 0
    for row in earlier.itertuples(index=False):
        if row.promoted or row.reset_trainee:
            break
        count += bool(row.refused_by_person) or not ahead(row.challenger_pass1, row.champion_pass1,
                                                          json.loads(row.per_env or "{}"), rt.config.promotion)
    return count


def _publish_artifacts(rt: Runtime, iteration: int, decision: dict[str, Any], challenger: int,
                       champion: int) -> None:
    if current_flow_run_id() is None:
        return
    key = f"{rt.campaign}-iteration-{iteration}".lower().replace("_", "-")
    rows = [{"environment": env, "challenger pass@1": round(v["challenger"], 4),
             "champion pass@1": round(v["champion"], 4), "problems": v["problems"]}
            for env, v in decision["per_env"].items()]
    create_table_artifact(rows, key=f"{key}-eval", description=f"Held-out pass@1, iteration {iteration}")
    create_markdown_artifact(
        f"## Promotion, iteration {iteration}\n\n**{'Promoted' if decision['promoted'] else 'Not promoted'}**: "
        f"challenger v{challenger} vs champion v{champion}\n\n{decision['reason']}\n\n"
        f"| metric | value |\n|---|---|\n| gain | {decision['gain']:+.4f} |\n"
        f"| 95% CI | [{decision['gain_low']:+.4f}, {decision['gain_high']:+.4f}] |\n"
        f"| P(better) | {decision['p_better']:.4f} |\n",
        key=f"{key}-promotion", description=f"Promotion decision, iteration {iteration}",
    )


# the progress figure on each iteration's MLflow run shows the last this many iterations: drawing the whole
# campaign every iteration made promote's cost grow with the campaign (+45% from iteration 1 to 120 of the growth
# benchmark, AMD EPYC). The whole curve is MLflow's chart of the campaign run's metrics, and `evertrain report`.
PROGRESS_WINDOW = 50


def _log_figure(rt: Runtime, iteration: int, run_id: str) -> None:
    """The campaign's last :data:`PROGRESS_WINDOW` iterations, as a figure on this iteration's MLflow run."""
    first = max(0, iteration - PROGRESS_WINDOW + 1)
    rows = [r for r in iteration_report(rt.store, rt.campaign, since=first) if r["iteration"] <= iteration]
    sealed = [p for p in sealed_curve(rt.store, rt.campaign) if first <= p["iteration"] <= iteration]
    title = f"campaign {rt.campaign} after iteration {iteration}" + (f" (from iteration {first})" if first else "")
    figure = progress_figure(rows, title, sealed)
    rt.tracker.client.log_figure(run_id, figure, "figures/progress.png")
    plt.close(figure)


def _sealed(rt: Runtime, iteration: int, champion: int, promoted: bool = True) -> dict[str, Any]:
    """Measure the base model (once) and the champion on the sealed splits and the broad sealed set, after the
    decision (a broad set is measured even where the sealed splits are off): every new champion, or with
    ``eval.sealed_every`` = k > 1 the champion in effect at every k-th iteration, unless it was measured before."""
    if not rt.config.eval.sealed_problems and not any(s.sealed_problems for s in rt.config.environments) \
            and not rt.config.curriculum.broad_per_level:
        return {}
    every = rt.config.eval.sealed_every
    if every == 1 and not promoted:
        return {}
    if every > 1:
        if (iteration + 1) % every:
            return {"sealed_deferred": 1.0}  # measured at the next scheduled iteration, if still champion then
        measured = set(rt.store.sealed_pass_counts(rt.campaign)["model_version"].astype(int))
        versions = [v for v in (rt.base_version(), champion) if v not in measured]
        return evaluate_sealed(rt, iteration, versions) if versions else {"sealed_problems": 0, "sealed_s": 0.0}
    return evaluate_sealed(rt, iteration, [rt.base_version(), champion])


def promote(rt: Runtime, iteration: int) -> dict[str, Any]:
    rule = rt.config.promotion
    evaluated = stage_metrics(rt, iteration, "evaluate")
    if evaluated.get("skipped"):
        # nothing was judged: no decision row, so a skipped gate never counts as a failed one
        return {"skipped": evaluated["skipped"], "promoted": 0.0, "points_gained": 0.0}
    challenger, champion = challenger_of(rt, iteration), champion_of(rt, iteration)
    evals = rt.store.gate_answers(rt.campaign, iteration)
    if evals.empty or challenger not in set(evals["model_version"]):
        raise RuntimeError(f"iteration {iteration} has no evaluation of v{challenger}: run evaluate first")
    scores = evals.pivot_table(index=["problem_id", "env"], columns="model_version", values="reward").reset_index()
    scores["challenger"] = scores[challenger]
    scores["champion"] = scores[champion] if champion in scores else scores[challenger]
    total = len(scores)
    scores = scores.dropna(subset=["challenger", "champion"])  # an evaluation stopped early
    stopped = str(evaluated.get("stopped") or "")
    bounds = evaluated.get("efficacy_bounds")
    look = int(evaluated.get("stopped_look", len(bounds) - 1 if bounds else 0))
    efficacy = len(scores) < total and stopped.startswith("stopped for efficacy")
    decision = decide(scores, rule, seed_for(rt.config.seed, iteration, "promote"),
                      boundary=(bounds[look] if bounds[look] is not None else math.inf) if bounds else None,
                      stopped_early=efficacy)
    if efficacy and decision["promoted"]:
        decision["reason"] += f"; {stopped}"
    if challenger == champion:
        decision.update(promoted=False, reason="kept champion: the challenger is the champion")
    elif len(scores) < total and not efficacy:
        decision.update(promoted=False, reason=(
            f"kept champion: evaluation stopped for futility after {len(scores)} of {total} problems "
            f"(gain {decision['gain']:+.3f}, P(not worse) = {decision['p_not_worse']:.3f})"))
    # a person confirms what the gate passed (promotion.approval = "required"): the flow run pauses here
    decision = request_approval(rt, iteration, decision, scores, challenger, champion)

    challenger_pass1, champion_pass1 = float(scores["challenger"].mean()), float(scores["champion"].mean())
    # a gate refused for want of evidence while the challenger was ahead does not count toward a reset; a
    # person's refusal (or the approval's timeout) always does: they judged the challenger, not the evidence
    counted = not decision["promoted"] and (decision.get("refused_by_person", False) or not ahead(
        challenger_pass1, champion_pass1, decision["per_env"], rule))
    failures = 0 if decision["promoted"] else _consecutive_failures(rt, iteration) + counted
    reset = counted and bool(rule.reset_after_failures) and failures >= rule.reset_after_failures
    new_champion = challenger if decision["promoted"] else champion
    if reset:
        decision["reason"] += f"; trainee reset to champion v{new_champion} after {failures} failed gates"
    elif not decision["promoted"] and not counted:
        decision["reason"] += "; the challenger was ahead, so the trainee trains on (no reset)"
    rt.store.record_decision(rt.campaign, iteration, {
        "challenger_version": challenger, "champion_version": champion, "promoted": decision["promoted"],
        "challenger_pass1": challenger_pass1, "champion_pass1": champion_pass1,
        "p_better": decision["p_better"], "gain_low": decision["gain_low"], "gain_high": decision["gain_high"],
        "per_env": to_json(decision["per_env"]), "reason": decision["reason"], "reset_trainee": reset,
        "decided_at": now(),
    }, trainee=new_champion if reset else None)
    # the decision (and a reset trainee) is on record, in one transaction, before any alias moves: a crash here
    # reruns this stage with the same champion (champion_of reads the record), and the projection repairs MLflow
    rt.tracker.project_lineage(rt.store, rt.campaign)
    run_id = rt.tracker.run_id(iteration)
    rt.tracker.set_tags(run_id, {
        "promotion.promoted": decision["promoted"], "promotion.reason": decision["reason"],
        "promotion.challenger_version": challenger, "promotion.champion_version": champion,
    })
    sealed = _sealed(rt, iteration, new_champion, decision["promoted"])
    _publish_artifacts(rt, iteration, decision, challenger, champion)
    _log_figure(rt, iteration, run_id)
    spent = rt.store.iteration_dollars(rt.campaign, iteration, excluding="promote")
    points = 100 * decision["gain"] if decision["promoted"] else 0.0
    return {"promoted": float(decision["promoted"]), "gain": decision["gain"], "p_better": decision["p_better"],
            "iteration_dollars": spent, "points_gained": points, "points_per_dollar": points / spent if spent else 0.0,
            "gain_low": decision["gain_low"], "gain_high": decision["gain_high"],
            "champion_version": new_champion, "failed_gates": failures, "reset_trainee": float(reset),
            "z": decision["z"], **sealed}


def rollback(rt: Runtime, to_version: int | None = None, reason: str = "manual rollback", *,
             actor: str | None = None, allow_unpromoted: bool = False) -> dict[str, Any]:
    """Move ``champion`` back (to ``to_version``, else to ``previous_champion``) and train from it next.

    The champion being replaced becomes ``previous_champion``, so a rollback can itself be undone, and
    the trainee is reset to the restored champion: the next iteration samples from it. A version that was never
    champion (a challenger the gate refused, or one never gated) is restored only with ``allow_unpromoted``;
    the rollback records ``actor`` (default: the OS user), the machine, and whether it was such a version.
    """
    current = rt.champion_version()
    target = to_version if to_version is not None else rt.previous_champion_version()
    if target is None:
        raise StoreError(f"campaign {rt.campaign!r} has no previous_champion to roll back to; pass --to VERSION")
    if str(rt.store.model_version(rt.campaign, target)["kind"]).endswith("-deleted"):  # unknown: a clear error
        raise StoreError(f"v{target} of campaign {rt.campaign!r} was deleted by checkpoint retention "
                         "(retention.keep_challengers): it cannot be restored")
    if target == current:
        raise StoreError(f"v{target} is already the champion of campaign {rt.campaign!r}")
    unpromoted = not rt.store.was_champion(rt.campaign, target)
    if unpromoted and not allow_unpromoted:
        raise StoreError(f"v{target} of campaign {rt.campaign!r} was never champion (the gate refused it, or never "
                         "decided on it): a rollback restores a version that was. To serve it anyway, pass "
                         "--allow-unpromoted (recorded with your name)")
    who = actor_name(actor)
    rt.store.record_rollback(rt.campaign, current, target, reason, actor=who, host=socket.gethostname(),
                             unpromoted=unpromoted)
    rt.tracker.project_lineage(rt.store, rt.campaign)
    return {"campaign": rt.campaign, "champion": target, "previous_champion": current, "trainee": target,
            "actor": who, "unpromoted": unpromoted}


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, "promote", iteration, promote)
