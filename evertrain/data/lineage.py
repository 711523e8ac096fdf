"""What the store answers about a campaign's versions and iterations: the questions stages, the endpoint, retention,
approval, export and the report ask (the report renders the answers; it asks through here).

- the per-iteration headline numbers (:func:`iteration_report`);
- the champion against the base model and the last refused challenger, per environment and split, with paired
  bootstrap intervals (:func:`champion_vs_base`, :func:`last_refusal`);
- sample rollouts and the samples' diversity (:func:`sample_rollouts`, :func:`diversity`);
- the endpoint's live pass rate per environment, tool and version, now and over time (:func:`live_pass_rates`).

The champion is the store's lineage events' (:meth:`~evertrain.data.queries.Queries.champion_history`): one query
for every caller.
"""

from __future__ import annotations

import json
from typing import Any

import duckdb
import pandas as pd

from evertrain.data.store import Store
from evertrain.stats import mean_interval, wilson

# the order splits are listed in (the report names them: evertrain.report.SPLIT_LABELS)
SPLITS = ("gate", "test", "transfer", "broad")


def aliases(store: Store, campaign: str) -> dict[str, int | None]:
    """Where the campaign's lineage says MLflow's aliases point: ``champion`` and ``previous_champion`` (the
    promotion decisions and rollbacks, else the base model) and ``challenger`` (the newest version an update
    registered). The store is the authority; the aliases are their projection (``Tracker.project_lineage``)."""
    champion, previous = store.champion_history(campaign)
    return {"champion": champion, "previous_champion": previous, "challenger": store.latest_challenger(campaign)}


