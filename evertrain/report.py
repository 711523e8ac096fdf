"""The per-iteration report: what each iteration cost and what it bought."""

from __future__ import annotations

import json
from typing import Any

from evertrain.data.store import Store

COLUMNS = [
    ("iteration", "iter"), ("mean_reward", "mean reward"), ("zero_variance_share", "zero-var groups"),
    ("gate_challenger_pass1", "challenger pass@1"), ("gate_champion_pass1", "champion pass@1"),
    ("challenger_eval_share", "share evaluated"),
    ("challenger_version", "challenger"), ("promoted", "promoted"), ("wall_s", "wall s"),
    ("eval_share", "eval share"), ("cpu_s", "cpu s"), ("tokens", "tokens"), ("dollars", "$"),
]

SPLIT_LABELS = {
    "gate": "gate's held-out set, seen at every promotion",
    "test": "sealed test split, never seen by curation or the gate",
    "transfer": "sealed transfer split: phrasings and operators never trained on, no worked examples",
    "broad": "broad sealed set: every curriculum level and the transfer phrasings, drawn once at the start",
}


def evaluation_seconds(stage_wall: dict[str, Any], metrics: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """Wall seconds an iteration spent on the gate's evaluation, and on measuring the sealed splits."""
    return (float(stage_wall.get("evaluate") or 0),
            float(metrics.get("promote", {}).get("sealed_s", 0) or 0))


def evaluation_share(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Shares of all stage wall time the rows spent on the gate's evaluation and on the sealed splits."""
    total = sum(r["wall_s"] for r in rows)
    if not total:
        return None
    return sum(r["eval_s"] for r in rows) / total, sum(r["sealed_s"] for r in rows) / total


def share_line(rows: list[dict[str, Any]]) -> str | None:
    """The run's evaluation cost in one line: the gate, and the sealed measurement beside it."""
    shares = evaluation_share(rows)
    if shares is None:
        return None
    return (f"the gate's evaluation took {shares[0]:.0%} of the stages' wall time, measuring the sealed splits "
            f"{shares[1]:.0%}")


def iteration_report(store: Store, campaign: str) -> list[dict[str, Any]]:
    """One dict per iteration of ``campaign`` with its headline numbers (None where a stage has not run)."""
    stages = store.stage_runs(campaign)
    promotions = store.promotions(campaign).set_index("iteration")
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
    return store.champion_from_events(campaign)


def _paired_gains(frame: Any, before: int, after: int, samples: int, seed: int) -> list[dict[str, Any]]:
    """Per environment and split: pass@1 of ``before`` and ``after`` on the problems both answered, and the
    gain with a 95% paired bootstrap interval (resampling problems)."""
    from evertrain.stats import mean_interval

    rows = []
    order = {split: i for i, split in enumerate(SPLIT_LABELS)}
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
    champion = current_champion(store, campaign)
    base = store.base_version(campaign)
    if champion is None or base is None:
        return []
    frame = store.greedy_answers(campaign, (base, champion))
    rows = []
    for row in _paired_gains(frame, int(base), champion, samples, seed):
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
    import pandas as pd

    last = store.last_promotion(campaign)
    if last is None or bool(last["promoted"]) or pd.isna(last["challenger_version"]):
        return None
    iteration, challenger = int(last["iteration"]), int(last["challenger_version"])
    champion = int(last["champion_version"])
    frame = store.refused_gate_answers(campaign, iteration, challenger, champion)
    envs = [{"env": r["env"], "problems": r["problems"], "champion_pass1": r["before_pass1"],
             "challenger_pass1": r["after_pass1"], "gain": r["gain"], "gain_low": r["gain_low"],
             "gain_high": r["gain_high"]} for r in _paired_gains(frame, champion, challenger, samples, seed)]
    return {"iteration": iteration, "challenger_version": challenger, "champion_version": champion,
            "reason": str(last["reason"]), "envs": envs}


def format_refusal(refusal: dict[str, Any] | None) -> list[str]:
    """The refused challenger's lines: the gate's reason, then its per-environment gain over the champion."""
    if not refusal:
        return []
    lines = [f"last gate (iteration {refusal['iteration']}): challenger v{refusal['challenger_version']} refused "
             f"({refusal['reason']})"]
    for e in refusal["envs"]:
        lines.append(f"  {e['env']}: challenger {e['challenger_pass1']:.3f} vs champion v{refusal['champion_version']} "
                     f"{e['champion_pass1']:.3f} on {e['problems']} problems: {e['gain']:+.3f} "
                     f"(95% CI [{e['gain_low']:+.3f}, {e['gain_high']:+.3f}])")
    return lines


def format_versus(s: dict[str, Any]) -> str:
    """One champion-vs-base line, naming the split it was measured on."""
    split = s.get("split", "gate")
    line = (f"{s['env']} [{split}]: champion v{s['champion_version']} pass@1 {s['champion_pass1']:.3f} vs base "
            f"v{s['base_version']} {s['base_pass1']:.3f} on {s['problems']} problems "
            f"({SPLIT_LABELS.get(split, split)}): gain {s['gain']:+.3f} "
            f"(95% CI [{s['gain_low']:+.3f}, {s['gain_high']:+.3f}])")
    if "gate_optimism" in s:
        line += f"; the gate's gain exceeds this by {s['gate_optimism']:+.3f}"
    return line


def sample_rollouts(store: Store, campaign: str, iteration: int, env: str | None = None,
                    per_env: int = 4) -> list[dict[str, Any]]:
    """Up to ``per_env`` scored rollouts of each environment of ``iteration`` (a passed one first where there
    is one), with their turns parsed: what `evertrain show` prints and what MLflow gets as a table."""
    frame = store.sample_rollouts(campaign, iteration, env, per_env)
    rows = frame.to_dict("records")
    for row in rows:
        row["turns"] = json.loads(row["turns"]) if isinstance(row["turns"], str) and row["turns"] else []
    return rows


def render_rollouts(rows: list[dict[str, Any]], title: str, prompt_chars: int = 600) -> None:
    """Print rollouts as panels: the prompt's tail, every turn (tool calls and their output), the verdict."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = Console()
    if not console.is_terminal:  # piped or captured: never cut a problem id or a turn to fit 80 columns
        console = Console(width=max(console.width, 160))
    console.rule(title)
    for row in rows:
        body = Text()
        prompt = str(row.get("prompt_text") or "")
        body.append(("…" if len(prompt) > prompt_chars else "") + prompt[-prompt_chars:] + "\n", style="dim")
        turns = row.get("turns") or [{"role": "assistant", "content": row.get("completion") or ""}]
        for number, turn in enumerate(turns, 1):
            if turn.get("role") == "tool":
                call = f"{turn.get('name', 'tool')}({json.dumps(turn.get('input'), default=str)})"
                body.append(f"[{number}] tool {call}\n", style="bold cyan")
                body.append(f"{turn.get('output', turn.get('content', ''))}\n", style="cyan")
            else:
                body.append(f"[{number}] assistant\n", style="bold green")
                body.append(f"{turn.get('content', '')}\n")
        verdict = f"reward {row.get('reward')} · {row.get('reason')} · finish {row.get('finish_reason')}"
        console.print(Panel(body, title=f"{row['env']} · {row['problem_id']} · sample {row['sample']}",
                            subtitle=verdict))


def mix_over_iterations(store: Store, campaign: str) -> list[dict[str, Any]]:
    """The adaptive mix of every iteration (the store's ``mix`` table): per environment its share, problems,
    recent pass rate, informative-group share and learnability. Empty when the mix is not adaptive."""
    return store.mix_rows(campaign)


def format_mix(rows: list[dict[str, Any]]) -> list[str]:
    """The mix over iterations as text lines: one per iteration, each environment's share and problems."""
    lines: dict[int, list[str]] = {}
    for row in rows:
        learn = row.get("learnability")
        lines.setdefault(int(row["iteration"]), []).append(
            f"{row['env']} {row['share']:.2f} ({int(row['problems'])}, learnability "
            f"{'-' if learn is None else f'{learn:.2f}'})")
    return [f"mix i={iteration}: " + ", ".join(parts) for iteration, parts in sorted(lines.items())]


def agent_metrics(store: Store, campaign: str) -> list[dict[str, Any]]:
    """Per tool-using environment, base against current champion on the gate's held-out problems (greedy):
    pass@1, the share of episodes that called a tool, assistant turns per solved problem, and rework (tool
    calls made after an earlier call failed), per episode."""
    champion = current_champion(store, campaign)
    base = store.base_version(campaign)
    if champion is None or base is None:
        return []
    frame = store.greedy_answers(campaign, (base, champion), gate_only=True)
    out = []
    with_tools = {env for env, part in frame.groupby("env") if (part["tool_calls"].fillna(0) > 0).any()}
    for (env, version), part in frame.groupby(["env", "model_version"], sort=True):
        if env not in with_tools:
            continue  # no tool call by either version: not an agentic environment
        solved = part[part["passed"].fillna(False).astype(bool)]
        turns = [sum(1 for t in json.loads(x or "[]") if t.get("role") == "assistant") for x in solved["turns"]]
        out.append({"env": env, "version": int(version), "role": "champion" if version == champion else "base",
                    "problems": len(part), "pass1": float(part["reward"].mean()),
                    "tool_call_rate": float((part["tool_calls"].fillna(0) > 0).mean()),
                    "turns_per_solved": sum(turns) / len(turns) if turns else None,
                    "rework": float(part["rework"].fillna(0).mean())})
    return out


def format_agent(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['env']} {r['role']} v{r['version']}: pass@1 {r['pass1']:.3f}, tool-call rate "
            f"{r['tool_call_rate']:.3f}, turns per solved problem "
            f"{'-' if r['turns_per_solved'] is None else format(r['turns_per_solved'], '.2f')}, rework "
            f"{r['rework']:.3f} per episode, on {r['problems']} held-out problems" for r in rows]


def live_pass_rate(store: Store, campaign: str) -> list[dict[str, Any]]:
    """The endpoint's live pass rate per environment, tool and model version (evertrain.serving.traces)."""
    import duckdb

    from evertrain.serving.traces import live_pass_rates

    try:
        return live_pass_rates(store, campaign).to_dict("records")
    except duckdb.Error:  # a store written before the traces tables existed, opened read-only
        return []


def live_pass_rate_over_time(store: Store, campaign: str, points: int = 24) -> list[dict[str, Any]]:
    """The endpoint's live pass rate per environment, tool and model version over time (about ``points``
    time buckets over the traces' span): the HTML page's live plot."""
    import duckdb

    from evertrain.serving.traces import live_pass_rate_series

    try:
        frame = live_pass_rate_series(store, campaign, points)
    except duckdb.Error:  # a store written before the traces tables existed, opened read-only
        return []
    return [{**r, "bucket": r["bucket"].to_pydatetime() if hasattr(r["bucket"], "to_pydatetime") else r["bucket"]}
            for r in frame.to_dict("records")]


def format_live(rows: list[dict[str, Any]]) -> list[str]:
    """One line per environment, tool and version: traces with an outcome, pass rate and its 95% interval."""
    if not rows:
        return []
    lines = ["live pass rate (endpoint traces with an outcome):"]
    for r in rows:
        tools = r["tools"] or "no tool"
        lines.append(f"  {r['env']} [{tools}] v{r['model_version']}: {r['pass_rate']:.3f} "
                     f"[{r['low']:.3f}, {r['high']:.3f}] over {int(r['requests'])} requests")
    return lines


# --- samples that stay diverse ---------------------------------------------------------------------------


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


def format_diversity(rows: list[dict[str, Any]]) -> list[str]:
    return [f"diversity i={r['iteration']}: {r['distinct_completions']:.2f} distinct completions per group "
            f"({r['distinct_share']:.2f} of its samples), token entropy "
            f"{'-' if r['token_entropy'] is None else format(r['token_entropy'], '.3f')} nats, informative groups "
            f"{r['informative_share']:.2f} of {r['groups']}"
            + ("" if r.get("temperature") is None else f", sampled at temperature {r['temperature']:.2f}")
            for r in rows]


# --- gate power ---------------------------------------------------------------------------------------


def min_detectable_gain(problems: int, alpha: float, power: float, discordant: float) -> float | None:
    """The smallest true gain in pass@1 that a one-sided paired test on ``problems`` problems at level
    ``alpha`` detects with probability ``power``, when a share ``discordant`` of problems is answered right by
    exactly one of the two models (McNemar's normal approximation, Connor 1987):

        n = (z_alpha sqrt(d) + z_power sqrt(d - gain^2))^2 / gain^2

    solved for the gain. None when no gain up to ``discordant`` is detectable."""
    from statistics import NormalDist

    if problems <= 0 or not 0 < discordant <= 1 or not 0 < alpha < 1 or not 0 < power < 1:
        return None
    z_a, z_b = NormalDist().inv_cdf(1 - alpha), NormalDist().inv_cdf(power)

    def needed(gain: float) -> float:
        return (z_a * discordant ** 0.5 + z_b * max(discordant - gain * gain, 0.0) ** 0.5) ** 2 / gain ** 2

    if needed(discordant) > problems:
        return None
    low, high = 1e-6, discordant
    for _ in range(60):  # needed() falls as the gain grows: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if needed(mid) > problems else (low, mid)
    return high


def gate_power(store: Store, campaign: str, power: float = 0.8) -> dict[str, Any] | None:
    """The gate's power: its problems, its one-sided error (1 - promotion.confidence), the discordant share
    measured on its last comparison of two different versions (else assumed 2p(1-p) at the champion's
    pass@1, as if their answers were independent), and the smallest gain it detects, also at 2x and 4x the
    problems. The gate's sequential looks and regression rule are not modelled: a fixed-size approximation."""
    from evertrain.config import CampaignConfig

    raw = store.campaign_config(campaign)
    if raw is None:
        return None
    try:
        config = CampaignConfig.model_validate_json(raw)
    except ValueError:  # a campaign stored by another version of evertrain: its gate cannot be read back
        return None
    problems = sum(config.eval_size(spec.name) for spec in config.environments)
    alpha = 1 - config.promotion.confidence
    pairs = store.compared_gate_verdicts(campaign)
    discordant, source = None, "assumed"
    if not pairs.empty:
        last = pairs[pairs["iteration"] == pairs["iteration"].max()]
        wide = last.pivot_table(index="problem_id", columns="role", values="passed", aggfunc="first")
        if {"challenger", "champion"} <= set(wide.columns):
            wide = wide.dropna()
            if len(wide):
                discordant = float((wide["challenger"].astype(bool) != wide["champion"].astype(bool)).mean())
                source = f"measured at iteration {int(last['iteration'].iloc[0])} on {len(wide)} problems"
    if not discordant:
        champion = store.champion_gate_pass1(campaign)
        p = 0.5 if champion is None else champion
        discordant = max(2 * p * (1 - p), 1.0 / max(problems, 1))
        source = "assumed 2p(1-p)" + ("" if champion is None else f" at champion pass@1 {p:.2f}")
    return {"problems": problems, "alpha": alpha, "power": power, "discordant": discordant, "source": source,
            "levels": config.eval.levels, "rotations": config.eval.rotations,
            "min_gain": min_detectable_gain(problems, alpha, power, discordant),
            "min_gain_2x": min_detectable_gain(2 * problems, alpha, power, discordant),
            "min_gain_4x": min_detectable_gain(4 * problems, alpha, power, discordant)}


def format_gate_power(g: dict[str, Any] | None) -> list[str]:
    if g is None:
        return []

    def gain(value: float | None) -> str:
        return "none up to the discordant share" if value is None else f"+{value:.3f}"

    spread = " across the curriculum levels" if g.get("levels") == "curriculum" else ""
    if g.get("rotations", 1) > 1:
        spread += f" (one of {g['rotations']} sets, rotated at every gate)"
    return [f"gate power: {g['problems']} problems{spread}, one-sided error {g['alpha']:.2f}, power {g['power']:.0%}, "
            f"discordant share {g['discordant']:.2f} ({g['source']}): smallest gain detected {gain(g['min_gain'])} "
            f"(with 2x the problems {gain(g['min_gain_2x'])}, 4x {gain(g['min_gain_4x'])})"]
