"""A real second Ray node: a stage samples and grades on the workers of two nodes, then loses one mid-stage.

The head is this process's own local Ray (as in tests/test_ray.py); the second node is a separate
``ray start --address <head>`` with resources of its own (1 CPU and a ``second_node`` resource), the way a
machine joins a cluster. Iteration 0's rollout and score run on workers of both nodes; then the rollout is rerun
and, once its first shard is back, every process of the second node (its raylet and the workers it started) is
SIGKILLed: the stage completes on the survivor, with the rows the first run wrote, none lost or written twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from evertrain.config import CampaignConfig
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in

# two workers of half a CPU, spread over the nodes, and half a CPU for each grading task: the head has 2 CPUs, so
# it can hold both workers and the grading once the second node is gone
RAY = {"address": "local", "workers": 2, "cpus_per_worker": 0.5, "grade_cpus": 0.5}
ROLLOUTS = """SELECT problem_id, sample, policy_version, completion, completion_ids, logprobs, finish_reason
              FROM rollouts WHERE campaign = ? AND iteration = 0 ORDER BY problem_id, sample"""


def rows(config: CampaignConfig, sql: str) -> pd.DataFrame:
    from evertrain.data.store import Store

    with Store(config.paths.store, read_only=True) as store:
        return store.query(sql, [config.name]).reset_index(drop=True)


@pytest.fixture(scope="module")
def two_nodes():
    """This process's Ray head (2 CPUs) and a second node joined with ``ray start --address`` (1 CPU); yields the
    second node's ``ray start`` process. Node failures are noticed within about two seconds (the health check)."""
    import ray

    from evertrain.inference.ray_workers import disconnect_ray

    disconnect_ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=100 * 2**20,
             _system_config={"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                             "health_check_failure_threshold": 4})
    head = ray.get_runtime_context().gcs_address
    log = Path(tempfile.mkdtemp(prefix="evertrain-ray-node-")) / "node.log"
    # its own session: the node's processes are found (and killed) as this process's descendants
    with log.open("wb") as out:
        node = subprocess.Popen(
            [str(Path(sys.executable).with_name("ray")), "start", "--address", head, "--num-cpus", "1",
             "--resources", '{"second_node": 1}', "--object-store-memory", str(100 * 2**20), "--block",
             "--disable-usage-stats"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    deadline = time.monotonic() + 180
    while ray.cluster_resources().get("second_node", 0) < 1:
        if node.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the second Ray node did not join: {log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield node
    kill_tree(node.pid)
    disconnect_ray()


def kill_tree(pid: int) -> list[int]:
    """SIGKILL process ``pid`` and every descendant (a node lost: no goodbye to the cluster); their pids."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    return [p.pid for p in tree]


def configure(directory: Path, models_dir: Path) -> CampaignConfig:
    data = smoke_config_in(directory, models_dir).model_dump()
    data["torch_threads"] = 1
    data["generation"]["batch_size"] = 4  # one problem per shard (G = 4): a stage is many shards
    data["cluster"] = RAY
    return CampaignConfig.model_validate(data)


def test_a_stage_runs_on_two_nodes_and_survives_losing_one(two_nodes, tmp_path, models_dir):
    import ray

    from evertrain.runtime import Runtime

    began = time.perf_counter()
    config = configure(tmp_path, models_dir)
    second = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("second_node"))
    with Runtime.open(config) as rt:
        run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
        sampled = run_stage(rt, "rollout", 0, STAGE_FUNCTIONS["rollout"])
        scored = run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
        # sampled and graded on both nodes
        assert sampled["cluster_nodes_used"] == 2 and sampled["cluster_workers_used"] == 2, sampled
        assert scored["cluster_grade_nodes"] == 2, scored
        first = rows(config, ROLLOUTS)
        assert len(first) == config.problems_per_iteration * config.group_size

        pool = rt.inference.pool
        before, killed = pool.last, []

        def lose_the_second_node() -> None:
            # once the rerun's first shard is back, the second node goes: its other shards are still to come
            while pool.last is before or pool.last.workers_used < 1:
                time.sleep(0.01)
            killed.extend(kill_tree(two_nodes.pid))

        killer = threading.Thread(target=lose_the_second_node, daemon=True)
        killer.start()
        rerun = run_stage(rt, "rollout", 0, STAGE_FUNCTIONS["rollout"])
        killer.join(timeout=60)
        assert killed, "the second node was not killed"
        # the head marks the node dead after its health check misses (about two seconds): the stage's actor calls
        # fail sooner than that, as the node's worker processes die with it
        deadline = time.monotonic() + 30
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == second) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == second)
        assert rerun["cluster_workers_replaced"] >= 1, rerun  # lost mid-stage, replaced on the survivor
        # the stage completed with every row once, the very rows the two nodes sampled before
        again = rows(config, ROLLOUTS)
        assert not again.duplicated(["problem_id", "sample"]).any()
        pd.testing.assert_frame_equal(again, first)
        alive = set(ray.get([w.node.remote() for w in pool.workers]))
        assert alive == {ray.get_runtime_context().get_node_id()}  # the replacements run on the head
    print(f"two-node test: {time.perf_counter() - began:.1f} s")
