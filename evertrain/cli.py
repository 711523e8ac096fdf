"""The ``evertrain`` command. Heavy libraries are imported late, so ``--help`` answers at once."""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from evertrain import interrupts, processes
from evertrain.envs import registry
from evertrain.progress import progress
from evertrain.quiet import quiet_libraries, quiet_prefect_console
from evertrain.scoring import score_lines

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _environment() -> None:
    os.environ.setdefault("PREFECT_HOME", str(PROJECT_ROOT / ".prefect"))
    quiet_libraries()


def _config(args: argparse.Namespace, stored: bool = False) -> Any:
    """The campaign config: --config if given, else the one stored for --campaign, else the defaults (with
    ``stored``, a campaign without a stored config is refused instead: the command needs a campaign that ran)."""
    # late: pydantic; `evertrain --help` loads no third-party library
    from evertrain.config import PathsConfig, apply_setting, load_config, parse_config

    overrides = {"name": getattr(args, "campaign", None)}
    settings = getattr(args, "set", None) or []
    if getattr(args, "config", None):
        return load_config(args.config, settings, **overrides)
    if overrides["name"]:
        found = _stored_config(overrides["name"], getattr(args, "store", None))
        if found is not None:
            for setting in settings:
                apply_setting(found, setting)
            return parse_config(found, f"(stored for campaign {overrides['name']!r})")
        if stored:
            require_campaign(getattr(args, "store", None) or PathsConfig().store, overrides["name"])
            raise UsageError(f"campaign {overrides['name']!r} has no stored config: pass its --config")
    return load_config(None, settings, **overrides)


def _stored_config(campaign: str, store_path: str | None) -> dict[str, Any] | None:
    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store, StoreLocation

    uri = store_path or PathsConfig().store
    if not StoreLocation.parse(uri).exists():
        return None
    store = Store(uri, read_only=True)
    try:
        raw = store.campaign_config(campaign)
    except Exception:
        return None
    finally:
        store.close()
    return None if raw is None else json.loads(raw)


class UsageError(Exception):
    """Bad input found before anything ran or was written: ``evertrain: error: ...`` and exit status 2."""


# the stages whose rows a stage reads: an iteration's stage is rerun only after these completed (sft is optional)
STAGE_ORDER = ("curate", "rollout", "score", "sft", "update", "evaluate", "promote")
STAGE_NEEDS = {stage: tuple(s for s in STAGE_ORDER[:i] if s != "sft") for i, stage in enumerate(STAGE_ORDER)}


def _open_for_reading(uri: str, campaign: str) -> Any:
    """The store at ``uri``, read-only; a store that does not exist yet is bad input (nothing is created)."""
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.store import Store, StoreLocation

    if not StoreLocation.parse(uri).exists():
        raise UsageError(f"campaign {campaign!r} not found: store {uri} does not exist yet (run a campaign first)")
    return Store(uri, read_only=True)


def _campaign_iterations(store: Any, campaign: str) -> dict[int, dict[str, str]]:
    """Every iteration of ``campaign`` in ``store`` with its stages' status; UsageError for an unknown campaign."""
    frame = store.stage_statuses(campaign)
    known = {int(row.iteration): {} for row in frame.itertuples(index=False)}
    for row in frame.itertuples(index=False):
        known[int(row.iteration)][row.stage] = row.status
    if not known and not store.campaign_known(campaign):
        names = store.campaign_names()
        raise UsageError(f"campaign {campaign!r} not found in store {store.location.describe()} (campaigns there: "
                         f"{', '.join(map(repr, names)) or 'none'})")
    return known


def _iteration_stages(store: Any, campaign: str, iteration: int) -> dict[str, str]:
    """The stages of ``iteration`` of ``campaign`` with their status; UsageError when it has none."""
    known = _campaign_iterations(store, campaign)
    if iteration not in known:
        have = f"iterations {min(known)}-{max(known)}" if known else "no iterations yet"
        raise UsageError(f"campaign {campaign!r} has no iteration {iteration} ({have})")
    return known[iteration]


def require_campaign(uri: str, campaign: str) -> None:
    """Refuse (UsageError) a campaign the store at ``uri`` has never seen, before anything opens it for writing."""
    store = _open_for_reading(uri, campaign)
    try:
        _campaign_iterations(store, campaign)
    finally:
        store.close()


def require_stage_inputs(uri: str, campaign: str, iteration: int, stage: str) -> None:
    """Refuse (UsageError) rerunning ``stage`` of an iteration that does not exist or lacks the stages it reads."""
    if stage not in STAGE_NEEDS:
        raise UsageError(f"unknown stage {stage!r}; stages: {', '.join(STAGE_ORDER)}")
    store = _open_for_reading(uri, campaign)
    try:
        status = _iteration_stages(store, campaign, iteration)
    finally:
        store.close()
    missing = [s for s in STAGE_NEEDS[stage] if status.get(s) != "completed"]
    if missing:
        raise UsageError(f"{stage} of iteration {iteration} of campaign {campaign!r} needs {', '.join(missing)} "
                         f"completed first (stages there: "
                         f"{', '.join(f'{k} {v}' for k, v in status.items())}); rerun those first")


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.verbose:
        os.environ["EVERTRAIN_VERBOSE"] = "1"
    else:  # the per-iteration lines and progress bars, not Prefect's INFO lines between them
        quiet_prefect_console()
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    # late: torch, Prefect (the training stack); --help and a bad config must not import them
    from evertrain.data.lineage import iteration_report
    from evertrain.flows.campaign import run_campaign_flow
    from evertrain.report import render_table
    from evertrain.runtime import Runtime

    mix = [f"{s.name}×{s.weight:g}" if s.weight else f"{s.name} (eval only)" for s in config.environments]
    print(f"campaign {config.name!r}: model {config.model.path}, environments {', '.join(mix)}; "
          f"{config.problems_per_iteration} problems × G={config.group_size} per iteration; "
          f"{'forever' if args.iterations is None else f'{args.iterations} iteration(s)'}", file=sys.stderr)
    # opened before the flow run, so a campaign another process runs is refused without a failed flow run; held
    # by the flow (the same flow, name and parameters as a deployment's) and closed when it ends, however it ends;
    # the report is read through the same connection before it closes
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.lineage import champion_vs_base, last_refusal
    from evertrain.report import format_refusal, format_versus, share_line

    # SIGTERM (`kill`, a service manager's stop) stops like Ctrl-C: the flow run is marked, the store closed and
    # the temporary Prefect server Prefect started for this run stopped (by default SIGTERM ended the process
    # at once and left that server running without its parent)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # a second Ctrl-C stops at once, as a second SIGTERM does
    # and recorded below Python's handlers too: a KeyboardInterrupt raised inside a finalizer is dropped by Python,
    # so the stages also stop at their next boundary or progress step once a stop signal has come
    interrupts.watch()
    # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
    from evertrain.flows.deploy import start_temporary_server

    # without PREFECT_API_URL: Prefect's temporary server, started here and tied to this process (it dies with
    # it, SIGKILL included, and a terminal's Ctrl-C reaches this process alone)
    start_temporary_server()
    with Runtime.open(config) as rt:
        done = run_campaign_flow(rt, args.iterations)
        rows = [r for r in iteration_report(rt.store, config.name) if r["iteration"] in set(done)]
        render_table(rows, f"campaign {config.name}")
        if share_line(rows):
            print(share_line(rows))
        for s in champion_vs_base(rt.store, config.name):
            print(format_versus(s))
        for line in format_refusal(last_refusal(rt.store, config.name)):
            print(line)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    config = _config(args, stored=True)
    require_stage_inputs(config.paths.store, config.name, args.iteration, args.stage)
    # late: torch, Prefect (the training stack); --help and a bad config must not import them
    from evertrain.runtime import Runtime
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    with Runtime.open(config) as rt:
        before = rt.store.counts()
        if args.stage == "sft":  # the optional stage (sft.enabled) is not one of the six
            # late: torch, Prefect (the training stack); --help and a bad config must not import them
            from evertrain.tasks.sft import sft as function
        else:
            function = STAGE_FUNCTIONS[args.stage]
        metrics = run_stage(rt, args.stage, args.iteration, function)
        after = rt.store.counts()
    print(json.dumps({"stage": args.stage, "iteration": args.iteration, "metrics": metrics,
                      "rows_changed": {t: after[t] - before[t] for t in after if after[t] != before[t]}},
                     indent=2, default=str))
    return 0


# A longer input line is refused unread (its own error result): parsing it could take the process's
# memory. Far above any graded item (completions are cut at scoring.MAX_COMPLETION_CHARS characters).
MAX_SCORE_LINE_BYTES = 32 * 1024 * 1024


def read_score_input(path: Path, max_line_bytes: int = MAX_SCORE_LINE_BYTES) -> list[tuple[str, str | None]]:
    """The lines of an ``evertrain score`` input: (text, None) or ("", why the line cannot be read).

    Lines end at ``\n`` only (a JSON string may hold U+2028, U+0085 ... which ``str.splitlines`` would
    split on); a trailing ``\r`` is dropped. Each line is decoded as strict UTF-8 on its own, so one
    undecodable line is an error of its own; a line past ``max_line_bytes`` is skipped without being
    held in memory. A blank line is an error too: every line of the file gets a result.
    """
    entries: list[tuple[str, str | None]] = []
    with open(path, "rb") as file:
        while True:
            raw = file.readline(max_line_bytes + 1)
            if not raw:
                break
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line, a chunk at a time
                    raw = file.readline(1024 * 1024)
                    size += len(raw)
                entries.append(("", f"line longer than {max_line_bytes} bytes ({size} bytes)"))
                continue
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            if not entries:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                entries.append(("", f"not valid UTF-8 (byte {error.start}: {raw[error.start:error.start + 4]!r})"))
                continue
            entries.append((text, None) if text.strip() else ("", "blank line"))
    return entries


