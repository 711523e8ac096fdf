"""Sampling fanned out over a Ray cluster (``[cluster]`` in the campaign config): the rollout workers.

With ``cluster.address = "none"`` nothing here runs: the campaign's inference samples in the flow's own process.
Otherwise:

- **Rollout workers** are Ray actors, each holding one sampler of the configured rollout backend
  (``generation.backend``: the in-house sampler, or a vLLM engine of the worker's own). A worker is told
  which policy version to sample from, by content hash; it loads that version once and keeps it until
  told another.
- **Shards.** The groups of a call are cut into shards, per environment, at exactly the boundaries the
  in-process sampler cuts its batches at (``generation.batch_size // G`` problems), and every group is
  seeded by (campaign seed, iteration, problem), never by its position. So, with a backend that honours
  per-request seeds (its declared capabilities), a shard computes bit for bit what the same batch computes
  in one process, and rows equal those of ``cluster = none``; a backend that does not is warned of at start.
- **Results come back to the caller's process**, which writes the store exactly as before: workers never open
  the store (DuckDB admits one writer process, and the flow is it).
- **A worker that dies** (its process killed, its node lost) is replaced by a fresh actor and the shard it
  held is submitted again; a shard's result is kept once, by shard index, so no group appears twice.
- **Weight hand-off.** A checkpoint travels through Ray's object store: the driver reads the checkpoint
  folder's files (for a LoRA version: the adapter, a few MB, and its manifest) into one object, ``ray.put``
  once per version, and a worker writes them to a local temporary folder and loads them. The base model is
  referenced by its path, as in every checkpoint: it must exist at that path on every node (a shared or
  identically provisioned path), and is read once per worker, not per version.

We build on Ray's scheduler (actors, ``ray.wait``) rather than on a scheduler of our own; the only logic here
is which shard goes to which idle worker and what to do when one dies. Grading on the cluster is the
orchestration's (:mod:`evertrain.cluster`); both share one connection (:func:`connect_ray`).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from evertrain import faults
from evertrain.config import CampaignConfig, ClusterConfig
from evertrain.envs import registry
from evertrain.envs.base import Environment, Problem
from evertrain.inference.backends import open_sampler
from evertrain.inference.base import ClusterError, SampleJob, SamplingStats
from evertrain.inference.episodes import sample_episodes
from evertrain.inference.vllm_sampler import Engines
from evertrain.models.checkpoint import checkpoint_digest
from evertrain.quiet import quiet_libraries

# Test-only fault injection: ``EVERTRAIN_KILL_WORKER_AT=<stage>:<shard>`` makes the worker that first
# receives that shard SIGKILL its own process after sampling it, before answering (read by the driver).
KILL_WORKER_ENV = "EVERTRAIN_KILL_WORKER_AT"


# --- what travels --------------------------------------------------------------------------------------

@dataclass
class Shard:
    """Consecutive groups of one environment: the unit a worker samples in one call."""

    index: int
    job: int  # which job (environment batch) of the call it belongs to
    offset: int  # position of its first problem within the job
    env: str
    problems: list[Problem]
    prompts: list[list[int]]
    seeds: list[int] | None
    max_new_tokens: int




@dataclass
class PackedCheckpoint:
    """A checkpoint folder's files, to be rebuilt on a worker: the LoRA hand-off through the object store."""

    version: int
    key: str  # which checkpoint this is (see ``checkpoint_key``): version numbers repeat across campaigns
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())


def checkpoint_key(path: str | Path, version: int) -> str:
    """Identity of a checkpoint folder: its content hash (``checkpoint_digest``), as in the vLLM engine.

    Not its path, version number or file times: an update rerun in place rewrites the same folder with new
    weights (a new key: workers load them), and the same weights under another name need no new load.
    """
    root = Path(path)
    if not root.is_dir():
        raise ClusterError(f"checkpoint folder {root} of version {version} does not exist")
    return checkpoint_digest(root)


