"""The rollout backends: what each can do, what each refuses or warns of at start, how each opens a checkpoint.

``hf`` is the in-house sampler (:mod:`evertrain.inference.local`, the weights in this process); ``vllm`` a vLLM
engine process (:mod:`evertrain.inference.vllm_sampler`), and, for the endpoint, vLLM's own OpenAI server
(:mod:`evertrain.inference.vllm_server`). Every backend declares its :class:`~evertrain.inference.base.Capabilities`
and the parts it has; callers ask those, never the backend's name. :func:`check_backend` runs at a campaign's
start: it refuses what a backend cannot run (naming the cause) and warns of settings it cannot honour.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evertrain.config import CampaignConfig, GenerationConfig
from evertrain.inference.base import (
    HF_CAPABILITIES,
    VLLM_CAPABILITIES,
    BackendError,
    BackendWarning,
    Capabilities,
    Sampler,
    record_sync,
)
from evertrain.inference.local import open_local
from evertrain.inference.vllm_sampler import Engines, open_vllm, refuse_vllm, vllm_python
from evertrain.inference.vllm_server import VLLMServers
from evertrain.models.precision import resolve_device


def resolve_backend(config: CampaignConfig) -> str:
    """'hf' or 'vllm': 'auto' is vLLM on a CUDA device when its interpreter exists, else the in-house sampler."""
    backend = config.generation.backend
    if backend != "auto":
        return backend
    cuda = resolve_device(config.model.device).type == "cuda"
    return "vllm" if cuda and Path(vllm_python(config)).exists() else "hf"


@dataclass(frozen=True)
class Backend:
    """One rollout backend: what it can do, what it refuses at start, how it opens a checkpoint, how it serves."""

    name: str
    capabilities: Capabilities
    refuse: Callable[[CampaignConfig, str], None]  # raises BackendError for what it cannot run
    # (config, checkpoint, the engines of the caller: a vLLM engine is started once per owner and kept)
    open: Callable[[CampaignConfig, str | Path, Engines | None], tuple[Sampler, float]]
    # the endpoint's servers of its own, (config, base model) -> an object with open(version, checkpoint),
    # release(version) and close(); None: the endpoint samples on a sampler ``open`` gives it
    servers: Callable[[CampaignConfig, str], Any] | None = None


def _refuse_nothing(config: CampaignConfig, base_model: str) -> None:
    """The in-house sampler runs every causal LM transformers loads."""


BACKENDS: dict[str, Backend] = {
    "hf": Backend("hf", HF_CAPABILITIES, _refuse_nothing, open_local),
    "vllm": Backend("vllm", VLLM_CAPABILITIES, refuse_vllm, open_vllm, servers=VLLMServers),
}


def backend_for(config: CampaignConfig) -> Backend:
    """The rollout backend ``config.generation.backend`` names ('auto' resolved)."""
    name = resolve_backend(config)
    if name not in BACKENDS:
        raise BackendError(f"unknown generation.backend {name!r}: 'auto', {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[name]


def unhonoured_settings(config: CampaignConfig) -> list[str]:
    """Why each setting ``config`` asks for that its rollout backend does not honour (empty: all honoured)."""
    backend = backend_for(config)
    caps, gen, notes = backend.capabilities, config.generation, []
    if not caps.per_request_seeds:
        notes.append(
            f"generation.backend = {backend.name!r} does not honour per-request seeds: its engine is seeded once, "
            f"at start (seed = {config.seed}), so a problem's draws depend on what else is in the engine's batch, "
            "and a rerun of a stage does not reproduce its rollouts ('hf' seeds every problem)")
        if config.cluster.enabled:
            notes.append(
                "on a Ray cluster (cluster.address = "
                f"{config.cluster.address!r}), rows equal those of one process only with per-request seeds; "
                f"with generation.backend = {backend.name!r} every worker's engine draws its own")
    if not caps.batch_size and gen.batch_size != GenerationConfig.model_fields["batch_size"].default:
        notes.append(f"generation.batch_size = {gen.batch_size} is not used by generation.backend = "
                     f"{backend.name!r}: it schedules its own batches (bounded by its KV cache)")
    return notes


def check_backend(config: CampaignConfig, base_model: str) -> None:
    """At a campaign's start: refuse what the rollout backend cannot run, warn of what it will not honour.

    Raises :class:`BackendError` naming the cause; warns with :class:`BackendWarning`.
    """
    backend = backend_for(config)
    backend.refuse(config, base_model)
    for note in unhonoured_settings(config):
        warnings.warn(note, BackendWarning, stacklevel=2)


def open_sampler(config: CampaignConfig, checkpoint: str | Path, engines: Engines | None = None,
                 ) -> tuple[Sampler, float]:
    """A sampler for the policy in ``checkpoint`` under ``config.generation.backend``, and the hand-off seconds.

    ``hf`` loads the weights into this process; ``vllm`` hands them to an engine of ``engines`` (started on
    first use: minutes on a small CPU, so once per owner, never per stage; the owner, e.g. the campaign's
    context, stops it when it closes).
    """
    sampler, seconds = backend_for(config).open(config, checkpoint, engines)
    record_sync(seconds)
    return sampler, seconds
