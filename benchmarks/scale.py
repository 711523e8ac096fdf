"""Rollout + score throughput on a Ray cluster with 1, 2 and 4 workers, against one process (cluster = none).

The workload goes through the very calls the rollout and score stages make
(:meth:`evertrain.inference.campaign.Inference.sample_groups`, :class:`evertrain.cluster.Graders`):
SmolLM2-135M-Instruct with a fresh LoRA adapter (rank 16, all linear layers) as the policy, ``--problems``
arithmetic problems, G = ``--group`` completions each, ``--tokens`` new tokens, ``generation.batch_size = --batch`` (so
``batch // G`` problems per shard). Each worker reserves 1 CPU (one torch thread); the local cluster
offers workers + 1 logical CPUs (the extra one for grading tasks), whatever the machine has: on a
2-core machine 4 workers oversubscribe the cores, which is the point of measuring it.

Measured per configuration: a warm-up call (workers start and load the adapter: the hand-off through
the object store), then the timed call: completions per second (rollout + score) and its parts. Also:
the LoRA hand-off (bytes, pack + put seconds, a worker's load seconds) and the driver's write rate (the
rollout rows and their scores written to a DuckDB store in one transaction each, as the stages do),
which bounds the cluster's throughput however many workers it has.

    .venv/bin/python benchmarks/scale.py [--problems 16] [--group 8] [--tokens 24] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import print_table, save  # noqa: E402


def campaign(directory: Path, args: argparse.Namespace, cluster: dict[str, Any]) -> Any:
    from evertrain.config import CampaignConfig

    return CampaignConfig.model_validate({
        "name": "scale", "seed": 0, "group_size": args.group, "torch_threads": 1,
        "problems_per_iteration": args.problems,
        "model": {"path": "embedded:smollm2-135m-instruct", "models_dir": str(ROOT / "state" / "models")},
        "environments": [{"name": "arithmetic", "weight": 1}],
        "generation": {"max_new_tokens": args.tokens, "temperature": 1.0, "batch_size": args.batch},
        "paths": {"store": str(directory / "store.duckdb"), "checkpoints": str(directory / "checkpoints"),
                  "mlflow_uri": f"sqlite:///{directory / 'mlflow.db'}", "artifacts": str(directory / "artifacts")},
        "cluster": cluster,
    })


def lora_checkpoint(directory: Path, base: str) -> Path:
    """A LoRA version as the update writes it (fresh adapter, B nudged off zero so it changes the policy)."""
    import torch

    from evertrain.config import LoraConfig
    from evertrain.models.checkpoint import load_policy, save_checkpoint, write_base_checkpoint

    base_dir = write_base_checkpoint(directory / "base", base)
    model, _ = load_policy(base_dir, trainable=True, lora=LoraConfig(), finetune="lora", device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1e-3)
    return save_checkpoint(model, directory / "lora", base)


def workload(config: Any, tokenizer: Any) -> tuple[list[Any], list[Any]]:
    from evertrain.envs import registry
    from evertrain.inference.base import SampleJob
    from evertrain.models.checkpoint import encode_chat
    from evertrain.runtime import seed_for

    env = registry.get("arithmetic")
    problems = env.problems("train", config.problems_per_iteration, 7)
    prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
    seeds = [seed_for(config.seed, 0, "rollout", p.id) for p in problems]
    return problems, [SampleJob("arithmetic", problems, prompts, config.generation.max_new_tokens, seeds=seeds)]


def run_once(config: Any, checkpoint: Path, jobs: list[Any], envs: Any, inference: Any,
             graders: Any = None) -> dict[str, Any]:
    """Rollout + score of ``jobs`` through the stages' own calls (the campaign's inference, its graders); seconds of
    each part."""
    from evertrain.scoring import verify_many

    began, cpu0 = time.perf_counter(), sum(os.times()[:4])
    if inference.pool is None:  # the flow's process holds the model; on a cluster the workers do
        inference.sampler(checkpoint)
    load_cpu = sum(os.times()[:4]) - cpu0
    loaded = time.perf_counter()
    outputs, fanout = inference.sample_groups(checkpoint, 2, jobs, config.group_size)
    sampled = time.perf_counter()
    items = [("arithmetic", p, e.text) for job, (groups, _) in zip(jobs, outputs, strict=True)
             for p, group in zip(job.problems, groups, strict=True) for e in group]
    if graders is None:
        verdicts, grading = verify_many([(envs(env), p, text) for env, p, text in items]), {}
    else:
        verdicts = graders.verify_many(items)
        grading = dict(graders.last)
    done = time.perf_counter()
    # CPU seconds of the work itself (this process minus its model load, plus the Ray workers'): unlike wall
    # time, not inflated by other jobs on a shared machine
    work_cpu = sum(os.times()[:4]) - cpu0 - load_cpu + fanout.get("cluster_worker_cpu_s", 0.0) \
        + grading.get("cluster_grade_cpu_s", 0.0)
    tokens = sum(stats.completion_tokens for _, stats in outputs)
    return {"seconds": done - began, "work_cpu_s": work_cpu,
            "load_s": loaded - began, "sample_s": sampled - loaded, "score_s": done - sampled,
            "completions": len(items), "completion_tokens": tokens, "mean_reward": sum(v.reward for v in verdicts)
            / len(verdicts), "outputs": outputs, "verdicts": verdicts, **fanout, **grading}


def driver_write_rate(directory: Path, config: Any, jobs: list[Any], outputs: list[Any], verdicts: list[Any],
                      tokenizer: Any) -> dict[str, float]:
    """Rows per second the flow's process writes: rollout rows in one transaction, then their scores."""
    import pandas as pd

    from evertrain.data.store import Store, now, to_json

    store = Store(directory / "writes.duckdb")  # closed once measured
    rows, scores = [], []
    stamp = now()
    for job, (groups, _) in zip(jobs, outputs, strict=True):
        for problem, prompt_ids, group in zip(job.problems, job.prompts, groups, strict=True):
            for index, e in enumerate(group):
                rows.append({
                    "campaign": "scale", "iteration": 0, "problem_id": problem.id, "sample": index,
                    "env": problem.env, "policy_version": 2, "prompt_text": tokenizer.decode(prompt_ids),
                    "completion": e.text, "prompt_ids": prompt_ids, "completion_ids": e.completion_ids,
                    "logprobs": e.logprobs, "loss_mask": e.loss_mask, "turns": to_json(e.turns),
                    "finish_reason": e.finish_reason, "prompt_tokens": len(prompt_ids),
                    "completion_tokens": sum(e.loss_mask), "tool_calls": 0, "tool_errors": 0, "rework": 0,
                    "generated_at": stamp})
    for row, v in zip(rows, verdicts, strict=True):
        scores.append({"problem_id": row["problem_id"], "sample": row["sample"], "reward": v.reward,
                       "passed": v.passed, "reason": v.reason, "detail": to_json(v.detail), "scored_at": stamp})
    timings = []
    for _ in range(3):
        began = time.perf_counter()
        store.replace("rollouts", {"campaign": "scale", "iteration": 0}, pd.DataFrame(rows))
        written = time.perf_counter()
        store.update_rollout_scores("scale", 0, pd.DataFrame(scores))
        timings.append((written - began, time.perf_counter() - written))
    store.close()
    write_s = min(t[0] for t in timings)
    score_s = min(t[1] for t in timings)
    return {"rows": len(rows), "rollout_write_s": write_s, "score_write_s": score_s,
            "rows_per_s": len(rows) / (write_s + score_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    os.environ.setdefault("EVERTRAIN_PROGRESS", "0")
    from evertrain.cluster import open_graders
    from evertrain.inference.campaign import Inference
    from evertrain.inference.ray_workers import disconnect_ray
    from evertrain.models.checkpoint import resolve_base
    from evertrain.models.precision import set_threads
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    directory = Path(tempfile.mkdtemp(prefix="evertrain-scale-"))
    reference = campaign(directory, args, {"address": "none"})
    set_threads(1)  # the one-process reference uses one thread, as each worker does
    base = resolve_base(reference.model)
    checkpoint = lora_checkpoint(directory, base)
    from evertrain.envs import registry

    envs_cache: dict[str, Any] = {}

    def envs(name: str) -> Any:
        return envs_cache.setdefault(name, registry.get(name))

    from evertrain.models.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(base)
    _, jobs = workload(reference, tokenizer)
    rows: list[dict[str, Any]] = []

    print("cluster = none (one process, 1 torch thread) ...", flush=True)
    none = run_once(reference, checkpoint, jobs, envs, Inference(reference, envs))
    rows.append({"cluster": "none", "workers": 0, **{k: v for k, v in none.items()
                                                     if k not in ("outputs", "verdicts")}})
    writes = driver_write_rate(directory, reference, jobs, none["outputs"], none["verdicts"], tokenizer)
    handoff: dict[str, Any] = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        cluster = {"address": "local", "workers": workers, "cpus_per_worker": 1, "grade_cpus": 1,
                   "num_cpus": workers + 1}
        config = campaign(directory, args, cluster)
        print(f"Ray, {workers} worker(s) ...", flush=True)
        began = time.perf_counter()
        inference = Inference(config, envs)
        assert inference.pool is not None  # the workers started
        graders = open_graders(config)
        started = time.perf_counter() - began
        # workers load the adapter: the object-store hand-off
        warm = run_once(config, checkpoint, jobs, envs, inference, graders)
        if workers == 1:
            handoff = {"kind": "lora", "via": "ray object store", "bytes": warm["cluster_handoff_bytes"],
                       "pack_put_s": warm["cluster_handoff_put_s"], "worker_load_s": warm["cluster_load_s"]}
        timed = run_once(config, checkpoint, jobs, envs, inference, graders)
        same = all(a.completion_ids == b.completion_ids for (ga, _), (gb, _) in zip(
            timed["outputs"], none["outputs"], strict=True) for x, y in zip(ga, gb, strict=True)
            for a, b in zip(x, y, strict=True))
        rows.append({"cluster": "local", "workers": workers, "ray_start_s": started, "warmup_s": warm["seconds"],
                     "same_completions_as_none": same,
                     **{k: v for k, v in timed.items() if k not in ("outputs", "verdicts")}})
        inference.close()
        disconnect_ray()  # each pool size on a Ray of its own size (num_cpus)
    for row in rows:
        row["completions_per_s"] = row["completions"] / row["seconds"]
        row["tokens_per_s"] = row["completion_tokens"] / row["sample_s"]
    one = next(r for r in rows if r["workers"] == 1)
    overhead = one["seconds"] / rows[0]["seconds"] - 1
    cpu_overhead = one["work_cpu_s"] / rows[0]["work_cpu_s"] - 1
    columns = ["cluster", "workers", "seconds", "sample_s", "score_s", "work_cpu_s", "completions_per_s",
               "tokens_per_s", "same_completions_as_none"]
    print_table(rows, columns)
    print(f"Ray overhead at one worker vs cluster = none: {overhead:+.1%} of the rollout+score wall time, "
          f"{cpu_overhead:+.1%} of its CPU seconds")
    print("LoRA hand-off:", json.dumps(handoff))
    print("driver writes:", json.dumps(writes))
    path = save("scale", {
        "workload": {"model": "SmolLM2-135M-Instruct + LoRA r16", "problems": args.problems, "group": args.group,
                     "max_new_tokens": args.tokens, "batch_size": args.batch,
                     "shards": -(-args.problems // max(1, args.batch // args.group))},
        "rows": rows, "ray_overhead_one_worker": overhead, "ray_cpu_overhead_one_worker": cpu_overhead,
        "load_average_at_end": os.getloadavg(), "lora_handoff": handoff, "driver_writes": writes,
        "note": "measured on a 2-core machine shared with other jobs; each worker reserves 1 CPU and runs 1 "
                "torch thread; 4 workers oversubscribe the 2 cores"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
