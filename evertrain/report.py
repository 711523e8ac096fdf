"""The per-iteration report: what each iteration cost and what it bought."""

from __future__ import annotations

import json
from typing import Any

from evertrain.data.store import Store

COLUMNS = [
    ("iteration", "iter"), ("mean_reward", "mean reward"), ("zero_variance_share", "zero-var groups"),
    ("gate_challenger_pass1", "challenger pass@1"), ("gate_champion_pass1", "champion pass@1"),
    ("challenger_eval_share", "share evaluated"),
    ("challenger_version", "challenger"), ("promoted", "promoted"), ("wall_s", "wall s"), ("cpu_s", "cpu s"),
    ("tokens", "tokens"), ("dollars", "$"),
]


def iteration_report(store: Store, campaign: str) -> list[dict[str, Any]]:
    """One dict per iteration of ``campaign`` with its headline numbers (None where a stage has not run)."""
    stages = store.query(
        "SELECT iteration, stage, status, wall_s, cpu_s, metrics FROM stage_runs WHERE campaign = ? ORDER BY iteration",
        [campaign],
    )
    promotions = store.query("SELECT * FROM promotions WHERE campaign = ?", [campaign]).set_index("iteration")
    rows: list[dict[str, Any]] = []
    for iteration, group in stages.groupby("iteration", sort=True):
        metrics = {row.stage: json.loads(row.metrics or "{}") for row in group.itertuples(index=False)}
        status = dict(zip(group["stage"], group["status"], strict=True))
        curate, rollout, score = metrics.get("curate", {}), metrics.get("rollout", {}), metrics.get("score", {})
        evaluate, update = metrics.get("evaluate", {}), metrics.get("update", {})
        decision = promotions.loc[iteration] if iteration in promotions.index else None
        tokens = sum(int(m.get(k, 0) or 0) for m in (rollout,)
                     for k in ("prompt_tokens", "completion_tokens"))
        tokens += int(evaluate.get("challenger_completion_tokens", 0) or 0)
        tokens += int(evaluate.get("champion_completion_tokens", 0) or 0)
        rows.append({
            "iteration": int(iteration),
            "status": "completed" if len(status) == 6 and set(status.values()) == {"completed"} else
            ", ".join(f"{k}:{v}" for k, v in status.items() if v != "completed") or "partial",
            "mean_reward": score.get("mean_reward"),
            "zero_variance_share": score.get("zero_variance_share"),
            "zero_variance_share_unfiltered_est": _unfiltered_zero_variance(curate, score),
            "dropped": {k.removeprefix("dropped_"): v for k, v in curate.items() if k.startswith("dropped_")},
            "pass1_challenger": evaluate.get("pass1_challenger"),
            # below 1 where the gate stopped a clearly worse challenger early (pass@1 is then on that share)
            "challenger_eval_share": evaluate.get("challenger_eval_share"),
            "pass1_champion": evaluate.get("pass1_champion"),
            "pass1_by_env": {k.removeprefix("pass1_challenger_"): v for k, v in evaluate.items()
                             if k.startswith("pass1_challenger_")},
            "challenger_version": update.get("challenger_version"),
            "champion_version": None if decision is None else int(decision["champion_version"]),
            "promoted": None if decision is None else bool(decision["promoted"]),
            "promotion_reason": None if decision is None else decision["reason"],
            # what the gate compared: both on the same problems (a share of them where it stopped early)
            "gate_challenger_pass1": evaluate.get("pass1_challenger") if decision is None
            else float(decision["challenger_pass1"]),
            "gate_champion_pass1": evaluate.get("pass1_champion") if decision is None
            else float(decision["champion_pass1"]),
            "wall_s": float(group["wall_s"].fillna(0).sum()),
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


def _unfiltered_zero_variance(curate: dict[str, Any], score: dict[str, Any]) -> float | None:
    """Zero-variance share had the difficulty filter not run: the problems it dropped count as
    zero-variance groups (all their last k attempts agreed)."""
    share, problems = score.get("zero_variance_share"), curate.get("problems")
    if share is None or not problems:
        return None
    skipped = int(curate.get("dropped_too_easy", 0)) + int(curate.get("dropped_too_hard", 0))
    return (share * problems + skipped) / (problems + skipped)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if 0 < abs(value) < 0.01:
            return f"{value:.2g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def render_table(rows: list[dict[str, Any]], title: str) -> None:
    """Print the report as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for _, header in COLUMNS:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*[_cell(row.get(key)) for key, _ in COLUMNS])
    console = Console()
    if not console.is_terminal:  # piped or logged: never truncate a column to fit 80 characters
        console = Console(width=max(console.width, 160))
    console.print(table)


def current_champion(store: Store, campaign: str) -> int | None:
    """The champion after the campaign's last promotion decision or rollback, as the store recorded them."""
    events = store.query(
        """SELECT decided_at AS stamp, CASE WHEN promoted THEN challenger_version ELSE champion_version END AS v
           FROM promotions WHERE campaign = ?
           UNION ALL SELECT rolled_back_at, to_version FROM rollbacks WHERE campaign = ?
           ORDER BY stamp DESC LIMIT 1""", [campaign, campaign])
    return None if events.empty else int(events["v"].iloc[0])


def champion_vs_base(store: Store, campaign: str, samples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """Per environment: held-out pass@1 of the base model and of the current champion on the same problems,
    and the gain with a 95% paired bootstrap interval."""
    import numpy as np

    champion = current_champion(store, campaign)
    base = store.scalar("SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'", [campaign])
    if champion is None or base is None:
        return []
    frame = store.query(
        """SELECT model_version, env, problem_id, any_value(reward) AS reward FROM evals
           WHERE campaign = ? AND sample = 0 AND model_version IN (?, ?) GROUP BY ALL""",
        [campaign, int(base), champion])
    rows = []
    rng = np.random.default_rng(seed)
    for env, part in frame.groupby("env"):
        paired = part.pivot_table(index="problem_id", columns="model_version", values="reward").dropna()
        if paired.empty or champion not in paired or int(base) not in paired:
            continue
        diff = (paired[champion] - paired[int(base)]).to_numpy()
        boot = diff[rng.integers(0, len(diff), size=(samples, len(diff)))].mean(axis=1)
        rows.append({"env": env, "problems": len(diff), "base_version": int(base), "champion_version": champion,
                     "base_pass1": float(paired[int(base)].mean()), "champion_pass1": float(paired[champion].mean()),
                     "gain": float(diff.mean()), "gain_low": float(np.quantile(boot, 0.025)),
                     "gain_high": float(np.quantile(boot, 0.975))})
    return rows