def pack_checkpoint(path: str | Path, version: int) -> PackedCheckpoint:
    """Every file of a checkpoint folder (a base checkpoint is only its manifest; a LoRA one its adapter)."""
    root = Path(path)
    key = checkpoint_key(root, version)
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return PackedCheckpoint(version=version, key=key, files=files)


def unpack_checkpoint(packed: PackedCheckpoint, into: Path) -> Path:
    dest = into / f"version-{packed.version}"
    for name, data in packed.files.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dest


def plan_shards(jobs: list[SampleJob], n: int, batch_size: int) -> list[Shard]:
    """Cut every job into shards of ``batch_size // n`` problems: the in-process sampler's own batches."""
    per_chunk = max(1, batch_size // n)
    shards: list[Shard] = []
    for j, job in enumerate(jobs):
        for start in range(0, len(job.problems), per_chunk):
            end = start + per_chunk
            shards.append(Shard(
                index=len(shards), job=j, offset=start, env=job.env, problems=job.problems[start:end],
                prompts=job.prompts[start:end], seeds=None if job.seeds is None else job.seeds[start:end],
                max_new_tokens=job.max_new_tokens))
    return shards


# --- the worker ----------------------------------------------------------------------------------------

class RolloutWorker:
    """A Ray actor holding one sampler: the policy version it was last told to load, and its tokenizer."""

    def __init__(self, threads: int, config_json: str) -> None:
        quiet_libraries()
        os.environ["EVERTRAIN_PROGRESS"] = "0"
        torch.set_num_threads(threads)  # the CPUs this actor reserved, not every core of the node
        self.config = CampaignConfig.model_validate_json(config_json)
        self.env_options = {spec.name: dict(spec.options) for spec in self.config.environments}
        self.key: str | None = None  # the checkpoint held (see ``checkpoint_key``)
        self.sampler: Any = None  # the in-house sampler, or a vLLM engine's (generation.backend)
        self.engines = Engines()  # this worker's vLLM engine, stopped with the worker's process
        self.envs: dict[str, Environment] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="evertrain-worker-"))

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    def load(self, packed: PackedCheckpoint) -> float:
        """Load ``packed`` unless it is the checkpoint already held; returns the seconds it took."""
        if packed.key == self.key:
            return 0.0
        began = time.perf_counter()
        if self.sampler is not None and self.sampler.capabilities.weights_in_process:
            self.sampler = None  # free the old version before the new one is built
        folder = unpack_checkpoint(packed, self.scratch / packed.key[:16])
        # the same sampler the flow's process would open, from the checkpoint rebuilt on this node
        self.sampler, _ = open_sampler(self.config, folder, self.engines)
        for old in self.scratch.iterdir():  # keep only the version now held (a vLLM engine may read it again)
            if old.name != packed.key[:16]:
                shutil.rmtree(old, ignore_errors=True)
        self.key = packed.key
        return time.perf_counter() - began

    def sample(self, key: str, packed: list[Any], shard: Shard, n: int, options: dict[str, Any],
               die: bool = False) -> dict[str, Any]:
        """Sample ``n`` episodes for every problem of ``shard`` with the checkpoint ``key``."""
        cpu0 = time.process_time()
        load_s = 0.0
        if key != self.key:
            # the checkpoint is wrapped in a list so Ray hands over its reference, fetched only when needed
            load_s = self.load(ray.get(packed[0]))
        if shard.env not in self.envs:
            self.envs[shard.env] = registry.get(shard.env, **self.env_options.get(shard.env, {}))
        began = time.perf_counter()
        groups, stats = sample_episodes(
            self.sampler, self.envs[shard.env], shard.problems, shard.prompts, n,
            max_new_tokens=shard.max_new_tokens, seeds=shard.seeds, **options)
        if die:  # fault injection (tests): the process dies with the shard sampled but not handed back
            os.kill(os.getpid(), signal.SIGKILL)
        return {"index": shard.index, "groups": groups, "stats": stats, "load_s": load_s,
                "sample_s": time.perf_counter() - began, "cpu_s": time.process_time() - cpu0, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}


