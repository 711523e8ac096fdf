"""What every stage shares: timing, the ``stage_runs`` record, MLflow metrics and progress bars."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from prefect.runtime import flow_run

from evertrain import faults, interrupts
from evertrain.data.lineage import diversity_metrics, sample_rollouts
from evertrain.data.store import now
from evertrain.inference.base import sync_seconds
from evertrain.models.precision import resolve_device
from evertrain.retention import apply_retention
from evertrain.runtime import Runtime

STAGES = ("curate", "rollout", "score", "update", "evaluate", "promote")
OPTIONAL_STAGES = ("sft",)  # run only when configured (sft.enabled), between score and update

StageFunction = Callable[[Runtime, int], dict[str, Any]]


def current_flow_run_id() -> str | None:
    try:
        return flow_run.id
    except Exception:
        return None


def run_stage(rt: Runtime, stage: str, iteration: int, function: StageFunction) -> dict[str, Any]:
    """Run one stage for ``iteration``: record it in ``stage_runs`` and log its metrics to MLflow."""
    if stage not in STAGES and stage not in OPTIONAL_STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES + OPTIONAL_STAGES)}")
    interrupts.check()  # a stop signal whose KeyboardInterrupt was swallowed stops the run here
    rt.ensure_started()
    config = rt.config.model_dump_json()
    if rt.recorded_config != config:  # once per context, not a write per stage
        rt.store.replace("campaigns", {"campaign": rt.campaign}, [{
            "campaign": rt.campaign, "config": config, "updated_at": now()}])
        rt.recorded_config = config
    flow_run_id = current_flow_run_id()
    run_id, previous_status = rt.tracker.iteration_run(iteration, flow_run_id)
    started = now()
    wall0, cpu0 = time.perf_counter(), cpu_seconds(rt.inference)
    sync0 = sync_seconds()  # weight hand-offs to samplers (loading a version, or giving it to the vLLM engine)
    rt.store.record_stage(rt.campaign, iteration, stage, "running", started_at=started, flow_run_id=flow_run_id)
    token = faults.current_stage.set(stage)
    try:
        faults.maybe_kill("start")
        metrics = function(rt, iteration)
        faults.maybe_kill("end")
    except BaseException as error:
        rt.inference.release()
        faults.current_stage.reset(token)
        rt.store.record_stage(
            rt.campaign, iteration, stage, "failed", started_at=started,
            wall_s=time.perf_counter() - wall0, cpu_s=cpu_seconds(rt.inference) - cpu0, flow_run_id=flow_run_id,
            error="".join(traceback.format_exception_only(error)).strip()[:2000],
        )
        rt.tracker.finish_run(run_id, "FAILED")
        raise
    rt.inference.release()  # the stage's sampler (its weights, for the in-house one) goes with the stage
    faults.current_stage.reset(token)
    wall, cpu = time.perf_counter() - wall0, cpu_seconds(rt.inference) - cpu0
    if stage == "score":  # how diverse the samples were, from the rollouts as stored (report and MLflow)
        metrics = {**metrics, **diversity_metrics(rt.store, rt.campaign, iteration)}
    metrics = {**metrics, "wall_s": wall, "cpu_s": cpu, "weight_sync_s": sync_seconds() - sync0,
               **stage_cost(rt, metrics, wall, cpu)}
    rt.store.record_stage(rt.campaign, iteration, stage, "completed", started_at=started, wall_s=wall,
                          cpu_s=cpu, metrics=metrics, flow_run_id=flow_run_id)
    rt.tracker.log_iteration_metrics(run_id, {f"{stage}/{key}": value for key, value in metrics.items()}, iteration)
    if stage == "score":  # trajectories where people look: a sample of the scored rollouts, as an MLflow table
        rt.tracker.log_rollouts(run_id, iteration, sample_rollouts(rt.store, rt.campaign, iteration))
    if stage == "promote":  # the aliases have moved: checkpoints no alias or recent challenger needs can go
        apply_retention(rt)
    if stage == STAGES[-1] or previous_status == "FINISHED":
        rt.tracker.finish_run(run_id)
    return metrics


def cpu_seconds(engines: Any = None) -> float:
    """CPU seconds of this process (every thread), of its finished children (sandboxed graders) and of the
    running vLLM engines of ``engines`` (a campaign's inference, or an ``evertrain.inference.vllm_sampler.Engines``: the
    sampling a stage waits on)."""
    t = os.times()
    engine_cpu = engines.cpu_seconds() if engines is not None else 0.0
    return t.user + t.system + t.children_user + t.children_system + engine_cpu


def stage_cost(rt: Runtime, metrics: dict[str, Any], wall: float, cpu: float) -> dict[str, float]:
    """GPU seconds, tokens computed and served from the prefix cache, and dollars, for one stage."""
    prices = rt.config.prices
    on_gpu = metrics.get("model_s", 0) or metrics.get("challenger_model_s", 0) or metrics.get("champion_model_s", 0)
    gpu = wall if on_gpu and resolve_device(rt.config.model.device).type == "cuda" else 0.0
    computed = sum(float(metrics.get(k, 0) or 0) for k in (
        "prompt_tokens", "completion_tokens", "trained_tokens", "challenger_completion_tokens",
        "champion_completion_tokens"))
    cached = float(metrics.get("cached_prompt_tokens", 0) or 0)
    dollars = (cpu / 3600 * prices.cpu_core_hour + gpu / 3600 * prices.gpu_hour
               + computed / 1e6 * prices.million_tokens + cached / 1e6 * prices.million_cached_tokens)
    return {"gpu_s": gpu, "tokens_computed": computed, "tokens_cached": cached, "dollars": dollars}


def allocate(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` by ``weights`` (largest remainder), every share as fair as integers allow; weight 0 gets 0."""
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [int(x) for x in exact]
    order = sorted((i for i, w in enumerate(weights) if w > 0), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts
