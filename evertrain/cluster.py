"""Grading fanned out over a Ray cluster (``[cluster]`` in the campaign config).

With ``cluster.address = "none"`` nothing here runs: every stage grades in the flow's own process. Otherwise
grading runs in Ray tasks, each calling the environment's verifier on the node that runs it, so a sandboxed
verifier still runs under bubblewrap there (a node without bwrap refuses, as one process does). Grading is
deterministic, so Ray's own task retries on a lost worker or node cannot change a reward; the tasks are spread
over the nodes. Verdicts come back to the flow's process, which writes the store.

Sampling on the cluster is inference's (:mod:`evertrain.inference.ray_workers`, the rollout workers); both share
one Ray connection (:func:`~evertrain.inference.ray_workers.connect_ray`).
"""

from __future__ import annotations

import os
from typing import Any

import ray

from evertrain.config import CampaignConfig
from evertrain.envs import registry
from evertrain.envs.base import Problem, Verdict
from evertrain.quiet import quiet_libraries
from evertrain.scoring import verify_many


def _grade(items: list[tuple[str, Problem, str]], env_options: dict[str, dict[str, Any]],
           threads: int) -> tuple[list[Verdict], float, int, str]:
    """A Ray task: verdicts for (environment name, problem, completion) items, graded on this node."""
    quiet_libraries()
    t0 = os.times()
    envs = {name: registry.get(name, **env_options.get(name, {})) for name in {env for env, _, _ in items}}
    verdicts = verify_many([(envs[env], problem, text) for env, problem, text in items], workers=threads)
    t1 = os.times()
    # this process's CPU and that of its finished children (the sandboxed graders)
    cpu = sum(t1[:4]) - sum(t0[:4])
    return verdicts, cpu, os.getpid(), ray.get_runtime_context().get_node_id()


class Graders:
    """Grading in Ray tasks on ``campaign``'s cluster (connected on :meth:`start`)."""

    def __init__(self, campaign: CampaignConfig) -> None:
        self.campaign = campaign
        self.config = campaign.cluster
        self.env_options = {spec.name: dict(spec.options) for spec in campaign.environments}
        self._remote: Any = None
        self.last: dict[str, float] = {}  # the last call's metrics

    def start(self) -> None:
        # late: the rollout workers' module imports torch, transformers and peft (about 6 CPU-seconds); a grading
        # task's worker process imports this module to run _grade, and grading needs none of them
        from evertrain.inference.ray_workers import connect_ray

        connect_ray(self.campaign)
        self._remote = ray.remote(_grade).options(num_cpus=self.config.grade_cpus, max_retries=3,
                                                  scheduling_strategy="SPREAD")

    def verify_many(self, items: list[tuple[str, Problem, str]], progress: Any = None) -> list[Verdict]:
        """Verdicts for (environment name, problem, completion) items, in input order, graded in Ray tasks."""
        self.last = {"cluster_grade_cpu_s": 0.0, "cluster_grade_tasks": 0, "cluster_grade_processes": 0}
        if not items:
            return []
        per_task = max(1, -(-len(items) // (4 * self.config.workers)))
        threads = max(1, round(self.config.grade_cpus * 2))  # verifiers mostly wait on sandboxed subprocesses
        calls = [self._remote.remote(items[i:i + per_task], self.env_options, threads)
                 for i in range(0, len(items), per_task)]
        verdicts: list[Verdict] = []
        cpu = 0.0
        pids: set[int] = set()
        nodes: set[str] = set()
        for call in calls:  # in order: the verdicts line up with the items
            part, seconds, pid, node = ray.get(call)
            verdicts += part
            cpu += seconds
            pids.add(pid)
            nodes.add(node)
            if progress is not None:
                progress.update(len(part))
        self.last = {"cluster_grade_cpu_s": cpu, "cluster_grade_tasks": len(calls),
                     "cluster_grade_processes": len(pids - {os.getpid()}), "cluster_grade_nodes": len(nodes)}
        return verdicts


def open_graders(config: CampaignConfig) -> Graders | None:
    """Started graders for ``config`` (None when ``cluster.address = "none"``)."""
    if not config.cluster.enabled:
        return None
    graders = Graders(config)
    graders.start()
    return graders
