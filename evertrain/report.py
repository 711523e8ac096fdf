"""The per-iteration report: what each iteration cost and what it bought."""

from __future__ import annotations

import json
import re
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from evertrain import stats
from evertrain.config import CampaignConfig
from evertrain.data.store import Store
from evertrain.stats import discordant_share, independent_discordance

COLUMNS = [
    ("iteration", "iter"), ("mean_reward", "mean reward"), ("zero_variance_share", "zero-var groups"),
    ("gate_challenger_pass1", "challenger pass@1"), ("gate_champion_pass1", "champion pass@1"),
    ("challenger_eval_share", "share evaluated"), ("predicted_informative", "predicted signal"),
    ("guided_share", "guided"),
    ("challenger_version", "challenger"), ("promoted", "promoted"), ("wall_s", "wall s"),
    ("eval_share", "eval share"), ("cpu_s", "cpu s"), ("tokens", "tokens"), ("dollars", "$"),
]

# the terminal's table: fits 100 columns (the wide one: `evertrain report --wide`, the HTML page, MLflow)
NARROW = ("iteration", "mean_reward", "zero_variance_share", "gate_challenger_pass1", "gate_champion_pass1",
          "promoted", "wall_s", "cpu_s", "dollars")

SPLIT_LABELS = {
    "gate": "gate's held-out set, seen at every promotion",
    "test": "sealed test split, never seen by curation or the gate",
    "transfer": "sealed transfer split: phrasings and operators never trained on, no worked examples",
    "broad": "broad sealed set: every curriculum level and the transfer phrasings, drawn once at the start",
}


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


def render_table(rows: list[dict[str, Any]], title: str, wide: bool = False) -> None:
    """Print the report as a table on the terminal: the columns of :data:`NARROW` (at most 100 characters wide),
    or every column with ``wide``."""
    columns = COLUMNS if wide else [(key, header) for key, header in COLUMNS if key in NARROW]
    table = Table(title=title)
    for _, header in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*[_cell(row.get(key)) for key, _ in columns])
    console = Console()
    if not console.is_terminal:  # piped or logged: never truncate a column to fit 80 characters
        console = Console(width=max(console.width, 160 if wide else 100))
    console.print(table)


def iteration_line(row: dict[str, Any], width: int = 100) -> str:
    """One iteration as it ends, in at most ``width`` characters: mean reward, the share of groups with a learning
    signal (rewards that disagree), the gate's decision with its gain and interval, wall and CPU seconds.
    Only a skipped gate's reason is shortened to fit; the cost always ends the line."""
    parts = [f"iteration {row['iteration']}"]
    if row.get("mean_reward") is not None:
        parts.append(f"reward {row['mean_reward']:.3f}")
    if row.get("zero_variance_share") is not None:
        parts.append(f"signal {1 - row['zero_variance_share']:.0%}")
    challenger, champion = row.get("gate_challenger_pass1"), row.get("gate_champion_pass1")
    cost = f"{row.get('wall_s') or 0:.0f} s, cpu {row.get('cpu_s') or 0:.0f} s"
    if row.get("promoted") is not None and challenger is not None and champion is not None:
        gate = f"gate {challenger - champion:+.3f}"
        if row.get("gain_low") is not None and row.get("gain_high") is not None:
            gate += f" [{row['gain_low']:+.3f}, {row['gain_high']:+.3f}]"
        version = row.get("challenger_version")
        gate += f" promoted v{version}" if row["promoted"] else f" kept v{row.get('champion_version')}"
        parts.append(gate)
    elif row.get("promotion_reason"):
        reason = str(row["promotion_reason"]).removeprefix("skipped: ")
        scheduled = re.search(r"runs every .*\(next at iteration (\d+)\)", reason)
        gate = f"no gate (next at iteration {scheduled.group(1)})" if scheduled else f"gate skipped: {reason}"
        room = width - len(" | ".join([*parts, "", cost]))
        parts.append(gate if len(gate) <= room else gate[:max(room - 3, 0)] + "...")
    parts.append(cost)
    line = " | ".join(parts)
    # long numbers (iteration 10+, thousands of seconds): the interval's and the cost's spaces go first
    for spaced, tight in ((", +", ",+"), (", -", ",-"), (" s, cpu ", " s cpu ")):
        if len(line) > width:
            line = line.replace(spaced, tight)
    return line


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


def render_rollouts(rows: list[dict[str, Any]], title: str, prompt_chars: int = 600) -> None:
    """Print rollouts as panels: the prompt's tail, every turn (tool calls and their output), the verdict."""
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
    champion, _ = store.champion_history(campaign)
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


def format_diversity(rows: list[dict[str, Any]]) -> list[str]:
    return [f"diversity i={r['iteration']}: {r['distinct_completions']:.2f} distinct completions per group "
            f"({r['distinct_share']:.2f} of its samples), token entropy "
            f"{'-' if r['token_entropy'] is None else format(r['token_entropy'], '.3f')} nats, informative groups "
            f"{r['informative_share']:.2f} of {r['groups']}"
            + ("" if r.get("temperature") is None else f", sampled at temperature {r['temperature']:.2f}")
            for r in rows]


def format_frontier(rows: list[dict[str, Any]]) -> list[str]:
    """One line per iteration the frontier chose (evertrain.frontier): the informative share it predicted for the
    curated problems against the one observed, bare and guided apart, the share guided, the candidates skipped, and
    the seconds deciding took (its cost; what it saves shows as the informative share the same rollouts reach)."""
    lines = []
    for r in rows:
        if r.get("predicted_informative") is None:
            continue
        observed = [f"{name} {r[f'informative_{name}']:.2f} of {r[f'groups_{name}']}" for name in ("bare", "guided")
                    if r.get(f"informative_{name}") is not None]
        lines.append(f"frontier i={r['iteration']}: predicted informative {r['predicted_informative']:.2f}, observed "
                     f"{', '.join(observed) or '-'}; guided {r.get('guided_share') or 0:.0%} of problems (mean level "
                     f"{r.get('guidance_level_mean') or 0:.2f}), {r.get('skipped_uninformative') or 0} candidates "
                     f"skipped as uninformative, deciding took {r.get('frontier_s') or 0:.2f} s")
    return lines


# --- gate power ---------------------------------------------------------------------------------------


def gate_power(store: Store, campaign: str, power: float = 0.8) -> dict[str, Any] | None:
    """The gate's power, read from the lineage (the statistics are :func:`evertrain.stats.gate_power`'s): its
    problems, its one-sided error (1 - promotion.confidence), the discordant share measured on its last
    comparison of two different versions (else assumed 2p(1-p) at the champion's pass@1, as if their answers
    were independent), and the smallest gain it detects, also at 2x and 4x the problems. The gate's sequential
    looks and regression rule are not modelled: a fixed-size approximation."""
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
                discordant = discordant_share(wide["challenger"].astype(bool), wide["champion"].astype(bool))
                source = f"measured at iteration {int(last['iteration'].iloc[0])} on {len(wide)} problems"
    if not discordant:
        champion = store.champion_gate_pass1(campaign)
        discordant = independent_discordance(champion, problems)
        source = "assumed 2p(1-p)" + ("" if champion is None else f" at champion pass@1 {champion:.2f}")
    return {"problems": problems, "alpha": alpha, "power": power, "discordant": discordant, "source": source,
            "levels": config.eval.levels, "rotations": config.eval.rotations,
            **stats.gate_power(problems, alpha, power, discordant)}


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
