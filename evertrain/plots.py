"""Figures and the self-contained HTML report: what each iteration bought and what it cost."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from evertrain.stats import wilson


def _gate_interval(rows: list[dict[str, Any]], key: str, share_key: str | None) -> tuple[list[float], list[float]]:
    """The 95% Wilson interval of each row's gate pass@1 as errorbar extents (below, above); 0 where unknown."""
    def extent(r: dict[str, Any]) -> tuple[float, float]:
        value, problems = r.get(key), r.get("gate_problems")
        if value is None or not problems:
            return 0.0, 0.0
        n = max(1, round(problems * (r.get(share_key) or 1.0) if share_key else problems))
        low, high = wilson(round(value * n), n)
        return max(0.0, value - low), max(0.0, high - value)

    below, above = zip(*map(extent, rows), strict=True) if rows else ((), ())
    return list(below), list(above)


def progress_figure(rows: list[dict[str, Any]], title: str = "", sealed: list[dict[str, Any]] | None = None) -> Any:
    """Reward, the gate's pass@1 of challenger and champion (95% intervals) and the sealed test pass@1 of the
    base and each champion (95% intervals) against iteration; dollars spent and points gained per dollar."""
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib

    matplotlib.use("Agg")
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib.pyplot as plt

    its = [r["iteration"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))

    def series(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]

    left.plot(its, series("mean_reward"), "o-", label="rollout mean reward")
    left.errorbar([i - 0.06 for i in its], series("pass1_challenger"),
                  yerr=_gate_interval(rows, "pass1_challenger", "challenger_eval_share"), fmt="s-", capsize=3,
                  label="gate pass@1, challenger (95% CI)")
    left.errorbar([i + 0.06 for i in its], series("pass1_champion"),
                  yerr=_gate_interval(rows, "pass1_champion", None), fmt="^--", capsize=3,
                  label="gate pass@1, champion (95% CI)")
    # the sealed test split: measured for the base and each new champion, never looked at by a gate
    promoted_at = {int(r["challenger_version"]): r["iteration"] for r in rows
                   if r.get("promoted") and r.get("challenger_version") is not None}
    points = sorted(((promoted_at.get(p["version"], -1), p) for p in sealed or [] if p["split"] == "test"
                     and p["pass1"] is not None), key=lambda xp: xp[0])
    if points:
        left.errorbar([x for x, _ in points], [p["pass1"] for _, p in points],
                      yerr=([p["pass1"] - p["low"] for _, p in points], [p["high"] - p["pass1"] for _, p in points]),
                      fmt="D:", color="black", capsize=3,
                      label=f"sealed test pass@1, base (at -1), champions ({points[0][1]['problems']} problems)")
    for r in rows:
        if r.get("promoted"):
            left.axvline(r["iteration"], color="green", alpha=0.2)
    left.set_xlabel("iteration")
    left.set_ylim(0, 1)
    left.legend(fontsize=7)
    left.set_title("learning (green: promoted)")
    right.plot(its, series("cumulative_dollars"), "o-", color="tab:red", label="cumulative $")
    right.set_xlabel("iteration")
    right.set_ylabel("$")
    twin = right.twinx()
    twin.plot(its, series("points_per_dollar_total"), "s-", color="tab:purple", label="held-out points per $")
    twin.set_ylabel("points per $")
    right.set_title("cost and capability per dollar")
    lines = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = right.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    right.legend(lines, labels, fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def live_pass_rate_figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The endpoint's live pass rate over time: one panel per environment and tool, one line per model version
    (its 95% interval shaded), from :func:`evertrain.report.live_pass_rate_over_time`'s rows."""
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib

    matplotlib.use("Agg")
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panels = sorted({(r["env"], r.get("tools") or "no tool") for r in rows})
    columns = min(3, max(len(panels), 1))
    lines = -(-max(len(panels), 1) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5.5 * columns, 3.6 * lines), squeeze=False)
    for axis, (env, tools) in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if (r["env"], r.get("tools") or "no tool") == (env, tools)]
        for version in sorted({int(r["model_version"]) for r in mine if r["model_version"] is not None}):
            points = sorted((r for r in mine if r["model_version"] == version), key=lambda r: r["bucket"])
            at = [r["bucket"] for r in points]
            axis.plot(at, [r["pass_rate"] for r in points], "o-", label=f"v{version}")
            axis.fill_between(at, [r["low"] for r in points], [r["high"] for r in points], alpha=0.15)
        axis.set_ylim(0, 1)
        axis.set_title(f"{env} [{tools}]", fontsize=10)
        axis.set_ylabel("pass rate")
        axis.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
        axis.tick_params(axis="x", labelrotation=30, labelsize=8)
        axis.legend(fontsize=8, title="version", title_fontsize=8)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    fig.suptitle(title or "live pass rate (endpoint traces with an outcome; shaded: 95% interval)")
    fig.tight_layout()
    return fig


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return base64.b64encode(buffer.getvalue()).decode()


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(str(value))

    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(key))}</td>" for key, _ in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