def score_entries(entries: list[tuple[str, str | None]], workers: int | None = None, progress: Any = None,
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One result per entry of :func:`read_score_input`, in order, and the sandbox audit rows."""
    texts = [text for text, error in entries if error is None]
    scored, audit = score_lines(texts, workers=workers, progress=progress)
    if len(scored) != len(texts):
        raise RuntimeError(f"score_lines returned {len(scored)} results for {len(texts)} lines")
    graded = iter(scored)
    results: list[dict[str, Any]] = []
    for number, (_, error) in enumerate(entries, 1):
        if error is not None:
            results.append({"id": None, "reward": 0.0, "passed": False, "reason": "malformed_input",
                            "detail": {"line": number, "error": error}})
            continue
        result = next(graded)
        if result.get("reason") == "malformed_input" and isinstance(result.get("detail"), dict):
            result["detail"]["line"] = number  # score_lines numbered the readable lines only
        results.append(result)
    return results, audit


def _result_line(result: dict[str, Any]) -> str:
    """A result as one JSON line; a verdict whose detail cannot be written keeps its reward, not its detail."""
    try:
        return json.dumps(result, default=str) + "\n"
    except (TypeError, ValueError, RecursionError) as error:
        kept = {key: result.get(key) for key in ("id", "reward", "passed", "reason")}
        return json.dumps({**kept, "detail": {"unwritable_detail": f"{type(error).__name__}: {error}"[:300]}},
                          default=str) + "\n"


def cmd_score(args: argparse.Namespace) -> int:
    source = Path(args.input)
    if not source.is_file():
        print(f"evertrain: error: input file {source} does not exist", file=sys.stderr)
        return 2
    if args.store:
        # late: duckdb, pandas (the store); --help and a bad config do not load them
        from evertrain.data.store import StoreError, StoreLocation

        try:
            StoreLocation.parse(args.store)
        except StoreError as error:
            print(f"evertrain: error: --store: {error}", file=sys.stderr)
            return 2
    entries = read_score_input(source)
    with progress(sum(error is None for _, error in entries), "score", "item") as bar:
        results, audit = score_entries(entries, workers=args.workers, progress=bar)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(_result_line(r) for r in results), encoding="utf-8")
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
    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
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
    if not args.json:
        return _cmd_envs(args)
    # With --json, stdout carries the JSON document alone: whatever else writes to it meanwhile (progress,
    # third-party generators that print while they build problems, even C code writing to fd 1) goes to
    # stderr, and the real stdout is restored only for the document.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        status = _cmd_envs(args)
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(args.rows, indent=2))
    return status


def _env_row(name: str, validate_problems: int, cases: bool, options: dict[str, Any] | None = None,
             ) -> dict[str, Any]:
    """One row of `evertrain envs`: what ``name`` is (built with ``options``) and, with ``validate_problems``, its
    self-test. Top-level (and importing what it needs) so that a process of a pool can run it."""
    try:
        env = registry.get(name, **(options or {}))
    except (TypeError, ValueError) as error:
        if options is not None:  # a campaign's own options that do not build the environment: its failure
            return {"name": name, "kind": "?", "source": "?", "problems": f"bad options ({error})", "tools": [],
                    "max_turns": None, "validation": f"FAILED: bad options ({error})",
                    "selftest": {"env": name, "ok": False, "status": "failed", "failures": [str(error)]},
                    "flagged": ""}
        # an adapter that needs options (a listing without a campaign): say which, list the rest
        return {"name": name, "kind": "?", "source": "?", "problems": f"needs options ({error})", "tools": [],
                "max_turns": None, "validation": f"skipped: needs options ({error})",
                "selftest": {"env": name, "ok": None, "status": "skipped", "reason": str(error)}, "flagged": ""}
    try:
        return _described(env, name, validate_problems, cases)
    finally:
        env.close()


def _described(env: Any, name: str, validate_problems: int, cases: bool) -> dict[str, Any]:
    # late: psutil and the sandbox; --help does not load them
    from evertrain.envs.quality import probe, validate

    try:
        count = env.count("train")
        held = env.count("eval")
    except Exception as error:
        count, held = None, None
        problems = f"needs options ({error})"
    else:
        problems = "generated" if count is None else f"{count} train / {held} eval"
    row: dict[str, Any] = {"name": name, "kind": env.kind, "source": env.source, "problems": problems,
                           "tools": sorted(env.tools), "max_turns": env.max_turns}
    if validate_problems:
        if problems.startswith("needs options"):
            row["validation"] = "skipped: " + problems
            row["selftest"] = {"env": name, "ok": None, "status": "skipped", "reason": problems}
        else:
            report = validate(env, problems=validate_problems)
            row["validation"] = "ok" if report.ok else "FAILED: " + (
                "; ".join(report.failures[:3]) or "no problems to check")
            row["selftest"] = report.as_dict(cases=cases)
            # the quality check's probes on the same problems, reusing the self-test's grades of equal completions
            graded = {(case.problem_id, case.completion): case.reward for case in report.cases}
            quality = probe(env, report.sample, graded=graded)
            row["quality"] = quality.as_dict()
            row["flagged"] = ", ".join(quality.flagged_probes) or f"{len(quality.flagged_items())} items"
    return row


def _env_rows(names: list[str], args: argparse.Namespace,
              options: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every environment's row, in ``names``' order; self-tests on ``args.jobs`` processes (most verifiers are
    pure Python, so threads would share one core). Progress goes to stderr, always."""
    options = options or {}
    if not args.validate:
        return [_env_row(name, 0, False, options.get(name)) for name in names]
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(names)))
    rows: dict[str, dict[str, Any]] = {}

    def said(row: dict[str, Any]) -> None:
        rows[row["name"]] = row
        print(f"self-test {row['name']} ... {row['selftest']['status']} ({len(rows)}/{len(names)})",
              file=sys.stderr, flush=True)

    if jobs == 1:
        for name in names:
            said(_env_row(name, args.validate, args.cases, options.get(name)))
    else:
        # late: multiprocessing and its pool (~20 ms), only a validation on several processes uses them
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn, not fork: the parent may hold threads and open sandboxes' state
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_env_row, name, args.validate, args.cases, options.get(name)) for name in names]
            for future in as_completed(futures):
                said(future.result())
    return [rows[name] for name in names]


def _cmd_envs(args: argparse.Namespace) -> int:
    names = registry.names(include_rg=True)
    options: dict[str, dict[str, Any]] = {}
    if args.config:  # the campaign's environments, with the options it builds them with
        # late: pydantic; `evertrain --help` loads no third-party library
        from evertrain.config import load_config

        specs = load_config(Path(args.config)).environments
        options = {spec.name: dict(spec.options) for spec in specs}
        names = [spec.name for spec in specs]
        unknown = [wanted for wanted in args.env or [] if wanted not in options]
        if unknown:
            raise UsageError(f"{', '.join(unknown)}: not an environment of {args.config} "
                             f"(its environments: {', '.join(names)})")
    for wanted in args.env or []:
        registry.check_name(wanted)
    rows = _env_rows(list(args.env or names), args, options)
    failed = sum(1 for row in rows if row.get("selftest", {}).get("ok") is False)
    if args.json:
        args.rows = rows  # printed by cmd_envs, once stdout is stdout again
        return 1 if failed else 0
    # late: third-party; `evertrain --help` loads no third-party library
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(rows)} environments")
    columns = ["name", "kind", "source", "problems", "tools"] + (["validation", "flagged"] if args.validate else [])
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[", ".join(row[c]) if isinstance(row[c], list) else str(row[c]) for c in columns])
    Console().print(table)
    return 1 if failed else 0


