"""Cost as a campaign grows: does an iteration cost more CPU at iteration 200 than at iteration 1?

A cheap campaign (configs/smoke.toml's settings: the tiny model built from a config, 8 problems × G=4 of three
environments, 16 new tokens, every stage every iteration, the gate on 4 held-out problems per environment; one torch
thread) runs in a scratch folder through the code path ``evertrain run`` takes: Prefect's temporary server started
once (``flows.deploy.start_temporary_server``, its database in the scratch folder), one campaign context
(``Runtime.open``, the campaign's one writer, held for the whole run) and ``run_campaign_flow(rt, K)`` for every
chunk of ``--chunk`` iterations: each chunk is one flow run of the campaign, which goes on where the last stopped.

Recorded:

- per iteration and stage, its CPU and wall seconds as the store recorded them (``stage_runs.cpu_s``/``wall_s``:
  the stage's own work, its children and engines included);
- per iteration, all of it: the process's CPU and wall seconds from the end of one iteration to the end of the next
  (the iteration subflow in Prefect, the stages and their bookkeeping: ``stage_runs`` rows, MLflow runs and metrics,
  retention; the loop's report line; compaction where it ran), and so what was spent outside the stages. The ends
  are marked by thin wrappers around the loop's report line (``flows.campaign._report_iteration``) and this
  context's ``store.compact``, both called through unchanged: the code runs as it does in ``evertrain run``;
- per chunk: the Prefect server's CPU (a process of its own), the store on disk (``Store.disk_usage``: files and
  bytes of the DuckLake data folder, the SQLite catalog's bytes), the files the current snapshot references and the
  catalog's snapshots; the MLflow and Prefect databases' and the checkpoints' bytes; and the median wall and CPU of
  3 runs of a fixed set of reads: opening the store read-only, ``evertrain report``'s queries (the report and
  lineage functions it calls), and the history queries the stages and the loop make (which iteration is next,
  curation's attempt history, the sampling history, the champion's lineage, the gate history, the last gate per
  environment, the MLflow run lookup every stage makes);
- the least-squares slope of each stage's CPU per iteration (and of the whole iteration's) against the iteration
  number, after the first iteration (environment validation, the base model's registration, first-use imports),
  with its standard error and the change it predicts over the run as a share of the mean; the same for each read
  against the iteration it ran after.

Compaction runs as the product runs it (``flows.campaign.COMPACT_EVERY``: every 5 iterations, ``Store.compact``:
merge adjacent files, expire the snapshots older than ``flows.campaign.COMPACT_KEEP_SECONDS``, delete the files
no snapshot needs; each one's CPU and files before and after are recorded); ``--compact-every N`` sets that constant
for this run (0: never) and ``--keep-seconds S`` the other, to compare. Every snapshot kept is rows of the catalog
that each query reads: a campaign whose iterations take seconds keeps many more of them than one whose iterations
take minutes, so the cost of a long run of this tiny campaign at a keep window scaled to its pace is what a real
campaign meets at the product's.

    .venv/bin/python benchmarks/growth.py [--iterations 200] [--chunk 10] [--save cpu] [--workdir DIR]
        [--compact-every N] [--keep-seconds S]

Writes benchmarks/results/growth_<save>.json (with the command, machine and date) and growth_<save>.png: CPU per
iteration by stage, the reads' CPU, and the store's files and size, against the iteration. Iterations are counted
from 1 in the table and the plot (the store's iteration 0 is the first).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EVERTRAIN_PROGRESS", "0")  # no progress bars between the report lines

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from prefect.settings import PREFECT_HOME, temporary_settings  # noqa: E402

from benchmarks.common import RESULTS, print_table, save  # noqa: E402
from evertrain.config import CampaignConfig, load_config  # noqa: E402
from evertrain.curriculum import levels_over_iterations  # noqa: E402
from evertrain.data.lineage import (  # noqa: E402
    champion_vs_base,
    diversity,
    diversity_metrics,
    iteration_report,
    last_refusal,
    live_pass_rate,
)
from evertrain.data.store import Store  # noqa: E402
from evertrain.flows import campaign as campaign_module  # noqa: E402
from evertrain.flows.deploy import start_temporary_server, stop_temporary_server  # noqa: E402
from evertrain.models.tiny import build_tiny_model  # noqa: E402
from evertrain.quiet import quiet_libraries, quiet_prefect_console  # noqa: E402
from evertrain.report import agent_metrics, gate_power, mix_over_iterations  # noqa: E402
from evertrain.runtime import Runtime  # noqa: E402
from evertrain.tasks import STAGES  # noqa: E402
from evertrain.tasks.base import cpu_seconds  # noqa: E402

quiet_libraries()

READ_REPEATS = 3
NEVER = 10**9  # --compact-every 0: a compaction interval no campaign reaches


def campaign_config(root: Path, name: str) -> CampaignConfig:
    """configs/smoke.toml for campaign ``name`` with every path under ``root`` and the tiny model built there (from
    a config, nothing downloaded), one torch thread: what the tests' ``smoke_config_in`` makes."""
    build_tiny_model(root / "models" / "tiny-llama")
    data = load_config(ROOT / "configs" / "smoke.toml").model_dump(mode="json")
    data.update(name=name, torch_threads=1)
    data["model"]["models_dir"] = str(root / "models")
    data["paths"] = {"store": f"ducklake:sqlite:{root / 'evertrain.sqlite'}",
                     "mlflow_uri": f"sqlite:///{root / 'mlflow' / 'mlflow.db'}",
                     "artifacts": str(root / "mlflow" / "artifacts"), "checkpoints": str(root / "checkpoints")}
    return CampaignConfig.model_validate(data)