Section = tuple[str, list[dict[str, Any]], list[tuple[str, str]], list[str]]  # title, rows, columns, text lines


def live_html(live: list[dict[str, Any]] | None) -> str:
    """The page's live-pass-rate part: the plot over time and its table ('' when no trace has an outcome)."""
    if not live:
        return ""
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib.pyplot as plt

    fig = live_pass_rate_figure(live)
    image = _png(fig)
    plt.close(fig)
    table = _table(sorted(live, key=lambda r: (r["env"], r.get("tools") or "", r["model_version"] or 0,
                                               r["bucket"])),
                   [("env", "environment"), ("tools", "tools"), ("model_version", "version"), ("bucket", "from"),
                    ("requests", "requests"), ("passed", "passed"), ("pass_rate", "pass rate"),
                    ("low", "95% CI low"), ("high", "95% CI high")])
    return (f"<h2>Live pass rate (served model)</h2><img alt='live pass rate' "
            f"src='data:image/png;base64,{image}'>{table}")


def html_report(campaign: str, rows: list[dict[str, Any]], versus_base: list[dict[str, Any]] | None = None,
                sections: list[Section] | None = None, live: list[dict[str, Any]] | None = None,
                sealed: list[dict[str, Any]] | None = None) -> str:
    """One self-contained page (figures inlined as PNG) with the campaign's plots and tables; ``sections``
    are more tables (curriculum levels, sample diversity, gate power), each with lines of text under it;
    ``live`` the endpoint's pass rate over time (:func:`evertrain.report.live_pass_rate_over_time`); ``sealed``
    the sealed splits' pass@1 of the base and each champion (:func:`evertrain.data.lineage.sealed_curve`).
    A section with nothing to show is left out, heading and all."""
    # late: matplotlib (~0.5 s), imported after matplotlib.use("Agg") chose its backend
    import matplotlib.pyplot as plt

    fig = progress_figure(rows, f"campaign {campaign}", sealed)
    image = _png(fig)
    plt.close(fig)
    summary = _table(rows, [
        ("iteration", "iteration"), ("status", "status"), ("mean_reward", "mean reward"),
        ("zero_variance_share", "zero-variance groups"), ("pass1_challenger", "challenger pass@1"),
        ("pass1_champion", "champion pass@1"), ("challenger_version", "challenger"), ("promoted", "promoted"),
        ("wall_s", "wall s"), ("eval_share", "evaluation share"), ("cpu_s", "CPU s"), ("gpu_s", "GPU s"),
        ("tokens", "tokens"),
        ("cached_prompt_tokens", "prompt tokens from cache"), ("dollars", "$"),
        ("points_gained_total", "points gained (total)"), ("points_per_dollar_total", "points per $ (total)")])
    envs = sorted({env for r in rows for env in (r.get("pass1_by_env") or {})})
    per_env = _table([{"iteration": r["iteration"], **(r.get("pass1_by_env") or {})} for r in rows],
                     [("iteration", "iteration")] + [(env, f"{env} pass@1") for env in envs])
    dropped = sorted({rule for r in rows for rule in (r.get("dropped") or {})})
    curation = _table([{"iteration": r["iteration"], **(r.get("dropped") or {}),
                        "zv": r.get("zero_variance_share"), "zv_est": r.get("zero_variance_share_unfiltered_est")}
                       for r in rows],
                      [("iteration", "iteration")] + [(rule, f"dropped: {rule}") for rule in dropped]
                      + [("zv", "zero-variance share"), ("zv_est", "zero-variance share without difficulty filter")])
    versus = _table(versus_base or [], [
        ("env", "environment"), ("split", "split"), ("problems", "problems"), ("base_version", "base"),
        ("base_pass1", "base pass@1"), ("champion_version", "champion"), ("champion_pass1", "champion pass@1"),
        ("gain", "gain"), ("gain_low", "95% CI low"), ("gain_high", "95% CI high"),
        ("gate_optimism", "gate gain minus sealed gain")])
    decisions = "".join(f"<li><b>iteration {r['iteration']}</b>: {html.escape(r.get('promotion_reason') or '-')}</li>"
                        for r in rows)
    style = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
             "margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
             "th{background:#f3f3f3}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>evertrain: {html.escape(campaign)}</title>"
            f"<style>{style}</style></head><body><h1>evertrain campaign <code>{html.escape(campaign)}</code></h1>"
            f"<img alt='progress' src='data:image/png;base64,{image}'>"
            + (f"<h2>Champion against the base model</h2>{versus}" if versus_base else "")
            + f"<h2>Iterations</h2>{summary}"
            + (f"<h2>Held-out pass@1 per environment (challenger)</h2>{per_env}" if envs else "")
            + f"<h2>Curation</h2>{curation}<h2>Promotion decisions</h2><ul>{decisions}</ul>"
            + "".join(f"<h2>{html.escape(title)}</h2>" + (_table(part, columns) if part else "")
                      + "".join(f"<p>{html.escape(line)}</p>" for line in lines)
                      for title, part, columns, lines in sections or [] if part or lines)
            + live_html(live) + "</body></html>")