def cmd_report(args: argparse.Namespace) -> int:
    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.config import PathsConfig
    from evertrain.data.lineage import champion_vs_base, iteration_report
    from evertrain.report import format_versus, render_table, share_line

    store = _open_for_reading(args.store or (_config(args).paths.store if args.config else PathsConfig().store),
                              args.campaign)
    try:
        _campaign_iterations(store, args.campaign)
    except UsageError:
        store.close()
        raise
    rows = iteration_report(store, args.campaign)
    summary = champion_vs_base(store, args.campaign)
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.lineage import last_refusal
    from evertrain.report import agent_metrics, format_agent, format_mix, format_refusal, mix_over_iterations

    mix, agent = mix_over_iterations(store, args.campaign), agent_metrics(store, args.campaign)
    refusal = last_refusal(store, args.campaign)
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.lineage import live_pass_rate
    from evertrain.report import format_live

    live = live_pass_rate(store, args.campaign)
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.lineage import live_pass_rate_over_time

    live_series = live_pass_rate_over_time(store, args.campaign) if args.html else []
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.data.lineage import sealed_curve

    sealed = sealed_curve(store, args.campaign) if args.html else []
    # late: duckdb, pandas (the store); the curriculum (dataclasses, logging: ~25 ms); --help loads none of them
    from evertrain.curriculum import format_levels, levels_over_iterations
    from evertrain.data.lineage import diversity
    from evertrain.report import format_diversity, format_frontier, format_gate_power, gate_power

    levels, spread, power = levels_over_iterations(store, args.campaign), diversity(store, args.campaign), \
        gate_power(store, args.campaign)
    store.close()
    if not rows:
        raise UsageError(f"campaign {args.campaign!r} has no iterations in {store.location.describe()}")
    if args.html:
        # late: numpy, scipy, matplotlib (the figures); --help does not load them
        from evertrain.plots import html_report

        sections = [
            ("Curriculum levels", levels, [("iteration", "iteration"), ("env", "environment"), ("level", "level"),
                                           ("max_level", "top level"), ("groups", "groups"),
                                           ("pass_rate", "pass rate"), ("action", "action"), ("reason", "why")], []),
            ("Sample diversity (stored rollouts)", spread, [
                ("iteration", "iteration"), ("groups", "groups"), ("distinct_completions", "distinct per group"),
                ("distinct_share", "distinct share"), ("token_entropy", "token entropy (nats)"),
                ("informative_share", "informative groups")], []),
            ("Frontier (predicted and observed informative groups, guidance)", [], [], format_frontier(rows)),
            ("Gate power", [], [], format_gate_power(power))]
        page = html_report(args.campaign, rows, summary, sections, live=live_series, sealed=sealed)
        Path(args.html).write_text(page, encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    elif not args.html:
        render_table(rows, f"campaign {args.campaign}", wide=args.wide)
        if share_line(rows):
            print(share_line(rows))
        for s in summary:
            print(format_versus(s))
        for line in (format_refusal(refusal) + format_agent(agent) + format_mix(mix) + format_levels(levels)
                     + format_diversity(spread) + format_frontier(rows) + format_gate_power(power)
                     + format_live(live)):
            print(line)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    """Read-only SQL on the store, also while a campaign writes it (DuckLake readers see the last commit).

    Read-only for real: one SELECT at a time, on a connection that can read nothing but the store's own files
    and change no setting (Store.read_sql); anything else is refused with exit status 2."""
    # late: third-party; `evertrain --help` loads no third-party library
    import duckdb

    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store, StoreError

    uri = args.store or (_config(args).paths.store if args.config else PathsConfig().store)
    store = Store(uri, read_only=True, user_sql=True)
    try:
        frame = store.read_sql(args.query)
    except duckdb.Error as error:
        raise StoreError(f"query failed on {store.location.describe()}: {error}") from None
    finally:
        store.close()
    if args.format == "csv":
        print(frame.to_csv(index=False), end="")
    elif args.format == "json":
        print(frame.to_json(orient="records", date_format="iso", indent=2))
    else:
        # late: third-party; `evertrain --help` loads no third-party library
        import pandas as pd

        with pd.option_context("display.max_rows", args.max_rows, "display.max_columns", None,
                               "display.width", 200, "display.max_colwidth", 60):
            print(frame.to_string(index=False, max_rows=args.max_rows) if len(frame)
                  else f"(no rows; columns: {', '.join(map(str, frame.columns))})")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """The endpoint's API keys: create (the secret printed once), list, revoke; each create and revoke audited."""
    # late: third-party; `evertrain --help` loads no third-party library
    import duckdb

    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    # late: the store and FastAPI (the endpoint); --help does not load them
    from evertrain.config import PathsConfig
    from evertrain.data.store import Store
    from evertrain.serving.auth import create_key, revoke_key

    uri = args.store or (_config(args).paths.store if args.config else PathsConfig().store)
    with Store(uri, read_only=args.action == "list") as store:
        if args.action == "create":
            secret, row = create_key(store, args.name, args.scopes, args.actor)
            print(secret)
            print(f"key {row['key_id']} ({row['name']!r}, scopes {row['scopes']}) made by {row['created_by']}; the "
                  "secret above is shown only now (the store keeps its hash): send it as 'Authorization: Bearer "
                  "<key>', or set EVERTRAIN_API_KEY for evertrain's own clients", file=sys.stderr)
        elif args.action == "revoke":
            revoked = revoke_key(store, args.key, args.actor)
            if not revoked:
                print(f"evertrain: error: no working API key has the id or name {args.key!r}", file=sys.stderr)
                return 2
            for row in revoked:
                print(f"revoked {row['key_id']} ({row['name']!r}); the endpoints refuse it within "
                      "serving.auth_cache_seconds")
        else:
            try:
                frame = store.api_keys(include_revoked=args.all)
            except duckdb.CatalogException:  # a store older than the keys (opened read-only: not upgraded)
                print("(no API keys: this store has none yet)")
                return 0
            if args.json:
                print(frame.to_json(orient="records", date_format="iso", indent=2))
            else:
                print(frame.to_string(index=False) if len(frame) else "(no API keys)")
    return 0


def cmd_services(args: argparse.Namespace) -> int:
    # late: services loads urllib.request (http.client, ssl: ~20 ms); --help does not
    from evertrain import services

    if args.action == "start":
        try:
            info = services.start(Path(args.dir), host=args.host)
        except services.ServiceError as error:
            print(f"evertrain: error: {error}", file=sys.stderr)
            return 2
        print(services.describe(info))
    elif args.action == "stop":
        services.stop(Path(args.dir))
        print(f"stopped the services under {args.dir}", file=sys.stderr)
    else:
        info = services.status(Path(args.dir))
        print(services.describe(info) if info else f"no services running under {args.dir}")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    # late: pydantic; `evertrain --help` loads no third-party library
    # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
    from evertrain.config import load_config
    from evertrain.flows.deploy import deploy

    if not os.environ.get("PREFECT_API_URL"):
        print("evertrain: error: PREFECT_API_URL is not set: start the servers (`evertrain services start`, then "
              "`source .services/env`) or point it at your Prefect server", file=sys.stderr)
        return 2
    configs = [load_config(path) for path in args.config]
    for config, deployment_id in zip(configs, deploy(configs, pool=args.pool, interval=args.interval,
                                                     cron=args.cron, iterations_per_run=args.iterations_per_run),
                                     strict=True):
        print(f"deployment evertrain-campaign/campaign-{config.name} ({deployment_id}) in work pool {args.pool!r}")
    print(f"start a worker: prefect worker start --pool {args.pool}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # late: pydantic; `evertrain --help` loads no third-party library
    from evertrain.config import load_config

    configs = [load_config(path).resolved() for path in args.config]
    if args.interval is None and args.cron is None:
        args.interval = 3600.0
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        # scheduled runs need a real server (Prefect's temporary one runs no scheduler)
        # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
        from evertrain.flows.deploy import start_server

        url, server = start_server(args.port, scheduler_seconds=min(10.0, args.interval or 10.0))
        _SERVERS.append(server)
        os.environ["PREFECT_API_URL"] = url
        print(f"started a Prefect server: UI at {url.removesuffix('/api')}", file=sys.stderr)
    # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
    from evertrain.flows.deploy import serve

    names = ", ".join(c.name for c in configs)
    schedule = f"every {args.interval:g} s" if args.interval is not None else f"cron {args.cron!r}"
    print(f"serving campaign(s) {names}: {args.iterations_per_run} iteration(s) per run, {schedule}, "
          "one run at a time; trigger runs from the Prefect UI; Ctrl-C stops", file=sys.stderr)
    # SIGTERM (a service manager's stop, `kill`) stops like Ctrl-C: the deployments are paused and the Prefect
    # server started above is stopped, not left running without its parent (Prefect's runner handles SIGTERM
    # itself once it runs; this covers the moments before)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(configs, interval=args.interval, cron=args.cron, iterations_per_run=args.iterations_per_run)
    finally:
        if server is not None:
            # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
            from evertrain.flows.deploy import stop_server

            stop_server(server)
    return 0


_SIGNALLED: list[int] = []  # the signals _interrupt has turned into a KeyboardInterrupt in this process
_SERVERS: list[Any] = []  # servers this process started that a second stop signal must stop too


def _interrupt(signum: int, frame: Any) -> None:
    """The first stop signal stops in order (a KeyboardInterrupt: the flow run marked, the store closed); a second
    one stops now: the temporary Prefect server is stopped and the process exits with status 130 without
    reporting anything more (the store is safe: its writes are transactions, a stage left 'running' is redone
    on the next run, the campaign's claim dies with the process)."""
    if _SIGNALLED:
        try:
            os.write(2, f"evertrain: a second stop signal ({signal.Signals(signum).name}): stopping now\n".encode())
            # late: the deployments (the store; Prefect as they run); --help and a bad config load neither
            from evertrain.flows.deploy import stop_temporary_server

            stop_temporary_server()
            processes.stop(_SERVERS, timeout=5)  # a Prefect server `evertrain serve` started
        finally:
            os._exit(130)
    _SIGNALLED.append(signum)
    interrupts.record(signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _signal_types() -> tuple[type[BaseException], ...]:
    """What a signal turns into in this process: a KeyboardInterrupt (Ctrl-C, or :func:`_interrupt` on SIGTERM), or,
    while a Prefect flow runs, Prefect's ``TerminationSignal``: Prefect swaps its own SIGTERM handler in for the
    length of a flow run (``prefect.utilities.engine.capture_sigterm``). Prefect's type is looked up only if Prefect
    is imported: before that, nothing can have raised it."""
    exceptions = sys.modules.get("prefect.exceptions")
    external = getattr(exceptions, "ExternalSignal", None)
    return (KeyboardInterrupt,) if external is None else (KeyboardInterrupt, external)


def _interrupted(error: BaseException) -> bool:
    """Whether ``error`` is an interruption in disguise. DuckDB turns an exception raised by a signal handler during
    a query into ``RuntimeError('Query interrupted')`` caused by it; during a flow run that handler is Prefect's, so
    the cause is Prefect's ``TerminationSignal``, not a KeyboardInterrupt, and Prefect's bridge, which hands SIGTERM
    on to the handler before it only when its own signal reaches it, never sees it (two fresh-clone CI runs, stops
    38 and 40: `evertrain run` exited 1). So a signal type anywhere in the chain counts, and so does any error
    after :func:`_interrupt` has run."""
    if _SIGNALLED or interrupts.requested():
        return True
    signals = _signal_types()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, signals):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def cmd_rollback(args: argparse.Namespace) -> int:
    config = _config(args, stored=True)
    require_campaign(config.paths.store, config.name)
    # late: torch, Prefect (the training stack); --help and a bad config must not import them
    from evertrain.runtime import Runtime
    from evertrain.tasks.promote import rollback

    with Runtime.open(config) as rt:
        result = rollback(rt, args.to, reason=args.reason, allow_unpromoted=args.allow_unpromoted)
    print(f"campaign {result['campaign']!r}: champion is now v{result['champion']} (previous_champion "
          f"v{result['previous_champion']}); the next iteration samples from v{result['trainee']}; recorded as made "
          f"by {result['actor']}" + (" (a version that was never champion)" if result["unpromoted"] else ""))
    return 0


def prefect_ui_env(host: str, port: int) -> dict[str, str]:
    """What the Prefect server needs so its UI (running in the browser) calls the API on the chosen port.

    The UI asks for ``PREFECT_UI_API_URL``, which otherwise falls back to ``PREFECT_API_URL`` (often
    http://127.0.0.1:4200/api from a profile or the environment): on any other port the UI then shows
    "Can't connect to Server API". A wildcard host is reached from the browser as localhost.
    """
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    api = f"http://{reachable}:{port}/api"
    return {"PREFECT_UI_API_URL": api, "PREFECT_API_URL": api, "PREFECT_UI_URL": f"http://{reachable}:{port}",
            "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port)}


def cmd_export(args: argparse.Namespace) -> int:
    config = _config(args, stored=True)
    require_campaign(config.paths.store, config.name)
    # late: torch, Prefect (the training stack); --help and a bad config must not import them
    from evertrain.export import export
    from evertrain.runtime import Runtime

    with Runtime.open(config) as rt:
        result = export(rt, Path(args.out), version=args.version, log_to_mlflow=not args.no_mlflow)
    print(f"exported v{result['version']} of campaign {config.name!r} to {result['out']}: "
          f"{', '.join(result['files'])}", file=sys.stderr)
    if result["mlflow_model_uri"]:
        print(f"MLflow model: {result['mlflow_model_uri']} (serve it: mlflow models serve -m "
              f"{result['mlflow_model_uri']} --env-manager local)", file=sys.stderr)
    print(json.dumps(result))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    # late: pydantic; `evertrain --help` loads no third-party library
    # late: duckdb, pandas (the store); --help and a bad config do not load them
    from evertrain.config import PathsConfig
    from evertrain.data.lineage import sample_rollouts
    from evertrain.report import render_rollouts

    store = _open_for_reading(args.store or (_config(args).paths.store if args.config else PathsConfig().store),
                              args.campaign)
    try:
        _iteration_stages(store, args.campaign, args.iteration)
        rows = sample_rollouts(store, args.campaign, args.iteration, env=args.env, per_env=args.limit)
    finally:
        store.close()
    if not rows:
        where = f" of environment {args.env!r}" if args.env else ""
        raise UsageError(f"campaign {args.campaign!r} has no rollouts{where} in iteration {args.iteration}")
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        render_rollouts(rows, f"campaign {args.campaign}, iteration {args.iteration}"
                        + (f", {args.env}" if args.env else ""), prompt_chars=args.prompt_chars)
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    # late: pydantic (config); urllib.request (services); `evertrain --help` loads neither
    from evertrain import services
    from evertrain.config import load_config

    paths = load_config(None).paths  # the defaults, anchored to the project home
    Path(paths.mlflow_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    prefect_env = {**os.environ, **prefect_ui_env(args.host, args.prefect_port)}
    # each server in a session of its own, tied to this process: a SIGKILLed `evertrain ui` leaves neither behind
    tied = functools.partial(processes.tied_to, os.getpid())
    procs = [
        subprocess.Popen([str(bin_dir / "prefect"), "server", "start", "--host", args.host,
                          "--port", str(args.prefect_port)], env=prefect_env, preexec_fn=tied),
        subprocess.Popen([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", paths.mlflow_uri,
                          "--default-artifact-root", Path(paths.artifacts).resolve().as_uri(),
                          "--host", args.host, "--port", str(args.mlflow_port)],
                         env=services.mlflow_server_env(dict(os.environ)), preexec_fn=tied),
    ]

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (a service manager, `kill`) stops both servers, as Ctrl-C does

    signal.signal(signal.SIGTERM, _stop)
    try:
        time.sleep(2)
        print(f"\nPrefect UI: http://{args.host}:{args.prefect_port}\nMLflow UI:  http://{args.host}:{args.mlflow_port}\n"
              "Ctrl-C (or SIGTERM) stops both.\nThe Prefect UI's \"Run\" form appears once a campaign is deployed: "
              f"PREFECT_API_URL=http://{args.host}:{args.prefect_port}/api evertrain serve --config "
              "configs/default.toml (in a second terminal).", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal does not cut the stop short
        processes.stop(procs, first=signal.SIGINT, timeout=20)
    return 0


def _schedule_arguments(parser: argparse.ArgumentParser, interval_default: str = "") -> None:
    """--interval or --cron, and --iterations-per-run: how a deployment is scheduled (serve, deploy)."""
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--interval", type=float, help=f"seconds between scheduled runs{interval_default}")
    when.add_argument("--cron", help="cron schedule, e.g. '0 */6 * * *'")
    parser.add_argument("--iterations-per-run", type=int, default=1, help="iterations per scheduled run (default 1)")


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors start ``evertrain: error:`` like every other refusal (then the usage)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("evertrain").strip()
        self.exit(2, f"evertrain: error: {command + ': ' if command else ''}{message}\n{self.format_usage()}")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="evertrain", description=__doc__ and
                                     "Continuous RL post-training of language-model agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a campaign: N iterations, or forever")
    run.add_argument("--config", help="campaign TOML file (default: the built-in defaults)")
    run.add_argument("--campaign", help="campaign name (overrides the config's)")
    run.add_argument("--iterations", type=int, help="how many iterations (omitted: run forever)")
    run.add_argument("--verbose", action="store_true", help="the libraries' chatter too (the trainers' raw log "
                     "dictionaries; sets EVERTRAIN_VERBOSE=1)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override one config value, e.g. --set generation.backend=vllm or "
                          "--set environments.0.max_new_tokens=32 (repeatable; the value is read as TOML)")
    run.set_defaults(func=cmd_run)

    stage = sub.add_parser("stage", help="rerun one stage of one iteration (replaces that stage's rows)")
    stage.add_argument("stage", choices=["curate", "rollout", "score", "sft", "update", "evaluate", "promote"])
    stage.add_argument("--campaign", required=True)
    stage.add_argument("--iteration", type=int, required=True)
    stage.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    stage.add_argument("--store", help="DuckDB store to find the campaign's config in")
    stage.set_defaults(func=cmd_stage)

    score = sub.add_parser("score", help="grade completions from a JSONL file, in parallel, in input order")
    score.add_argument("--input", required=True, help='JSONL: {"id", "env", "problem": {...}, "completion"}')
    score.add_argument("--output", required=True, help='JSONL: {"id", "reward", "passed", "reason", "detail"}')
    score.add_argument("--workers", type=int, help="parallel graders (default: one per core)")
    score.add_argument("--store", help="store URI for the sandbox audit rows (default: the default store)")
    score.set_defaults(func=cmd_score)

    envs = sub.add_parser("envs", help="list every registered environment")
    envs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    envs.add_argument("--validate", type=int, nargs="?", const=2, default=0, metavar="N",
                      help="also run each verifier's self-test on N train and N eval problems (known-good "
                           "answers earn 1, a battery of known-bad ones exactly 0; exit status 1 if any fails) "
                           "and the quality check's probes on them (constant, sign- or digit-changed answers, "
                           "hard-coded visible tests, move sprays, linked or wrongly typed files: the share of "
                           "items each passes, and what it flags)")
    envs.add_argument("--env", action="append", metavar="NAME", help="only this environment (repeatable)")
    envs.add_argument("--config", metavar="FILE",
                      help="the environments of this campaign TOML, with their options (an OpenEnv server's app, a "
                           "taskset's knobs): all of them, or those named with --env")
    envs.add_argument("--cases", action="store_true", help="with --json --validate: every self-test case")
    envs.add_argument("--jobs", type=int, default=0, metavar="N",
                      help="with --validate: self-test N environments at a time, each in a process of its own "
                           "(default: one per CPU core)")
    envs.set_defaults(func=cmd_envs)

    report = sub.add_parser("report", help="the per-iteration table of a campaign")
    report.add_argument("--campaign", required=True)
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    report.add_argument("--wide", action="store_true", help="every column (about 160 characters wide); the default "
                        "table fits 100")
    report.add_argument("--html", metavar="FILE", help="write a self-contained HTML page with plots and tables")
    report.add_argument("--config", help="campaign TOML file whose paths.store to read")
    report.add_argument("--store", help="store URI (default: $EVERTRAIN_STORE, else the DuckLake store under data/)")
    report.set_defaults(func=cmd_report)

    srv = sub.add_parser("serve", help="run campaigns on a schedule as Prefect deployments (one run at a time)")
    srv.add_argument("--config", action="append", required=True, help="campaign TOML file (repeatable)")
    _schedule_arguments(srv, interval_default=" (default 3600)")
    srv.add_argument("--port", type=int, default=4200, help="port of the Prefect server started when "
                     "PREFECT_API_URL is not set (default 4200, or a free one)")
    srv.set_defaults(func=cmd_serve)

    back = sub.add_parser("rollback", help="move champion back to previous_champion (or --to VERSION)")
    back.add_argument("--campaign", required=True)
    back.add_argument("--to", type=int, help="the model version to restore (default: previous_champion)")
    back.add_argument("--reason", default="manual rollback", help="recorded in the rollbacks table")
    back.add_argument("--allow-unpromoted", action="store_true",
                      help="restore a version that was never champion (a challenger the gate refused); recorded")
    back.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    back.add_argument("--store", help="DuckDB store to find the campaign's config in")
    back.set_defaults(func=cmd_rollback)

    sql = sub.add_parser("sql", help="run read-only SQL on the store (also while a campaign writes it)")
    sql.add_argument("query", help='e.g. "SELECT iteration, avg(reward) FROM rollouts GROUP BY ALL ORDER BY ALL"')
    sql.add_argument("--store", help="store URI (default: $EVERTRAIN_STORE, else the DuckLake store under data/)")
    sql.add_argument("--config", help="campaign TOML file whose paths.store to read")
    sql.add_argument("--format", choices=["table", "csv", "json"], default="table")
    sql.add_argument("--max-rows", type=int, default=100, help="rows shown in table format (default 100)")
    sql.set_defaults(func=cmd_sql)

    keys = sub.add_parser("keys", help="the endpoint's API keys: create (the secret is printed once), list, revoke")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    for action, what in (("create", "make a key and print its secret (once: the store keeps only its hash)"),
                         ("list", "the working keys (--all: the revoked ones too), without their secrets"),
                         ("revoke", "revoke a key by id or name: the endpoints refuse it within "
                                    "serving.auth_cache_seconds")):
        verb = keys_sub.add_parser(action, help=what)
        if action == "create":
            verb.add_argument("--name", required=True, help="who or what uses it, e.g. 'support-bot'")
            verb.add_argument("--scopes", default="infer",
                              help="comma-separated, of infer (chat completions), feedback (POST /feedback), "
                              "admin, approve (answer promotions waiting for a person) (default: infer)")
        elif action == "revoke":
            verb.add_argument("key", metavar="NAME_OR_ID", help="the key's id (key_...) or name")
        else:
            verb.add_argument("--all", action="store_true", help="the revoked keys too")
            verb.add_argument("--json", action="store_true", help="print JSON")
        if action != "list":
            verb.add_argument("--actor", help="who does it, for the audit (default: the login name)")
        verb.add_argument("--store", help="store URI (default: $EVERTRAIN_STORE, else the DuckLake store under data/)")
        verb.add_argument("--config", help="campaign TOML file whose paths.store to use")
        verb.set_defaults(func=cmd_keys)

    svc = sub.add_parser("services", help="PostgreSQL, a Prefect server and an MLflow server on it, on this machine")
    svc.add_argument("action", choices=["start", "stop", "status"])
    svc.add_argument("--dir", default=str(PROJECT_ROOT / ".services"), help="state folder (default .services/)")
    svc.add_argument("--host", default="127.0.0.1", help="address the servers listen on (default 127.0.0.1)")
    svc.set_defaults(func=cmd_services)

    dep = sub.add_parser("deploy", help="register campaign deployments (with schedules) in a Prefect work pool")
    dep.add_argument("--config", action="append", required=True, help="campaign TOML file (repeatable)")
    dep.add_argument("--pool", default="evertrain", help="work pool (created as a process pool if missing)")
    _schedule_arguments(dep)
    dep.set_defaults(func=cmd_deploy)

    exp = sub.add_parser("export", help="write a model version as a plain Hugging Face folder (+ MLflow model, card)")
    exp.add_argument("out", help="output folder (new or empty)")
    exp.add_argument("--campaign", required=True)
    exp.add_argument("--version", type=int, help="model version (default: the champion)")
    exp.add_argument("--no-mlflow", action="store_true", help="do not log the model to MLflow")
    exp.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    exp.add_argument("--store", help="store to find the campaign's config in")
    exp.set_defaults(func=cmd_export)

    show = sub.add_parser("show", help="print an iteration's rollouts with their turns")
    show.add_argument("--campaign", required=True)
    show.add_argument("--iteration", type=int, required=True)
    show.add_argument("--env", help="only this environment")
    show.add_argument("--limit", type=int, default=4, help="rollouts per environment (default 4)")
    show.add_argument("--prompt-chars", type=int, default=600, help="show the prompt's last N characters")
    show.add_argument("--json", action="store_true", help="print JSON instead of panels")
    show.add_argument("--config", help="campaign TOML file whose paths.store to read")
    show.add_argument("--store", help="store (default: paths.store's default)")
    show.set_defaults(func=cmd_show)

    ui = sub.add_parser("ui", help="start the Prefect server and the MLflow UI on localhost")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.set_defaults(func=cmd_ui)

    for verb, what in (("approve", "promote"), ("reject", "keep the champion instead of")):
        answer = sub.add_parser(verb, help=f"{what} the challenger of a promotion waiting for approval "
                                "(promotion.approval = 'required'), through the Prefect API")
        answer.add_argument("--campaign", required=True)
        answer.add_argument("--reason", default="", help="why (recorded in the approvals table and MLflow)")
        answer.add_argument("--key-file", metavar="FILE", help="file holding your API key with the 'approve' scope "
                            "(default: $EVERTRAIN_API_KEY); the decision is recorded under the key's name")
        answer.add_argument("--iteration", type=int, help="which iteration, when several wait")
        answer.add_argument("--show", action="store_true", help="print the evidence the form shows; answer nothing")
        answer.add_argument("--html", metavar="FILE", help="write the evidence as an HTML page; answer nothing")
        answer.set_defaults(func=cmd_approve if verb == "approve" else cmd_reject)

    end = sub.add_parser("endpoint", help="serve the campaign's champion: OpenAI-compatible chat completions, "
                         "hot-swapped on promotion, traced into the store")
    end.add_argument("--campaign", required=True)
    end.add_argument("--host", help="address to listen on (default: serving.host, 127.0.0.1)")
    end.add_argument("--port", type=int, help="port (default: serving.port, 8000)")
    end.add_argument("--config", help="campaign TOML file (default: the config stored for the campaign)")
    end.add_argument("--store", help="store to find the campaign's config in")
    end.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override one config value, e.g. --set serving.trace=false (repeatable)")
    end.set_defaults(func=cmd_endpoint)
    return parser


def _answer(args: argparse.Namespace, approve: bool) -> int:
    # late: Prefect (the approval form); --help does not load it
    from evertrain.approval import ApprovalError, answer, approval_page, waiting

    try:
        if args.show or args.html:
            run = waiting(args.campaign, args.iteration)
            if args.html:
                Path(args.html).write_text(approval_page(run["evidence"]))
            if args.show:
                print(run["evidence"])
            return 0
        secret = None
        if args.key_file:
            try:
                secret = Path(args.key_file).read_text().strip()
            except OSError as error:
                raise ApprovalError(f"--key-file {args.key_file}: {error.strerror or error}") from None
        done = answer(args.campaign, approve, args.reason, secret, args.iteration)
    except ApprovalError as error:
        print(f"evertrain: error: {error}", file=sys.stderr)
        return 2
    print(f"campaign {args.campaign!r}, iteration {done['iteration']}: answered {'approve' if approve else 'reject'} "
          f"from {done['answered_from']}; flow run {done['name']} resumes once the key is checked "
          "(`evertrain sql \"SELECT * FROM approval_attempts\"` shows whether it was accepted)")
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    return _answer(args, True)


def cmd_reject(args: argparse.Namespace) -> int:
    return _answer(args, False)


def cmd_endpoint(args: argparse.Namespace) -> int:
    config = _config(args, stored=True)
    require_campaign(config.paths.store, config.name)
    # late: the store and FastAPI (the endpoint); --help does not load them
    from evertrain.serving.app import serve

    serve(config, host=args.host, port=args.port)
    return 0


# the errors that mean bad input (a config, a store, a model path, an environment): one line, exit status 2
INPUT_ERRORS = {"evertrain.config": "ConfigError", "evertrain.data.store": "StoreError",
                "evertrain.envs.registry": "UnknownEnvironment", "evertrain.models": "ModelError",
                "evertrain.runtime": "EnvironmentInvalid"}


def _input_errors() -> tuple[type[Exception], ...]:
    """INPUT_ERRORS' types, from the modules already imported: an error of a module never imported cannot have
    been raised, and importing one to name its error would make a bad config pay for torch (about 3 CPU-s)."""
    return tuple(getattr(sys.modules[module], name) for module, name in INPUT_ERRORS.items() if module in sys.modules)


def main(argv: list[str] | None = None) -> int:
    """The ``evertrain`` command. A reader that closes stdout early (``| head``) ends it quietly, status 141."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
        return status
    except BrokenPipeError:
        # Python's recipe: stdout goes to /dev/null so the flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.func in (cmd_sql, cmd_keys):  # quick, from another shell: no torch, transformers or Prefect imports
        # late: pydantic; `evertrain --help` loads no third-party library
        # late: duckdb, pandas (the store); --help and a bad config do not load them
        # late: the store and FastAPI (the endpoint); --help does not load them
        from evertrain.config import ConfigError
        from evertrain.data.store import StoreError
        from evertrain.serving.auth import KeySpecError

        try:
            return int(args.func(args) or 0)
        except (ConfigError, StoreError, KeySpecError) as error:
            print(f"evertrain: error: {error}", file=sys.stderr)
            return 2
    _environment()
    try:
        return int(args.func(args) or 0)
    except UsageError as error:
        print(f"evertrain: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except Exception as error:
        if _interrupted(error):
            return _report_interrupt()
        if not isinstance(error, _input_errors()):
            raise
        print(f"evertrain: error: {error}", file=sys.stderr)
        return 2
    except BaseException as error:  # Ctrl-C, SIGTERM, or Prefect's TerminationSignal raised out of a flow run
        if isinstance(error, _signal_types()):
            return _report_interrupt()
        raise


def _report_interrupt() -> int:
    print("evertrain: interrupted; `evertrain run` resumes at the interrupted stage", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
