"""The campaign's inference: one object behind every way the campaign samples.

A campaign's context (:class:`evertrain.runtime.Runtime`) holds one :class:`Inference`; the rollout and evaluate
stages make one call on it each (:meth:`Inference.sample_groups`), the endpoint asks it for a sampler to serve a
version with (:meth:`Inference.serve`). Behind it: the configured rollout backend (``generation.backend``: the
in-house sampler or a vLLM engine, :mod:`evertrain.inference.backends`) in this process, or the Ray rollout
workers (:mod:`evertrain.inference.ray_workers`) when ``cluster.address`` is set; its
:attr:`~Inference.capabilities` say what the backend honours, so no caller tests a backend's name.

It owns what it starts (the vLLM engines, unless lent; the Ray workers; the endpoint's vLLM servers) and stops
them in :meth:`Inference.close`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evertrain.config import CampaignConfig
from evertrain.envs.base import Environment
from evertrain.inference.backends import Backend, backend_for, check_backend, open_sampler
from evertrain.inference.base import Capabilities, ClusterError, SampleJob, Sampler, SamplingStats
from evertrain.inference.episodes import Episode, sample_episodes
from evertrain.inference.vllm_sampler import Engines
from evertrain.models.checkpoint import checkpoint_digest, load_tokenizer, read_manifest

# (groups of episodes, sampling statistics) per job
Outputs = list[tuple[list[list[Episode]], SamplingStats]]


class InferenceClosed(RuntimeError):
    """Sampling asked of an inference that was closed (its campaign's context closed)."""


class Inference:
    """Every way a campaign samples, behind one interface with declared capabilities.

    ``env_of`` names an environment's object (the context's ``rt.env``); ``engines``: vLLM engines to sample on,
    lent by the caller (never stopped here; their lender does), else started here on first use and stopped by
    :meth:`close`.
    """

    def __init__(self, config: CampaignConfig, env_of: Callable[[str], Environment], *,
                 engines: Engines | None = None) -> None:
        self.config = config
        self._env_of = env_of
        self._engines = engines
        self._owns_engines = engines is None
        self._pool: Any = None  # evertrain.inference.ray_workers.WorkerPool, started on first use
        self._servers: Any = None  # the backend's endpoint servers (Backend.servers), started on first use
        self._lock = threading.Lock()  # stages of two iterations may run at once (update.mode = "async")
        # the sampler each thread opened last, with its checkpoint's digest: a stage's calls (evaluate's looks,
        # dynamic sampling's rounds) reuse it; per thread, so two stages at once never share a model or tokenizer
        self._opened = threading.local()
        self._closed = False

    # --- what it is -----------------------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The rollout backend ``generation.backend`` names ('auto' resolved)."""
        return backend_for(self.config)

    @property
    def capabilities(self) -> Capabilities:
        """What the rollout backend honours (seeds, batch size, LoRA, log-probs, where the weights live)."""
        return self.backend.capabilities

    def check(self, base_model: str) -> None:
        """At a campaign's start: refuse what the backend cannot run, warn of settings it will not honour."""
        check_backend(self.config, base_model)

    # --- what it owns ---------------------------------------------------------------------------------------

    @property
    def engines(self) -> Engines:
        """The vLLM engines this inference samples on: the lent ones, else started on first use and kept across
        stages and iterations until :meth:`close`."""
        with self._lock:
            self._check_open()
            if self._engines is None:
                self._engines = Engines()
            return self._engines

    @property
    def started_engines(self) -> Engines | None:
        """The engines if any were asked for, or the lent ones (None: none; asking starts nothing)."""
        return self._engines

    @property
    def pool(self) -> Any:
        """The Ray rollout workers (``evertrain.inference.ray_workers.WorkerPool``), started on first use; None
        when ``cluster.address = "none"``."""
        with self._lock:
            if self._pool is None and self.config.cluster.enabled:
                self._check_open()
                # late on purpose: importing Ray costs about 2 CPU-seconds, paid only by a campaign on a cluster
                from evertrain.inference.ray_workers import WorkerPool

                pool = WorkerPool(self.config)
                try:
                    pool.start()
                except BaseException:
                    pool.shutdown()
                    raise
                self._pool = pool
            return self._pool

    @property
    def endpoint_servers(self) -> Any:
        """The backend's endpoint servers if :meth:`serve` started them (vLLM's OpenAI servers), else None."""
        return self._servers

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the engines this inference samples on (0 without any)."""
        engines = self._engines
        return engines.cpu_seconds() if engines is not None else 0.0

    def _check_open(self) -> None:
        if self._closed:
            raise InferenceClosed(f"the inference of campaign {self.config.name!r} is closed: open another context")

    def release(self) -> None:
        """Drop the sampler this thread opened (its weights, for the in-house sampler): a stage's end."""
        self._opened.__dict__.clear()

    def close(self) -> None:
        """Stop what this inference started: its Ray workers, its vLLM engines (not lent ones), its servers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, servers, engines = self._pool, self._servers, self._engines if self._owns_engines else None
            self._pool = self._servers = None
            if self._owns_engines:
                self._engines = None
        self.release()
        try:
            if pool is not None:
                pool.shutdown()
            if servers is not None:
                servers.close()
        finally:
            if engines is not None:
                engines.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- sampling -------------------------------------------------------------------------------------------

    def tokenizer(self, checkpoint: str | Path) -> Any:
        """The tokenizer of the policy in ``checkpoint`` (its base model's): what prompts are encoded with."""
        return load_tokenizer(read_manifest(checkpoint)["base_model"])

    def sampler(self, checkpoint: str | Path) -> Sampler:
        """A sampler of the policy in ``checkpoint`` in this process (or on this inference's vLLM engine); the one
        this thread opened last when it holds the same weights (known by content)."""
        self._check_open()
        digest = checkpoint_digest(checkpoint)
        opened = self._opened.__dict__
        if opened.get("digest") != digest:
            opened.clear()  # the old weights go before the new ones load
            opened["sampler"], _ = open_sampler(self.config, checkpoint, self.engines)
            opened["digest"] = digest
        return opened["sampler"]

    def sample_groups(self, checkpoint: str | Path, version: int, jobs: list[SampleJob], n: int, *,
                      temperature: float | None = None, greedy: bool = False,
                      progress: Any = None) -> tuple[Outputs, dict[str, float]]:
        """``n`` episodes for every problem of every job from policy ``version`` (held in ``checkpoint``): in this
        process, or on the Ray rollout workers. Greedy, or sampled at ``temperature`` (default
        ``generation.temperature``) with ``generation.top_p``.

        Returns (groups, statistics) per job, and the fan-out's own metrics (empty in this process).
        """
        gen = self.config.generation
        options: dict[str, Any] = {"greedy": True} if greedy else {
            "temperature": gen.temperature if temperature is None else temperature, "top_p": gen.top_p}
        pool = self.pool
        if pool is None:
            sampler = self.sampler(checkpoint)
            outputs = [sample_episodes(sampler, self._env_of(job.env), job.problems, job.prompts, n,
                                       max_new_tokens=job.max_new_tokens, batch_size=gen.batch_size, seed=job.seed,
                                       seeds=job.seeds, progress=progress, **options)
                       for job in jobs]
            return outputs, {}
        if any(job.seeds is None for job in jobs) and not greedy:
            # one generator per call would make a shard's draws depend on how the call was cut
            raise ClusterError("sampling on a cluster needs one seed per problem (SampleJob.seeds)")
        outputs = pool.sample_jobs(checkpoint, version, jobs, n, batch_size=gen.batch_size, progress=progress,
                                   **options)
        return outputs, pool.last.metrics("cluster_")

    # --- serving --------------------------------------------------------------------------------------------

    def serve(self, version: int, checkpoint: str | Path, base_model: str) -> tuple[Sampler, float]:
        """A sampler serving ``version`` to the endpoint, and the seconds its weights' hand-off took: on the
        backend's own servers where it has them (vLLM's OpenAI server), else opened in this process."""
        servers = self._endpoint_servers(base_model)
        if servers is None:
            return open_sampler(self.config, checkpoint)
        return servers.open(version, checkpoint)

    def unserve(self, version: int) -> None:
        """``version`` is no longer kept loaded by the endpoint (its server's copy goes after a grace period)."""
        if self._servers is not None:
            self._servers.release(version)

    def _endpoint_servers(self, base_model: str) -> Any:
        factory = self.backend.servers
        if factory is None:
            return None
        with self._lock:
            self._check_open()
            if self._servers is None:
                self.backend.refuse(self.config, base_model)  # what the backend cannot run, named
                self._servers = factory(self.config, base_model)
            return self._servers