# --- the driver side -----------------------------------------------------------------------------------

@dataclass
class FanOutStats:
    """What one fanned-out call cost, summed over workers."""

    shards: int = 0
    workers_used: int = 0  # distinct worker processes that returned a shard
    workers_replaced: int = 0
    load_s: float = 0.0
    worker_cpu_s: float = 0.0
    handoff_bytes: int = 0
    handoff_put_s: float = 0.0
    grade_tasks: int = 0
    grade_processes: int = 0  # distinct Ray worker processes that graded
    nodes_used: int = 0  # distinct Ray nodes whose workers returned a shard

    def metrics(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


def connect_ray(campaign: CampaignConfig) -> None:
    """Connect this process to ``campaign``'s Ray cluster (once per process) and check it can hold the rollout
    workers and the grading beside them (:mod:`evertrain.cluster`), which share it."""
    cfg = campaign.cluster
    if not ray.is_initialized():
        try:
            if cfg.address == "local":
                # address="local" explicitly: without an address ray.init joins the last cluster `ray start` left
                # on this machine (or RAY_ADDRESS), and then refuses num_cpus
                ray.init(address="local", num_cpus=cfg.num_cpus or len(os.sched_getaffinity(0)),
                         include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=cfg.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as error:
            raise ClusterError(f"cannot connect to the Ray cluster at cluster.address = {cfg.address!r}: "
                               f"{error}") from None
    need = cfg.workers * cfg.cpus_per_worker + cfg.grade_cpus
    have = ray.cluster_resources().get("CPU", 0.0)
    if have < need:
        raise ClusterError(
            f"the Ray cluster offers {have:g} CPUs, but cluster.workers x cluster.cpus_per_worker "
            f"({cfg.workers} x {cfg.cpus_per_worker:g}) plus cluster.grade_cpus ({cfg.grade_cpus:g}) "
            f"need {need:g}: rollout workers hold their CPUs, so grading would never be scheduled")
    if cfg.gpus_per_worker and ray.cluster_resources().get("GPU", 0.0) < cfg.workers * cfg.gpus_per_worker:
        raise ClusterError(f"the Ray cluster has {ray.cluster_resources().get('GPU', 0.0):g} GPUs, fewer than "
                           f"cluster.workers x cluster.gpus_per_worker = {cfg.workers * cfg.gpus_per_worker:g}")


def disconnect_ray() -> None:
    """Disconnect this process from Ray (the connection Ray keeps per process; tests, benchmarks, an exit)."""
    if ray.is_initialized():
        ray.shutdown()


class WorkerPool:
    """The rollout workers this process started on a Ray cluster, and how each sampling call fanned out."""

    def __init__(self, campaign: CampaignConfig) -> None:
        self.campaign = campaign  # what workers build their sampler and environments from
        self.config: ClusterConfig = campaign.cluster
        self.workers: list[Any] = []
        self._packed: dict[str, Any] = {}  # checkpoint key -> object ref of its packed checkpoint
        self._lock = threading.Lock()  # one fan-out at a time (async mode calls from two threads)
        self._remote_worker: Any = None
        self._worker_options: dict[str, Any] = {}
        self.last = FanOutStats()
        self.history: list[tuple[str | None, FanOutStats]] = []  # (stage, stats) of every sampling fan-out

    def start(self) -> None:
        connect_ray(self.campaign)
        cfg = self.config
        # spread over the nodes: a lost node then takes only its share of the workers (each replaced on a survivor)
        self._remote_worker = ray.remote(RolloutWorker)
        self._worker_options = {"num_cpus": cfg.cpus_per_worker, "num_gpus": cfg.gpus_per_worker, "max_restarts": 0,
                                "scheduling_strategy": "SPREAD"}
        while len(self.workers) < cfg.workers:
            self.workers.append(self._spawn())

    def _spawn(self, replacement: bool = False) -> Any:
        threads = max(1, round(self.config.cpus_per_worker))
        options = dict(self._worker_options)
        if replacement:
            # a replacement goes to this process's node where it fits (soft: elsewhere when it does not): that node
            # is alive, while the lost worker's node may still count as alive until its health check misses, and
            # SPREAD would put the replacement right back on it to die with it
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=True)
        return self._remote_worker.options(**options).remote(threads, self.campaign.model_dump_json())

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers.clear()
        self._packed.clear()

    def _checkpoint_ref(self, version: int, checkpoint: str | Path) -> tuple[str, Any]:
        key = checkpoint_key(checkpoint, version)
        if key not in self._packed:
            began = time.perf_counter()
            packed = pack_checkpoint(checkpoint, version)
            # only the newest checkpoint stays in the object store; an older one is put again if asked for
            self._packed = {key: ray.put(packed)}
            self.last.handoff_bytes += packed.nbytes
            self.last.handoff_put_s += time.perf_counter() - began
        return key, self._packed[key]

    def sample_jobs(self, checkpoint: str | Path, version: int, jobs: list[SampleJob], n: int, *,
                    batch_size: int, progress: Any = None, **options: Any) -> list[tuple[list[list[Any]], Any]]:
        """(groups, SamplingStats) per job, as ``sample_episodes`` would return them, sampled by the workers."""
        with self._lock:
            self.last = FanOutStats()
            key, ref = self._checkpoint_ref(version, checkpoint)
            shards = plan_shards(jobs, n, batch_size)
            self.last.shards = len(shards)
            options = {**options, "batch_size": batch_size}
            kill = os.environ.get(KILL_WORKER_ENV, "")
            doomed = {int(kill.split(":")[1])} if kill.startswith(f"{faults.current_stage.get()}:") else set()
            pending = deque(shards)
            idle = list(range(len(self.workers)))
            running: dict[Any, tuple[int, Shard]] = {}
            results: dict[int, dict[str, Any]] = {}
            pids: set[int] = set()
            nodes: set[str] = set()
            while pending or running:
                while pending and idle:
                    slot, shard = idle.pop(0), pending.popleft()
                    die = shard.index in doomed
                    doomed.discard(shard.index)  # only the first attempt dies: its replacement must finish
                    call = self.workers[slot].sample.remote(key, [ref], shard, n, options, die)
                    running[call] = (slot, shard)
                done, _ = ray.wait(list(running), num_returns=1)
                for call in done:
                    slot, shard = running.pop(call)
                    try:
                        out = ray.get(call)
                    except RayActorError as error:
                        self.last.workers_replaced += 1
                        if self.last.workers_replaced > self.config.max_worker_restarts:
                            raise ClusterError(
                                f"rollout workers died {self.last.workers_replaced} times in one stage (more than "
                                f"cluster.max_worker_restarts = {self.config.max_worker_restarts}): {error}") from None
                        self.workers[slot] = self._spawn(replacement=True)
                        pending.appendleft(shard)  # redone from scratch by the replacement
                        idle.append(slot)
                        continue
                    results.setdefault(out["index"], out)  # one result per shard, however often it ran
                    self.last.load_s += out["load_s"]
                    self.last.worker_cpu_s += out["cpu_s"]
                    pids.add(out["pid"])
                    nodes.add(out["node"])
                    self.last.workers_used, self.last.nodes_used = len(pids), len(nodes)
                    if progress is not None:
                        progress.update(len(shard.problems) * n)
                    idle.append(slot)
        self.history.append((faults.current_stage.get(), self.last))
        outputs: list[tuple[list[list[Any]], Any]] = [([], SamplingStats()) for _ in jobs]
        for shard in shards:
            out = results[shard.index]
            groups, stats = outputs[shard.job]
            groups += out["groups"]
            stats.merge(out["stats"])
        return outputs
