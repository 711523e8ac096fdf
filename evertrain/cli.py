"""The ``evertrain`` command. Heavy libraries are imported late, so ``--help`` answers at once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _environment() -> None:
    os.environ.setdefault("PREFECT_HOME", str(PROJECT_ROOT / ".prefect"))
    from evertrain.runtime import quiet_libraries

    quiet_libraries()


def _config(args: argparse.Namespace) -> Any:
    """The campaign config: --config if given, else the one stored for --campaign, else the defaults."""
    from evertrain.config import load_config, parse_config

    overrides = {"name": getattr(args, "campaign", None)}
    if getattr(args, "config", None):
        return load_config(args.config, **overrides)
    if overrides["name"]:
        stored = _stored_config(overrides["name"], getattr(args, "store", None))
        if stored is not None:
            return parse_config(stored, f"(stored for campaign {overrides['name']!r})")
    return load_config(None, **overrides)


def _stored_config(campaign: str, store_path: str | None) -> dict[str, Any] | None:
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store

    path = Path(store_path or PathsConfig().store)
    if not path.exists():
        return None
    store = Store(path, read_only=True)
    try:
        frame = store.query("SELECT config FROM campaigns WHERE campaign = ?", [campaign])
    except Exception:
        return None
    finally:
        store.close()
    return None if frame.empty else json.loads(frame["config"].iloc[0])


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args)
    from evertrain.flows.campaign import campaign_flow
    from evertrain.report import iteration_report, render_table
    from evertrain.runtime import get_runtime

    rt = get_runtime(config)
    mix = [f"{s.name}×{s.weight:g}" if s.weight else f"{s.name} (eval only)" for s in config.environments]
    print(f"campaign {config.name!r}: model {config.model.path}, environments {', '.join(mix)}; "
          f"{config.problems_per_iteration} problems × G={config.group_size} per iteration; "
          f"{'forever' if args.iterations is None else f'{args.iterations} iteration(s)'}", file=sys.stderr)
    done = campaign_flow(config, args.iterations)
    from evertrain.report import champion_vs_base

    rows = [r for r in iteration_report(rt.store, config.name) if r["iteration"] in set(done)]
    render_table(rows, f"campaign {config.name}")
    for s in champion_vs_base(rt.store, config.name):
        print(f"{s['env']}: champion v{s['champion_version']} pass@1 {s['champion_pass1']:.3f} vs base "
              f"v{s['base_version']} {s['base_pass1']:.3f} on {s['problems']} held-out problems: gain "
              f"{s['gain']:+.3f} (95% CI [{s['gain_low']:+.3f}, {s['gain_high']:+.3f}])")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    config = _config(args)
    from evertrain.runtime import get_runtime
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    rt = get_runtime(config)
    before = rt.store.counts()
    metrics = run_stage(rt, args.stage, args.iteration, STAGE_FUNCTIONS[args.stage])
    after = rt.store.counts()
    print(json.dumps({"stage": args.stage, "iteration": args.iteration, "metrics": metrics,
                      "rows_changed": {t: after[t] - before[t] for t in after if after[t] != before[t]}},
                     indent=2, default=str))
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from evertrain.scoring import score_lines
    from evertrain.tasks.base import progress

    source = Path(args.input)
    if not source.is_file():
        print(f"evertrain: error: input file {source} does not exist", file=sys.stderr)
        return 2
    lines = [line for line in source.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    with progress(len(lines), "score", "item") as bar:
        results, audit = score_lines(lines, workers=args.workers, progress=bar)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(r, default=str) + "\n" for r in results), encoding="utf-8")
    where = _write_audit(audit, args.store, output)
    passed = sum(r["passed"] for r in results)
    malformed = sum(r["reason"] == "malformed_input" for r in results)
    print(f"scored {len(results)} item(s): {passed} passed, {malformed} malformed; results in {output}"
          + (f"; {len(audit)} sandbox run(s) audited in {where}" if audit else ""), file=sys.stderr)
    return 0


def _write_audit(audit: list[dict[str, Any]], store_path: str | None, output: Path) -> str:
    """Sandbox audit rows go to the store's sandbox_runs table, or next to the output if it is busy."""
    if not audit:
        return ""
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store, StoreError

    rows = [{**row, "campaign": None, "iteration": None} for row in audit]
    try:
        store = Store(store_path or PathsConfig().store)
    except StoreError as error:
        fallback = output.with_name(output.name + ".sandbox_runs.jsonl")
        fallback.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows), encoding="utf-8")
        print(f"evertrain: warning: {error}\n  the sandbox audit rows went to {fallback}", file=sys.stderr)
        return str(fallback)
    try:
        store.append("sandbox_runs", rows)
    finally:
        store.close()
    return f"{store.path} (sandbox_runs)"