def evaluation_seconds(stage_wall: dict[str, Any], metrics: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """Wall seconds an iteration spent on the gate's evaluation, and on measuring the sealed splits."""
    return (float(stage_wall.get("evaluate") or 0),
            float(metrics.get("promote", {}).get("sealed_s", 0) or 0))


def iteration_report(store: Store, campaign: str, only: int | None = None,
                     since: int | None = None) -> list[dict[str, Any]]:
    """One dict per iteration of ``campaign`` with its headline numbers (None where a stage has not run). With
    ``only``, that iteration's alone, read by a query bounded to it (the loop's line as each iteration ends: its
    cost does not grow with the campaign); with ``since``, the iterations from that one on. Running totals
    (points gained, dollars) then cover the iterations read."""
    stages = store.stage_runs(campaign, only, since)
    promotions = store.promotions(campaign, only, since).set_index("iteration")
    rows: list[dict[str, Any]] = []
    for iteration, group in stages.groupby("iteration", sort=True):
        metrics = {row.stage: json.loads(row.metrics or "{}") for row in group.itertuples(index=False)}
        status = dict(zip(group["stage"], group["status"], strict=True))
        curate, rollout, score = metrics.get("curate", {}), metrics.get("rollout", {}), metrics.get("score", {})
        evaluate, update = metrics.get("evaluate", {}), metrics.get("update", {})
        decision = promotions.loc[iteration] if iteration in promotions.index else None
        skipped = metrics.get("promote", {}).get("skipped") or evaluate.get("skipped")
        wall = float(group["wall_s"].fillna(0).sum())
        eval_s, sealed_s = evaluation_seconds({row.stage: row.wall_s for row in group.itertuples(index=False)},
                                              metrics)
        tokens = sum(int(m.get(k, 0) or 0) for m in (rollout,)
                     for k in ("prompt_tokens", "completion_tokens"))
        tokens += int(evaluate.get("challenger_completion_tokens", 0) or 0)
        tokens += int(evaluate.get("champion_completion_tokens", 0) or 0)
        rows.append({
            "iteration": int(iteration),
            # the six stages; an optional one (sft) may be there too
            "status": "completed" if all(status.get(s) == "completed" for s in
                                         ("curate", "rollout", "score", "update", "evaluate", "promote")) else
            ", ".join(f"{k}:{v}" for k, v in status.items() if v != "completed") or "partial",
            "mean_reward": score.get("mean_reward"),
            "zero_variance_share": score.get("zero_variance_share"),
            "zero_variance_share_unfiltered_est": _unfiltered_zero_variance(curate, score),
            "dropped": {k.removeprefix("dropped_"): v for k, v in curate.items() if k.startswith("dropped_")},
            # the curriculum level each environment was drawn at, and the samples' diversity (evertrain.curriculum)
            "curriculum_levels": {k.removeprefix("curriculum_level_"): v for k, v in curate.items()
                                  if k.startswith("curriculum_level_")},
            "distinct_completions": score.get("diversity_distinct_completions"),
            "token_entropy": score.get("diversity_token_entropy"),
            "informative_share": score.get("diversity_informative_share"),
            # the frontier (evertrain.frontier, frontier.enabled): what was predicted, guided and observed
            "guided_share": curate.get("guided_share"),
            "guidance_level_mean": curate.get("guidance_level_mean"),
            "predicted_informative": curate.get("predicted_informative_share"),
            "skipped_uninformative": curate.get("dropped_uninformative"),
            "frontier_s": curate.get("frontier_s"),
            "informative_bare": score.get("informative_share_bare"),
            "informative_guided": score.get("informative_share_guided"),
            "groups_bare": score.get("groups_bare"), "groups_guided": score.get("groups_guided"),
            "pass1_challenger": evaluate.get("pass1_challenger"),
            # below 1 where the gate stopped a clearly worse challenger early (pass@1 is then on that share)
            "challenger_eval_share": evaluate.get("challenger_eval_share"),
            "pass1_champion": evaluate.get("pass1_champion"),
            "pass1_by_env": {k.removeprefix("pass1_challenger_"): v for k, v in evaluate.items()
                             if k.startswith("pass1_challenger_")},
            "challenger_version": update.get("challenger_version"),
            "champion_version": None if decision is None else int(decision["champion_version"]),
            "promoted": None if decision is None else bool(decision["promoted"]),
            "promotion_reason": skipped if decision is None else decision["reason"],
            # what the gate compared: both on the same problems (a share of them where it stopped early)
            "gate_challenger_pass1": evaluate.get("pass1_challenger") if decision is None
            else float(decision["challenger_pass1"]),
            "gate_champion_pass1": evaluate.get("pass1_champion") if decision is None
            else float(decision["champion_pass1"]),
            "gate_problems": evaluate.get("eval_problems"),
            "gain_low": None if decision is None else _finite(decision["gain_low"]),
            "gain_high": None if decision is None else _finite(decision["gain_high"]),
            "wall_s": wall, "eval_s": eval_s, "sealed_s": sealed_s, "eval_share": eval_s / wall if wall else None,
            "cpu_s": float(group["cpu_s"].fillna(0).sum()),
            "tokens": tokens,
            "trained_sequences": update.get("trained_sequences"),
            "gpu_s": sum(float(m.get("gpu_s", 0) or 0) for m in metrics.values()),
            "cached_prompt_tokens": int(rollout.get("cached_prompt_tokens", 0) or 0),
            "dollars": sum(float(m.get("dollars", 0) or 0) for m in metrics.values()),
            "points_gained": metrics.get("promote", {}).get("points_gained"),
            "stage_wall_s": {row.stage: row.wall_s for row in group.itertuples(index=False)},
        })
    base = next((r["pass1_champion"] for r in rows if r["pass1_champion"] is not None), None)
    spent = 0.0
    for row in rows:
        spent += row["dollars"]
        current = row["pass1_challenger"] if row["promoted"] else row["pass1_champion"]
        row["cumulative_dollars"] = spent
        row["points_gained_total"] = None if base is None or current is None else 100 * (current - base)
        row["points_per_dollar_total"] = (row["points_gained_total"] / spent
                                          if spent and row["points_gained_total"] is not None else None)
    return rows


def sealed_curve(store: Store, campaign: str) -> list[dict[str, Any]]:
    """Greedy pass@1 of the base model and of each champion on the sealed splits, with its 95% Wilson
    interval: version, split, iteration (the one whose promotion measured it), problems, pass1, low, high."""
    rows = []
    for row in store.sealed_pass_counts(campaign).to_dict("records"):
        problems, passed = int(row["problems"]), int(row["passed"] or 0)
        low, high = wilson(passed, problems)
        rows.append({"version": int(row["model_version"]), "split": row["split"], "iteration": int(row["iteration"]),
                     "problems": problems, "pass1": passed / problems if problems else None, "low": low, "high": high})
    return rows


def _finite(value: Any) -> float | None:
    return None if value is None or value != value else float(value)  # NULL reads back as NaN in pandas


def _unfiltered_zero_variance(curate: dict[str, Any], score: dict[str, Any]) -> float | None:
    """Zero-variance share had the difficulty filter not run: the problems it dropped count as
    zero-variance groups (all their last k attempts agreed)."""
    share, problems = score.get("zero_variance_share"), curate.get("problems")
    if share is None or not problems:
        return None
    skipped = int(curate.get("dropped_too_easy", 0)) + int(curate.get("dropped_too_hard", 0))
    return (share * problems + skipped) / (problems + skipped)


def paired_gains(frame: Any, before: int, after: int, samples: int, seed: int) -> list[dict[str, Any]]:
    """Per environment and split: pass@1 of ``before`` and ``after`` on the problems both answered, and the
    gain with a 95% paired bootstrap interval (resampling problems)."""
    rows = []
    order = {split: i for i, split in enumerate(SPLITS)}
    groups = sorted(frame.groupby(["env", "split"]), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9)))
    for (env, split), part in groups:
        paired = part.pivot_table(index="problem_id", columns="model_version", values="reward").dropna()
        if paired.empty or after not in paired or before not in paired:
            continue
        diff = (paired[after] - paired[before]).to_numpy()
        low, high = mean_interval(diff, samples=samples, seed=seed)
        rows.append({"env": env, "split": split, "problems": len(diff),
                     "before_pass1": float(paired[before].mean()), "after_pass1": float(paired[after].mean()),
                     "gain": float(diff.mean()), "gain_low": low, "gain_high": high})
    return rows


