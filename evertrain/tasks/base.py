"""What every stage shares: timing, the ``stage_runs`` record, MLflow metrics and progress bars."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from evertrain.data.store import now
from evertrain.runtime import Runtime

STAGES = ("curate", "rollout", "score", "update", "evaluate", "promote")

StageFunction = Callable[[Runtime, int], dict[str, Any]]


def progress(total: int, desc: str, unit: str = "it") -> Any:
    """A progress bar on stderr (off when EVERTRAIN_PROGRESS=0)."""
    from tqdm.auto import tqdm

    disable = os.environ.get("EVERTRAIN_PROGRESS", "1") == "0"
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True)


def current_flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return flow_run.id
    except Exception:
        return None


def run_stage(rt: Runtime, stage: str, iteration: int, function: StageFunction) -> dict[str, Any]:
    """Run one stage for ``iteration``: record it in ``stage_runs`` and log its metrics to MLflow."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    rt.ensure_started()
    rt.store.replace("campaigns", {"campaign": rt.campaign}, [{
        "campaign": rt.campaign, "config": rt.config.model_dump_json(), "updated_at": now()}])
    flow_run_id = current_flow_run_id()
    run_id, previous_status = rt.tracker.iteration_run(iteration, flow_run_id)
    started = now()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rt.store.record_stage(rt.campaign, iteration, stage, "running", started_at=started, flow_run_id=flow_run_id)
    try:
        metrics = function(rt, iteration)
    except BaseException as error:
        rt.store.record_stage(
            rt.campaign, iteration, stage, "failed", started_at=started,
            wall_s=time.perf_counter() - wall0, cpu_s=time.process_time() - cpu0, flow_run_id=flow_run_id,
            error="".join(traceback.format_exception_only(error)).strip()[:2000],
        )
        rt.tracker.finish_run(run_id, "FAILED")
        raise
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    metrics = {**metrics, "wall_s": wall, "cpu_s": cpu}
    rt.store.record_stage(rt.campaign, iteration, stage, "completed", started_at=started, wall_s=wall,
                          cpu_s=cpu, metrics=metrics, flow_run_id=flow_run_id)
    rt.tracker.log_metrics(run_id, {f"{stage}/{key}": value for key, value in metrics.items()}, step=iteration)
    if stage == STAGES[-1] or previous_status == "FINISHED":
        rt.tracker.finish_run(run_id)
    return metrics


def allocate(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` by ``weights`` (largest remainder), every share as fair as integers allow."""
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts
