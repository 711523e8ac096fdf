"""Rollouts, grading and evaluation on a real local Ray cluster (two worker actors), against one process.

One Ray cluster (2 CPUs) serves the whole module: a two-iteration campaign through the Prefect flow on
the tiny model must write the same problems and rollouts as the same campaign with ``cluster = none``,
and the same rewards; a worker killed mid-rollout must be replaced and its groups redone exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from evertrain.config import CampaignConfig
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in

# Two worker actors of half a CPU each and half a CPU for grading tasks: the whole cluster is 2 CPUs.
RAY = {"address": "local", "workers": 2, "cpus_per_worker": 0.5, "grade_cpus": 0.5, "num_cpus": 2}


def configure(directory: Path, models_dir: Path, cluster: dict[str, object] | None) -> CampaignConfig:
    config = smoke_config_in(directory, models_dir)
    data = config.model_dump()
    data["torch_threads"] = 1  # workers run one thread each: the same float sums in both runs
    data["generation"]["batch_size"] = 8  # 2 problems per shard: several shards per environment
    data["cluster"] = cluster or {"address": "none"}
    data["eval"]["zero_recheck"] = 1  # evaluate every environment every iteration (the tiny model scores 0)
    return CampaignConfig.model_validate(data)


def rows(config: CampaignConfig, sql: str) -> pd.DataFrame:
    from evertrain.data.store import Store

    with Store(config.paths.store, read_only=True) as store:  # a reader: beside a context that holds the campaign
        return store.query(sql, [config.name]).reset_index(drop=True)


PROBLEMS = "SELECT iteration, problem_id, env, prompt, payload FROM problems WHERE campaign = ? ORDER BY ALL"
ROLLOUTS = """SELECT iteration, problem_id, sample, policy_version, completion, completion_ids, logprobs,
              finish_reason, reward, passed, reason FROM rollouts WHERE campaign = ?
              ORDER BY iteration, problem_id, sample"""


def stage_metrics(config: CampaignConfig, stage: str) -> list[dict[str, float]]:
    frame = rows(config, f"SELECT metrics FROM stage_runs WHERE campaign = ? AND stage = '{stage}' ORDER BY iteration")
    return [json.loads(m) for m in frame["metrics"]]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, models_dir):
    """The reference: the same two iterations in the flow's process (cluster = none)."""
    config = configure(tmp_path_factory.mktemp("none"), models_dir, None)
    from evertrain.runtime import Runtime

    with Runtime.open(config) as rt:
        for iteration in (0, 1):
            for stage in STAGES:
                run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
    return config


@pytest.fixture(scope="module")
def ray_cluster():
    from evertrain.inference.ray_workers import disconnect_ray

    yield
    disconnect_ray()


@pytest.fixture(scope="module")
def on_ray(tmp_path_factory, models_dir, prefect_server, ray_cluster):
    """The campaign on Ray, in a context opened here (campaign_flow's own body, run_campaign), so the test can
    look at the cluster the context owns before it is closed; then closed, as campaign_flow closes it."""
    import ray

    from evertrain.flows.campaign import run_campaign
    from evertrain.runtime import Runtime

    config = configure(tmp_path_factory.mktemp("ray"), models_dir, RAY)
    with Runtime.open(config) as rt:
        assert run_campaign(rt, 2) == [0, 1]
        cluster = rt.inference.pool
        assert cluster is not None and ray.is_initialized()
        pids = set(ray.get([worker.pid.remote() for worker in cluster.workers]))
        workers = list(cluster.workers)
    return config, cluster, pids, workers


def test_campaign_on_ray_equals_one_process(single_process, on_ray):
    on_ray, cluster, pids, _ = on_ray
    # Ray really ran it: two worker processes, not this one, sampled several shards each iteration
    assert len(pids) == 2 and __import__("os").getpid() not in pids
    for m in stage_metrics(on_ray, "rollout"):
        assert m["cluster_shards"] >= 4 and m["cluster_workers_used"] == 2
    # the checkpoint went through the object store (iteration 1's trainee was already sent for evaluation)
    assert stage_metrics(on_ray, "rollout")[0]["cluster_handoff_bytes"] > 0
    # evaluation's greedy answers fanned out over both workers too
    assert any(stage == "evaluate" and fan.workers_used == 2 for stage, fan in cluster.history)
    assert stage_metrics(on_ray, "rollout")[1]["policy_version"] != stage_metrics(on_ray, "rollout")[0][
        "policy_version"], "iteration 1 should sample from the updated (LoRA) version"
    # grading ran in Ray tasks, in worker processes
    assert all(m["cluster_grade_tasks"] >= 2 and m["cluster_grade_processes"] >= 1
               for m in stage_metrics(on_ray, "score"))

    # the seeded stages write the same rows, and the rewards agree
    pd.testing.assert_frame_equal(rows(on_ray, PROBLEMS), rows(single_process, PROBLEMS))
    ours, reference = rows(on_ray, ROLLOUTS), rows(single_process, ROLLOUTS)
    assert len(ours) == 2 * on_ray.problems_per_iteration * on_ray.group_size
    pd.testing.assert_frame_equal(ours, reference)
    # greedy evaluation fanned out too and gave the same answers
    evals = """SELECT iteration, model_version, problem_id, sample, completion, reward FROM evals
               WHERE campaign = ? ORDER BY ALL"""
    pd.testing.assert_frame_equal(rows(on_ray, evals), rows(single_process, evals))
    assert [m["mean_reward"] for m in stage_metrics(on_ray, "score")] == \
        [m["mean_reward"] for m in stage_metrics(single_process, "score")]