def champion_vs_base(store: Store, campaign: str, samples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Per environment and split: pass@1 of the base model and of the current champion on the same problems,
    and the gain with a 95% paired bootstrap interval. Splits: ``gate`` (what every promotion looked at),
    and the sealed ``test`` and ``transfer`` splits (measured after promotions, never looked at by one);
    the gate's gain above the sealed test gain shows how far the gate's repeated use flatters it."""
    champion, _ = store.champion_history(campaign)
    base = store.base_version(campaign)
    if champion is None or base is None:
        return []
    frame = store.greedy_answers(campaign, (base, champion))
    rows = []
    for row in paired_gains(frame, int(base), champion, samples, seed):
        before, after = row.pop("before_pass1"), row.pop("after_pass1")
        rows.append({**row, "base_version": int(base), "champion_version": champion,
                     "base_pass1": before, "champion_pass1": after})
    gate = {r["env"]: r["gain"] for r in rows if r["split"] == "gate"}
    for row in rows:
        if row["split"] == "test" and row["env"] in gate:
            row["gate_optimism"] = gate[row["env"]] - row["gain"]
    return rows


def last_refusal(store: Store, campaign: str, samples: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """When the campaign's last gate kept the champion: that challenger against the champion, per environment,
    on the gate's problems both answered (what the gate weighed), with the gate's reason; None otherwise.
    A refused challenger is often better overall and worse on one domain: this says which."""
    last = store.last_promotion(campaign)
    if last is None or bool(last["promoted"]) or pd.isna(last["challenger_version"]):
        return None
    iteration, challenger = int(last["iteration"]), int(last["challenger_version"])
    champion = int(last["champion_version"])
    frame = store.refused_gate_answers(campaign, iteration, challenger, champion)
    envs = [{"env": r["env"], "problems": r["problems"], "champion_pass1": r["before_pass1"],
             "challenger_pass1": r["after_pass1"], "gain": r["gain"], "gain_low": r["gain_low"],
             "gain_high": r["gain_high"]} for r in paired_gains(frame, champion, challenger, samples, seed)]
    return {"iteration": iteration, "challenger_version": challenger, "champion_version": champion,
            "reason": str(last["reason"]), "envs": envs}


def sample_rollouts(store: Store, campaign: str, iteration: int, env: str | None = None,
                    per_env: int = 4) -> list[dict[str, Any]]:
    """Up to ``per_env`` scored rollouts of each environment of ``iteration`` (a passed one first where there
    is one), with their turns parsed: what `evertrain show` prints and what MLflow gets as a table."""
    frame = store.sample_rollouts(campaign, iteration, env, per_env)
    rows = frame.to_dict("records")
    for row in rows:
        row["turns"] = json.loads(row["turns"]) if isinstance(row["turns"], str) and row["turns"] else []
    return rows


def diversity(store: Store, campaign: str, iteration: int | None = None) -> list[dict[str, Any]]:
    """Per iteration (all, or ``iteration``), from the STORED scored rollouts: groups, mean distinct completions
    per group and their share of the group's samples, mean token entropy estimated from the sampling
    log-probs (-mean log-prob of the sampled policy tokens: an unbiased estimate of the per-token entropy of
    the distribution sampled from), the share of informative groups (rewards not all equal), and the sampling
    temperature (the lowest of the iteration's; None in a store older than the column)."""
    frame = store.group_diversity(campaign, iteration)
    out = []
    for it, part in frame.groupby("iteration", sort=True):
        tokens = float(part["tokens"].sum())
        out.append({"iteration": int(it), "groups": len(part),
                    "distinct_completions": float(part["distinct_completions"].mean()),
                    "distinct_share": float((part["distinct_completions"] / part["samples"]).mean()),
                    "token_entropy": float(part["neg_logprob"].sum()) / tokens if tokens else None,
                    "informative_share": float(part["informative"].astype(float).mean()),
                    "temperature": None if part["temperature"].isna().all() else float(part["temperature"].min())})
    return out


def diversity_metrics(store: Store, campaign: str, iteration: int) -> dict[str, float]:
    """:func:`diversity` of one iteration as stage metrics (``diversity_*``; empty before anything is scored)."""
    rows = diversity(store, campaign, iteration)
    if not rows:
        return {}
    return {f"diversity_{key}": value for key, value in rows[0].items()
            if key != "iteration" and value is not None}


def live_pass_rates(store: Store, campaign: str, bucket_minutes: float | None = None) -> pd.DataFrame:
    """Pass rate of the served model per environment, tool and model version (and per time bucket of
    ``bucket_minutes`` when given), from the traces that have an outcome. Columns: env, tools,
    model_version, [bucket,] requests, passed, pass_rate, low, high (a 95% Wilson interval)."""
    frame = store.trace_outcome_counts(campaign, max(1, round(bucket_minutes * 60)) if bucket_minutes else None)
    if frame.empty:
        return frame.assign(pass_rate=[], low=[], high=[])
    rates = [wilson(int(p), int(n)) for p, n in zip(frame["passed"], frame["requests"], strict=True)]
    frame["pass_rate"] = frame["passed"] / frame["requests"]
    frame["low"] = [r[0] for r in rates]
    frame["high"] = [r[1] for r in rates]
    return frame


def live_pass_rate_series(store: Store, campaign: str, points: int = 24) -> pd.DataFrame:
    """:func:`live_pass_rates` over time: the span from the first to the last trace with an outcome cut into
    about ``points`` equal buckets (at least one second each), so the series reads alike over an afternoon's
    demo and a month of traffic. Columns as :func:`live_pass_rates`, with ``bucket`` (the bucket's start)."""
    first, last = store.trace_outcome_span(campaign)
    if first is None or pd.isna(first):
        return live_pass_rates(store, campaign).assign(bucket=[])
    seconds = (pd.Timestamp(last) - pd.Timestamp(first)).total_seconds()
    width = max(1, int(seconds / max(points, 1)) + 1)
    return live_pass_rates(store, campaign, bucket_minutes=width / 60)


def live_pass_rate(store: Store, campaign: str) -> list[dict[str, Any]]:
    """The endpoint's live pass rate per environment, tool and model version (from the traces that have an outcome)."""
    try:
        return live_pass_rates(store, campaign).to_dict("records")
    except duckdb.Error:  # a store written before the traces tables existed, opened read-only
        return []


def live_pass_rate_over_time(store: Store, campaign: str, points: int = 24) -> list[dict[str, Any]]:
    """The endpoint's live pass rate per environment, tool and model version over time (about ``points``
    time buckets over the traces' span): the HTML page's live plot."""
    try:
        frame = live_pass_rate_series(store, campaign, points)
    except duckdb.Error:  # a store written before the traces tables existed, opened read-only
        return []
    return [{**r, "bucket": r["bucket"].to_pydatetime() if hasattr(r["bucket"], "to_pydatetime") else r["bucket"]}
            for r in frame.to_dict("records")]