def cmd_envs(args: argparse.Namespace) -> int:
    from evertrain.envs import registry
    from evertrain.envs.quality import validate

    rows = []
    for name in registry.names(include_rg=True):
        env = registry.get(name)
        try:
            count = env.count("train")
            held = env.count("eval")
        except Exception as error:
            count, held = None, None
            problems = f"needs options ({error})"
        else:
            problems = "generated" if count is None else f"{count} train / {held} eval"
        row = {"name": name, "kind": env.kind, "source": env.source, "problems": problems,
               "tools": sorted(env.tools), "max_turns": env.max_turns}
        if args.validate:
            report = validate(env, problems=args.validate)
            row["validation"] = "ok" if report.ok else "; ".join(report.failures[:3]) or "no problems to check"
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(rows)} environments")
    columns = ["name", "kind", "source", "problems", "tools"] + (["validation"] if args.validate else [])
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[", ".join(row[c]) if isinstance(row[c], list) else str(row[c]) for c in columns])
    Console().print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store
    from evertrain.report import champion_vs_base, iteration_report, render_table

    store = Store(args.store or (_config(args).paths.store if args.config else PathsConfig().store), read_only=True)
    rows = iteration_report(store, args.campaign)
    summary = champion_vs_base(store, args.campaign)
    store.close()
    if not rows:
        print(f"campaign {args.campaign!r} has no iterations in {store.path}", file=sys.stderr)
        return 1
    if args.html:
        from evertrain.plots import html_report

        Path(args.html).write_text(html_report(args.campaign, rows, summary), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    elif not args.html:
        render_table(rows, f"campaign {args.campaign}")
        for s in summary:
            print(f"{s['env']}: champion v{s['champion_version']} pass@1 {s['champion_pass1']:.3f} vs base "
                  f"v{s['base_version']} {s['base_pass1']:.3f} on {s['problems']} held-out problems: gain "
                  f"{s['gain']:+.3f} (95% CI [{s['gain_low']:+.3f}, {s['gain_high']:+.3f}])")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from evertrain.config import load_config

    configs = [load_config(path).resolved() for path in args.config]
    if args.interval is None and args.cron is None:
        args.interval = 3600.0
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        # scheduled runs need a real server (Prefect's temporary one runs no scheduler)
        from evertrain.flows.deploy import start_server

        url, server = start_server(args.port, scheduler_seconds=min(10.0, args.interval or 10.0))
        os.environ["PREFECT_API_URL"] = url
        print(f"started a Prefect server: UI at {url.removesuffix('/api')}", file=sys.stderr)
    from evertrain.flows.deploy import serve

    names = ", ".join(c.name for c in configs)
    schedule = f"every {args.interval:g} s" if args.interval is not None else f"cron {args.cron!r}"
    print(f"serving campaign(s) {names}: {args.iterations_per_run} iteration(s) per run, {schedule}, "
          "one run at a time; trigger runs from the Prefect UI; Ctrl-C stops", file=sys.stderr)
    try:
        serve(configs, interval=args.interval, cron=args.cron, iterations_per_run=args.iterations_per_run)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    config = _config(args)
    from evertrain.runtime import get_runtime
    from evertrain.tasks.promote import rollback

    result = rollback(get_runtime(config), args.to, reason=args.reason)
    print(f"campaign {result['campaign']!r}: champion is now v{result['champion']} (previous_champion "
          f"v{result['previous_champion']}); the next iteration samples from v{result['trainee']}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    import signal
    import subprocess
    import time

    from evertrain.config import PathsConfig

    paths = PathsConfig()
    Path(paths.mlflow_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    procs = [
        subprocess.Popen([str(bin_dir / "prefect"), "server", "start", "--host", args.host,
                          "--port", str(args.prefect_port)]),
        subprocess.Popen([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", paths.mlflow_uri,
                          "--default-artifact-root", Path(paths.artifacts).resolve().as_uri(),
                          "--host", args.host, "--port", str(args.mlflow_port)]),
    ]
    time.sleep(2)
    print(f"\nPrefect UI: http://{args.host}:{args.prefect_port}\nMLflow UI:  http://{args.host}:{args.mlflow_port}\n"
          "Ctrl-C stops both.", flush=True)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        p.wait(timeout=20)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evertrain", description=__doc__ and
                                     "Continuous RL post-training of language-model agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a campaign: N iterations, or forever")
    run.add_argument("--config", help="campaign TOML file (default: the built-in defaults)")
    run.add_argument("--campaign", help="campaign name (overrides the config's)")
    run.add_argument("--iterations", type=int, help="how many iterations (omitted: run forever)")
    run.set_defaults(func=cmd_run)

    stage = sub.add_parser("stage", help="rerun one stage of one iteration (replaces that stage's rows)")
    stage.add_argument("stage", choices=["curate", "rollout", "score", "update", "evaluate", "promote"])
    stage.add_argument("--campaign", required=True)
    stage.add_argument("--iteration", type=int, required=True)
    stage.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    stage.add_argument("--store", help="DuckDB store to find the campaign's config in")
    stage.set_defaults(func=cmd_stage)

    score = sub.add_parser("score", help="grade completions from a JSONL file, in parallel, in input order")
    score.add_argument("--input", required=True, help='JSONL: {"id", "env", "problem": {...}, "completion"}')
    score.add_argument("--output", required=True, help='JSONL: {"id", "reward", "passed", "reason", "detail"}')
    score.add_argument("--workers", type=int, help="parallel graders (default: one per core)")
    score.add_argument("--store", help="DuckDB store for the sandbox audit rows (default data/evertrain.duckdb)")
    score.set_defaults(func=cmd_score)

    envs = sub.add_parser("envs", help="list every registered environment")
    envs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    envs.add_argument("--validate", type=int, nargs="?", const=2, default=0, metavar="N",
                      help="also validate each on N train and N eval problems (references earn 1, hacks 0)")
    envs.set_defaults(func=cmd_envs)

    report = sub.add_parser("report", help="the per-iteration table of a campaign")
    report.add_argument("--campaign", required=True)
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.add_argument("--html", metavar="FILE", help="write a self-contained HTML page with plots and tables")
    report.add_argument("--config", help="campaign TOML file whose paths.store to read")
    report.add_argument("--store", help="DuckDB store (default data/evertrain.duckdb)")
    report.set_defaults(func=cmd_report)

    srv = sub.add_parser("serve", help="run campaigns on a schedule as Prefect deployments (one run at a time)")
    srv.add_argument("--config", action="append", required=True, help="campaign TOML file (repeatable)")
    when = srv.add_mutually_exclusive_group()
    when.add_argument("--interval", type=float, help="seconds between scheduled runs (default 3600)")
    when.add_argument("--cron", help="cron schedule, e.g. '0 */6 * * *'")
    srv.add_argument("--iterations-per-run", type=int, default=1, help="iterations per scheduled run (default 1)")
    srv.add_argument("--port", type=int, default=4200, help="port of the Prefect server started when "
                     "PREFECT_API_URL is not set (default 4200, or a free one)")
    srv.set_defaults(func=cmd_serve)

    back = sub.add_parser("rollback", help="move champion back to previous_champion (or --to VERSION)")
    back.add_argument("--campaign", required=True)
    back.add_argument("--to", type=int, help="the model version to restore (default: previous_champion)")
    back.add_argument("--reason", default="manual rollback", help="recorded in the rollbacks table")
    back.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    back.add_argument("--store", help="DuckDB store to find the campaign's config in")
    back.set_defaults(func=cmd_rollback)

    ui = sub.add_parser("ui", help="start the Prefect server and the MLflow UI on localhost")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _environment()
    from evertrain.config import ConfigError
    from evertrain.data.store import StoreError
    from evertrain.envs.registry import UnknownEnvironment
    from evertrain.models.policy import ModelError
    from evertrain.runtime import EnvironmentInvalid

    try:
        return int(args.func(args) or 0)
    except (ConfigError, StoreError, ModelError, UnknownEnvironment, EnvironmentInvalid) as error:
        print(f"evertrain: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("evertrain: interrupted; `evertrain run` resumes at the interrupted stage", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
