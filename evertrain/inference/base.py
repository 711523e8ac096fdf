"""What every way of sampling speaks: the sampler interface, its declared capabilities, and what it returns.

Token-id prompts go in; completions come out with their token ids, the behaviour log-prob of every sampled token
(of the distribution actually sampled from: after temperature and top-p), the finish reason, and stop strings (a
tool call's closing tag) honoured. Every backend declares its :class:`Capabilities`; callers ask those, never a
backend's name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from evertrain.envs.base import Problem
from evertrain.models import ModelError


class BackendError(ModelError):
    """A rollout backend that cannot run this campaign (model, device or setting): refused at start."""


class ClusterError(RuntimeError):
    """A Ray cluster that cannot run the stage (cannot connect, too few resources, workers keep dying)."""


class BackendWarning(UserWarning):
    """A setting the rollout backend does not honour: the campaign runs, without it."""


@dataclass
class Sample:
    """One sampled completion with what the update needs to compute an importance ratio."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    text: str = ""


@dataclass
class SamplingStats:
    prompt_tokens: int = 0  # prompt tokens computed (once per prompt: the group shares its prefix)
    cached_prompt_tokens: int = 0  # prompt tokens served from the shared prefix cache
    completion_tokens: int = 0
    forward_seconds: float = 0.0

    def merge(self, other: SamplingStats) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_prompt_tokens += other.cached_prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.forward_seconds += other.forward_seconds


@dataclass
class SampleJob:
    """One environment's problems for one sampling call: ``n`` episodes of each are sampled."""

    env: str
    problems: list[Problem]
    prompts: list[list[int]]
    max_new_tokens: int
    seeds: list[int] | None = None  # one per problem: each group seeded on its own (see ``local.sample``)
    seed: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a rollout backend does with what it is asked. Callers ask these, never the backend's name."""

    per_request_seeds: bool  # honours ``seed``/``seeds``: a problem's draws do not depend on its batch
    batch_size: bool  # honours ``batch_size`` (else it schedules its own batches, concurrent requests included)
    lora: bool  # serves a LoRA checkpoint as such
    full_weights: bool  # serves a fully fine-tuned checkpoint
    logprobs: bool  # returns the behaviour log-prob of every sampled token (after temperature and top-p)
    weights_in_process: bool  # the sampler holds the policy's weights in this process (drop it before the next)
    # None: answers are the in-house sampler's; else a name for the numerics that made them, part of the
    # evaluation cache key (another engine's answers are other answers)
    answers_identity: str | None


HF_CAPABILITIES = Capabilities(per_request_seeds=True, batch_size=True, lora=True, full_weights=True,
                               logprobs=True, weights_in_process=True, answers_identity=None)
# per-request seeds fail on vLLM's CPU build ("CPU Generator does not use offset"): the engine is seeded once
VLLM_CAPABILITIES = Capabilities(per_request_seeds=False, batch_size=False, lora=True, full_weights=True,
                                 logprobs=True, weights_in_process=False, answers_identity="vllm")


@runtime_checkable
class Sampler(Protocol):
    """What every consumer of sampling needs: a tokenizer, the backend's capabilities and one ``sample`` call."""

    tokenizer: Any
    backend: str
    capabilities: Capabilities

    def sample(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, greedy: bool = False, batch_size: int = 64, seed: int = 0,
               seeds: list[int] | None = None, stop_strings: tuple[str, ...] = (),
               progress: Any = None) -> tuple[list[list[Sample]], SamplingStats]:
        """``n`` completions per prompt, grouped by prompt, and what sampling them cost."""
        ...


# --- weight hand-off accounting --------------------------------------------------------------------------

_sync_lock = threading.Lock()
_sync_total = 0.0


def record_sync(seconds: float) -> None:
    """Add a weight hand-off (loading a policy version into a sampler) to this process's running total."""
    global _sync_total
    with _sync_lock:
        _sync_total += seconds


def sync_seconds() -> float:
    """Seconds this process has spent handing policy weights to samplers (stages take differences)."""
    with _sync_lock:
        return _sync_total