def test_closing_the_context_stops_its_workers(on_ray):
    import ray

    _, cluster, _, workers = on_ray
    assert not cluster.workers  # the context shut its cluster down when it closed
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].pid.remote(), timeout=60)


def test_killed_worker_is_replaced_and_its_groups_redone_once(single_process, tmp_path, models_dir, ray_cluster,
                                                             monkeypatch):
    from evertrain.runtime import Runtime

    config = configure(tmp_path, models_dir, RAY)
    rt = Runtime.open(config)
    before = {id(worker) for worker in rt.inference.pool.workers}
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    # the worker that receives shard 1 SIGKILLs itself with the shard sampled but not handed back
    monkeypatch.setenv("EVERTRAIN_KILL_WORKER_AT", "rollout:1")
    metrics = run_stage(rt, "rollout", 0, STAGE_FUNCTIONS["rollout"])
    assert metrics["cluster_workers_replaced"] == 1
    after = {id(worker) for worker in rt.inference.pool.workers}
    assert len(after - before) == 1, "exactly one worker should have been replaced"
    counts = rows(config, "SELECT problem_id, sample, count(*) AS n FROM rollouts WHERE campaign = ? GROUP BY ALL")
    assert (counts["n"] == 1).all(), "a group was written twice"
    assert len(counts) == config.problems_per_iteration * config.group_size
    # and the redone groups are the very ones one process samples
    iteration0 = ROLLOUTS.replace("WHERE campaign = ?", "WHERE campaign = ? AND iteration = 0")
    unscored = [c for c in rows(config, iteration0).columns if c not in ("reward", "passed", "reason")]
    pd.testing.assert_frame_equal(rows(config, iteration0)[unscored], rows(single_process, iteration0)[unscored])
    rt.close()


def test_groups_are_seeded_by_problem_not_by_place_in_the_batch(models_dir):
    """What lets shards equal one process's batches: a group's draws come from its own generator."""
    from evertrain.inference.local import sample
    from evertrain.models.checkpoint import load_policy, write_base_checkpoint

    checkpoint = write_base_checkpoint(models_dir / "seeding-base", str(models_dir / "tiny-llama"))
    model, tokenizer = load_policy(checkpoint)
    a, b = tokenizer("2 + 2 =")["input_ids"], tokenizer("3 + 5 =")["input_ids"]

    def draw(prompts: list[list[int]], seeds: list[int] | None) -> list[list[list[int]]]:
        groups, _ = sample(model, tokenizer, prompts, 3, max_new_tokens=8, seeds=seeds)
        return [[s.completion_ids for s in group] for group in groups]

    forward, backward = draw([a, b], [11, 22]), draw([b, a], [22, 11])
    assert forward == backward[::-1]  # the same groups whichever order the batch holds them in
    assert draw([a, b], [11, 23])[0] == forward[0] and draw([a, b], [11, 23])[1] != forward[1]
    # one generator for the whole call: a group's draws depend on its place
    assert draw([a, b], None) != draw([b, a], None)[::-1]


def test_a_pool_that_leaves_no_cpu_for_grading_is_refused(on_ray, tmp_path, models_dir):
    from evertrain.inference.base import ClusterError
    from evertrain.inference.ray_workers import WorkerPool

    greedy = configure(tmp_path, models_dir, {**RAY, "workers": 4})  # 4 x 0.5 CPUs + 0.5: more than the 2 there are
    with pytest.raises(ClusterError, match=r"offers 2 CPUs.*need 2\.5"):
        WorkerPool(greedy).start()


def test_a_local_cluster_is_started_even_where_another_cluster_is_advertised(tmp_path, models_dir, monkeypatch,
                                                                             ray_cluster):
    """``cluster.address = "local"`` starts this process's own cluster of ``num_cpus`` even where RAY_ADDRESS (or
    the cluster file ``ray start`` leaves on the machine, as the two-node test does) points at another one: a
    plain ``ray.init()`` would join that one and then refuse ``num_cpus`` (the CI failure of stop 41)."""
    import ray

    from evertrain.inference.ray_workers import connect_ray, disconnect_ray

    disconnect_ray()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there
    connect_ray(configure(tmp_path, models_dir, RAY))
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == RAY["num_cpus"]
    disconnect_ray()