class Marks:
    """Where each iteration ended, on the process's CPU clock (``tasks.base.cpu_seconds``, the stages' own) and
    the wall clock: set by wrappers around the loop's report line and the store's compaction, which follow an
    iteration in ``run_campaign``; each wrapper calls the original and returns what it returns."""

    def __init__(self, report: Callable[[Runtime, int], None], compact: Callable[..., dict[str, Any]]) -> None:
        self._report, self._compact = report, compact
        self.ends: dict[int, tuple[float, float]] = {}
        self.report_line: dict[int, dict[str, float]] = {}
        self.compactions: list[dict[str, Any]] = []
        self.last: int | None = None

    def report(self, rt: Runtime, iteration: int) -> None:
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        self._report(rt, iteration)
        cpu1, wall1 = cpu_seconds(), time.perf_counter()
        self.report_line[iteration] = {"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0}
        self.ends[iteration], self.last = (cpu1, wall1), iteration

    def compact(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        result = self._compact(*args, **kwargs)
        cpu1, wall1 = cpu_seconds(), time.perf_counter()
        self.compactions.append({"iteration": self.last, "cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0, **result})
        if self.last is not None:
            self.ends[self.last] = (cpu1, wall1)
        return result


def server_cpu(server: Any) -> float | None:
    """CPU seconds of Prefect's temporary server process (and any children it has) so far; None without one."""
    process = getattr(server, "server_process", None)
    if process is None:
        return None
    try:
        root = psutil.Process(process.pid)
        return sum(t.user + t.system for t in (p.cpu_times() for p in [root, *root.children(recursive=True)]))
    except psutil.Error:
        return None


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def database_bytes(path: Path) -> int:
    """Bytes of a SQLite database with its write-ahead log and shared-memory file."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"))
               if p.is_file())


def store_state(store: Store) -> dict[str, Any]:
    """The store on disk (``Store.disk_usage``), the data and delete files the current snapshot references, and the
    catalog's snapshots."""
    disk = store.disk_usage()
    meta = "__ducklake_metadata_lake"
    live = store.query(f"SELECT count(*) AS n, coalesce(sum(file_size_bytes), 0) AS b FROM {meta}.ducklake_data_file "
                       "WHERE end_snapshot IS NULL")
    deletes = store.scalar(f"SELECT count(*) FROM {meta}.ducklake_delete_file WHERE end_snapshot IS NULL")
    return {**disk, "mb": (disk["data_bytes"] + disk["catalog_bytes"]) / 2**20, "live_files": int(live["n"].iloc[0]),
            "live_data_bytes": int(live["b"].iloc[0]), "live_delete_files": int(deletes),
            "snapshots": int(store.scalar(f"SELECT count(*) FROM {meta}.ducklake_snapshot"))}


def timed(read: Callable[[], Any], repeats: int = READ_REPEATS) -> dict[str, float]:
    """Median wall and CPU seconds (every thread of this process: DuckDB's too) of ``repeats`` runs of ``read``."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        read()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def time_reads(rt: Runtime, last: int) -> dict[str, dict[str, float]]:
    """The fixed set of reads after iteration ``last``: on a read-only connection of the store, as `evertrain
    report` and any reader open it; the stages' history queries as they would run for iteration ``last + 1``."""
    uri, campaign, config = rt.config.paths.store, rt.campaign, rt.config

    def open_close() -> None:
        Store(uri, read_only=True).close()

    reads: dict[str, dict[str, float]] = {"open_read_only": timed(open_close)}
    store = Store(uri, read_only=True)
    try:
        ids = store.curated_problems(campaign, last)["problem_id"].tolist()
        nxt = last + 1
        queries: dict[str, Callable[[], Any]] = {
            # `evertrain report` (cmd_report's text output)
            "report.iteration_report": lambda: iteration_report(store, campaign),
            "report.champion_vs_base": lambda: champion_vs_base(store, campaign),
            "report.mix": lambda: mix_over_iterations(store, campaign),
            "report.agent_metrics": lambda: agent_metrics(store, campaign),
            "report.last_refusal": lambda: last_refusal(store, campaign),
            "report.live_pass_rate": lambda: live_pass_rate(store, campaign),
            "report.levels": lambda: levels_over_iterations(store, campaign),
            "report.diversity": lambda: diversity(store, campaign),
            "report.gate_power": lambda: gate_power(store, campaign),
            # the loop and the stages: which iteration is next; curation's attempt history of its candidates; the
            # rollout's sampling history (two iterations); score's diversity (one); the champion's lineage (update,
            # promote, the runtime); the gate history (promote); the last gate per environment (evaluate, with guard
            # environments); iteration_report is also the loop's report line and promote's progress figure
            "loop.completed_stages": lambda: store.completed_stages(campaign, list(STAGES)),
            "curate.attempt_history": lambda: store.attempt_history(campaign, nxt, ids, config.curation.history_k),
            "rollout.sampling_history": lambda: store.sampling_history(campaign, nxt),
            "score.diversity_metrics": lambda: diversity_metrics(store, campaign, last),
            "lineage.champion_history": lambda: store.champion_history(campaign),
            "promote.gate_history": lambda: store.gate_history(campaign, nxt),
            "evaluate.last_gate_per_env": lambda: store.last_gate_per_env(campaign, nxt),
        }
        for name, query in queries.items():
            reads[name] = timed(query)
    finally:
        store.close()
    # every stage looks its iteration's MLflow run up by tag (Tracker.iteration_run; run_id is its read)
    reads["mlflow.run_id"] = timed(lambda: rt.tracker.run_id(last))
    reads["report.all"] = {k: sum(v[k] for n, v in reads.items() if n.startswith("report."))
                           for k in ("wall_s", "cpu_s")}
    return reads


def fit(x: list[float], y: list[float]) -> dict[str, Any]:
    """Least-squares line of ``y`` on ``x``: slope, its standard error, the mean, and the change the slope predicts
    over the span of ``x`` as a share of the mean (``change_share``; ``t``: slope over its standard error)."""
    n = len(x)
    if n < 2 or len(set(x)) < 2:
        return {"n": n, "mean": float(np.mean(y)) if n else None, "slope": None, "slope_se": None,
                "change_share": None, "t": None}
    xs, ys = np.asarray(x, float), np.asarray(y, float)
    dx = xs - xs.mean()
    slope = float((dx * (ys - ys.mean())).sum() / (dx**2).sum())
    residuals = ys - (ys.mean() + slope * dx)
    se = float(np.sqrt((residuals**2).sum() / (n - 2) / (dx**2).sum())) if n > 2 else None
    mean = float(ys.mean())
    return {"n": n, "mean": mean, "slope": slope, "slope_se": se,
            "change_share": slope * float(xs.max() - xs.min()) / mean if mean else None,
            "t": slope / se if se and se > 1e-9 * max(abs(slope), 1e-9) else None}  # a perfect line has no t


def per_iteration(rt: Runtime, marks: Marks, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per iteration run here: each stage's CPU and wall seconds (``stage_runs``), the whole iteration's
    (from the marks), what was spent outside the stages, the report line's and the compaction's share of it."""
    frame = rt.store.query("SELECT iteration, stage, cpu_s, wall_s FROM stage_runs WHERE campaign = ? "
                           "AND status = 'completed'", [rt.campaign])
    stages: dict[int, dict[str, dict[str, float]]] = {}
    for row in frame.itertuples(index=False):
        stages.setdefault(int(row.iteration), {})[str(row.stage)] = {"cpu_s": float(row.cpu_s or 0),
                                                                      "wall_s": float(row.wall_s or 0)}
    compaction = {c["iteration"]: c for c in marks.compactions}
    rows = []
    for chunk in chunks:
        before = chunk["start"]
        for iteration in chunk["iterations"]:
            end = marks.ends[iteration]
            mine = {s: stages.get(iteration, {}).get(s, {"cpu_s": 0.0, "wall_s": 0.0}) for s in STAGES}
            stage_cpu = sum(v["cpu_s"] for v in mine.values())
            rows.append({
                "iteration": iteration, "n": iteration + 1, "stages": mine, "stages_cpu_s": stage_cpu,
                "stages_wall_s": sum(v["wall_s"] for v in mine.values()),
                "cpu_s": end[0] - before[0], "wall_s": end[1] - before[1],
                "outside_stages_cpu_s": end[0] - before[0] - stage_cpu,
                "outside_stages_wall_s": end[1] - before[1] - sum(v["wall_s"] for v in mine.values()),
                "report_line_cpu_s": marks.report_line.get(iteration, {}).get("cpu_s"),
                "compaction_cpu_s": compaction[iteration]["cpu_s"] if iteration in compaction else None})
            before = end
    return rows


def plot(path: Path, rows: list[dict[str, Any]], chunks: list[dict[str, Any]], compactions: list[dict[str, Any]],
         title: str) -> None:
    figure = Figure(figsize=(9, 11))
    top, middle, bottom = figure.subplots(3, 1, sharex=True)
    n = [r["n"] for r in rows]
    for stage in STAGES:
        top.plot(n, [r["stages"][stage]["cpu_s"] for r in rows], linewidth=1, label=stage)
    top.plot(n, [r["outside_stages_cpu_s"] for r in rows], linewidth=1, color="gray", label="outside the stages")
    top.plot(n, [r["cpu_s"] for r in rows], linewidth=1.8, color="black", label="the whole iteration")
    line = fit([r["n"] for r in rows[1:]], [r["cpu_s"] for r in rows[1:]])
    if line["slope"] is not None and line["change_share"] is not None:
        top.plot(n[1:], [line["mean"] + line["slope"] * (x - statistics.mean(n[1:])) for x in n[1:]], color="black",
                 linestyle="--", linewidth=1, label=f"least squares ({line['change_share']:+.1%} over the run)")
    top.set_ylabel("CPU seconds per iteration")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.legend(fontsize=8, ncol=4, loc="upper center")
    ends = [c["iterations"][-1] + 1 for c in chunks]
    colors = matplotlib.colormaps["tab20"].colors
    for i, name in enumerate(chunks[0]["reads"]):
        middle.plot(ends, [1000 * c["reads"][name]["cpu_s"] for c in chunks], marker=".", linewidth=1, label=name,
                    color=colors[i % len(colors)], linestyle="-" if name.startswith("report.") else "--")
    middle.set_yscale("log")
    middle.set_ylabel("read's CPU milliseconds (median of 3)")
    middle.grid(alpha=0.3, which="both")
    middle.legend(fontsize=6, ncol=3, loc="upper left")
    bottom.plot(ends, [c["store"]["files"] for c in chunks], marker="o", label="files on disk")
    if compactions:
        bottom.plot([c["iteration"] + 1 for c in compactions], [c["before"]["files"] for c in compactions],
                    marker="x", linestyle="none", color="tab:blue", label="files on disk before a compaction")
    bottom.plot(ends, [c["store"]["live_files"] for c in chunks], marker=".", label="files the snapshot references")
    bottom.plot(ends, [c["store"]["snapshots"] for c in chunks], marker=".", linestyle=":", label="catalog snapshots")
    bottom.set_ylabel("files, snapshots")
    bottom.set_xlabel("iteration")
    bottom.grid(alpha=0.3)
    size = bottom.twinx()
    size.plot(ends, [c["store"]["mb"] for c in chunks], color="tab:red", marker="s", label="store MB (data + catalog)")
    size.set_ylabel("MB")
    lines = bottom.get_legend_handles_labels()
    more = size.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200, help="iterations to run (default 200)")
    parser.add_argument("--chunk", type=int, default=10, help="iterations per flow run, and per measurement of the "
                        "store and the reads (default 10)")
    parser.add_argument("--save", default="cpu", help="results name: benchmarks/results/growth_<save>.json/.png")
    parser.add_argument("--workdir", type=Path, help="keep the campaign here (default: a temporary folder, removed); "
                        "a folder holding one already goes on with it")
    parser.add_argument("--compact-every", type=int, default=None, help="compact the store every N iterations "
                        f"(default: the product's, {campaign_module.COMPACT_EVERY}; 0: never)")
    parser.add_argument("--keep-seconds", type=float, default=None, help="snapshots younger than this survive a "
                        f"compaction (default: the product's, {campaign_module.COMPACT_KEEP_SECONDS:g})")
    parser.add_argument("--name", default="growth", help="campaign name (default growth)")
    args = parser.parse_args()
    if args.iterations < 1 or args.chunk < 1:
        parser.error("--iterations and --chunk must be at least 1")

    root = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="evertrain-growth-"))
    root.mkdir(parents=True, exist_ok=True)
    config = campaign_config(root, args.name)
    compact_every = campaign_module.COMPACT_EVERY if args.compact_every is None else args.compact_every
    saved_constant = campaign_module.COMPACT_EVERY
    campaign_module.COMPACT_EVERY = compact_every or NEVER
    saved_keep = campaign_module.COMPACT_KEEP_SECONDS
    if args.keep_seconds is not None:
        campaign_module.COMPACT_KEEP_SECONDS = args.keep_seconds
    chunks: list[dict[str, Any]] = []
    try:
        # Prefect's database in the scratch folder, not the user's PREFECT_HOME
        with temporary_settings(updates={PREFECT_HOME: str(root / "prefect")}):
            quiet_prefect_console()
            server = start_temporary_server()
            try:
                with Runtime.open(config) as rt:
                    _ = rt.base_model
                    marks = Marks(campaign_module._report_iteration, rt.store.compact)
                    report_line = campaign_module._report_iteration
                    campaign_module._report_iteration = marks.report
                    rt.store.compact = marks.compact  # type: ignore[method-assign]  # this context's store only
                    try:
                        done = 0
                        while done < args.iterations:
                            size = min(args.chunk, args.iterations - done)
                            server0 = server_cpu(server)
                            start = (cpu_seconds(), time.perf_counter())
                            finished = campaign_module.run_campaign_flow(rt, size)
                            end = (cpu_seconds(), time.perf_counter())
                            server1 = server_cpu(server)
                            chunk: dict[str, Any] = {
                                "iterations": finished, "start": start, "cpu_s": end[0] - start[0],
                                "wall_s": end[1] - start[1],
                                "prefect_server_cpu_s": None if server0 is None or server1 is None
                                else server1 - server0,
                                # the flow run's end after the last iteration's (Prefect closing its run)
                                "tail_cpu_s": end[0] - marks.ends[finished[-1]][0],
                                "store": store_state(rt.store),
                                "other_bytes": {"mlflow_db": database_bytes(root / "mlflow" / "mlflow.db"),
                                                "prefect_db": database_bytes(root / "prefect" / "prefect.db"),
                                                "checkpoints": folder_bytes(root / "checkpoints")},
                                "reads": time_reads(rt, finished[-1]),
                            }
                            chunks.append(chunk)
                            done += len(finished)
                            print(f"iterations {finished[0] + 1}-{finished[-1] + 1}: "
                                  f"{chunk['cpu_s'] / len(finished):.1f} CPU-s and "
                                  f"{chunk['wall_s'] / len(finished):.1f} s per iteration; store "
                                  f"{chunk['store']['files']} files, {chunk['store']['mb']:.1f} MB; report "
                                  f"{1000 * chunk['reads']['report.all']['cpu_s']:.0f} CPU-ms", flush=True)
                    finally:
                        campaign_module._report_iteration = report_line
                    rows = per_iteration(rt, marks, chunks)
                    compactions = marks.compactions
            finally:
                stop_temporary_server()
    finally:
        campaign_module.COMPACT_EVERY = saved_constant
        keep_seconds = campaign_module.COMPACT_KEEP_SECONDS
        campaign_module.COMPACT_KEEP_SECONDS = saved_keep
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)

    report(args, config, compact_every, keep_seconds, rows, chunks, compactions, root)


def report(args: argparse.Namespace, config: CampaignConfig, compact_every: int, keep_seconds: float,
           rows: list[dict[str, Any]], chunks: list[dict[str, Any]], compactions: list[dict[str, Any]],
           root: Path) -> None:
    """Print the tables, save the JSON and the plot."""
    table = []
    for chunk in chunks:
        mine = [r for r in rows if r["iteration"] in set(chunk["iterations"])]
        line: dict[str, Any] = {"iterations": f"{mine[0]['n']}-{mine[-1]['n']}"}
        for stage in STAGES:
            line[stage] = statistics.mean(r["stages"][stage]["cpu_s"] for r in mine)
        line["stages"] = statistics.mean(r["stages_cpu_s"] for r in mine)
        line["outside"] = statistics.mean(r["outside_stages_cpu_s"] for r in mine)
        line["cpu_s"] = statistics.mean(r["cpu_s"] for r in mine)
        line["wall_s"] = statistics.mean(r["wall_s"] for r in mine)
        line["server_cpu"] = (chunk["prefect_server_cpu_s"] or 0) / len(mine)
        line["files"] = chunk["store"]["files"]
        # the most files on disk during the chunk: before its compactions (they run every few iterations), or now
        line["peak"] = max([chunk["store"]["files"], *(c["before"]["files"] for c in compactions
                                                       if c["iteration"] in set(chunk["iterations"]))])
        line["live"] = chunk["store"]["live_files"]
        line["MB"] = chunk["store"]["mb"]
        line["report_ms"] = 1000 * chunk["reads"]["report.all"]["cpu_s"]
        table.append(line)
    print("\nCPU seconds per iteration (mean over each chunk), by stage; outside: the rest of the iteration "
          "(Prefect, MLflow, bookkeeping, the report line, compaction); server_cpu: Prefect's server process; the "
          "store after the chunk: files on disk (peak: the most during the chunk, before a compaction), live: the "
          "files its snapshot references, MB; report_ms: `evertrain report`'s queries, CPU-ms")
    print_table(table, ["iterations", *STAGES, "stages", "outside", "cpu_s", "wall_s", "server_cpu", "files", "peak",
                        "live", "MB", "report_ms"])

    fitted = [r for r in rows if r["iteration"] > rows[0]["iteration"]]  # after the first (one-time costs)
    x = [r["n"] for r in fitted]
    fits = {stage: fit(x, [r["stages"][stage]["cpu_s"] for r in fitted]) for stage in STAGES}
    fits["stages"] = fit(x, [r["stages_cpu_s"] for r in fitted])
    fits["outside_stages"] = fit(x, [r["outside_stages_cpu_s"] for r in fitted])
    fits["iteration"] = fit(x, [r["cpu_s"] for r in fitted])
    read_x = [c["iterations"][-1] + 1 for c in chunks]
    read_fits = {name: fit(read_x, [c["reads"][name]["cpu_s"] for c in chunks]) for name in chunks[0]["reads"]}

    def fit_row(name: str, f: dict[str, Any], scale: float = 1.0) -> dict[str, Any]:
        def show(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(0.0 if abs(value) < 1e-12 else value, fmt)
        return {"series": name, "n": f["n"], "mean": show(f["mean"] * scale if f["mean"] is not None else None, ".4g"),
                "slope/iter": show(f["slope"] * scale if f["slope"] is not None else None, ".3g"),
                "se": show(f["slope_se"] * scale if f["slope_se"] is not None else None, ".3g"),
                "t": show(f["t"], ".2f"), "change over run": show(f["change_share"], "+.1%")}

    print(f"\nLeast squares against the iteration number, iterations {x[0] if x else '-'}-{x[-1] if x else '-'} "
          "(CPU seconds per iteration; change over run: slope × span / mean)")
    print_table([fit_row(k, v) for k, v in fits.items()], ["series", "n", "mean", "slope/iter", "se", "t",
                                                            "change over run"])
    print("\nReads after each chunk, CPU milliseconds (median of 3), against the iteration they ran after")
    print_table([fit_row(k, v, 1000) for k, v in read_fits.items()], ["series", "n", "mean", "slope/iter", "se", "t",
                                                                        "change over run"])
    if compactions:
        print("\ncompactions: " + ", ".join(f"after {c['iteration'] + 1}: {c['cpu_s']:.2f} CPU-s, files "
                                            f"{c['before']['files']}->{c['after']['files']}" for c in compactions))

    settings = {"config": "configs/smoke.toml", "campaign": config.name, "torch_threads": config.torch_threads,
                "problems_per_iteration": config.problems_per_iteration, "group_size": config.group_size,
                "environments": [s.name for s in config.environments],
                "max_new_tokens": config.generation.max_new_tokens,
                "eval_problems_per_env": config.eval.problems_per_env,
                "eval_every": config.eval.every, "compact_every": compact_every or None,
                "compact_keep_seconds": keep_seconds,
                "read_repeats": READ_REPEATS,
                "path": "flows.deploy.start_temporary_server, Runtime.open, then "
                        "flows.campaign.run_campaign_flow per chunk",
                "workdir": str(root) if args.workdir else None}
    for chunk in chunks:
        chunk["start"] = {"cpu_s": chunk["start"][0], "wall_s": chunk["start"][1]}
    name = f"growth_{args.save}"
    path = save(name, {"settings": settings, "iterations": rows, "chunks": chunks, "compactions": compactions,
                       "table": table, "fits": fits, "read_fits": read_fits,
                       "fit_note": "iterations after the first; reads: every chunk"})
    plot(RESULTS / f"{name}.png", rows, chunks, compactions,
         f"{config.name}: {len(rows)} iterations of configs/smoke.toml (tiny model, 1 torch thread), "
         f"compaction every {compact_every or 'never'}, keeping {keep_seconds:g} s of snapshots")
    print(f"\nsaved {path.relative_to(ROOT)} and {name}.png")


if __name__ == "__main__":
    main()
