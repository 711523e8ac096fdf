"""The GRPO family of losses: group-normalized advantages and a clipped importance ratio.

Advantages compare each sample with the other samples of its group (the G rollouts of one problem).
The ratio is taken against the log-probs stored when the rollout was sampled, so rollouts made by an
older policy version are corrected rather than treated as on-policy. The three aggregations follow TRL
(``loss_type`` in ``trl.GRPOConfig``):

- ``grpo``: mean over each sequence's tokens, then over sequences;
- ``dapo``: sum over every token of the batch divided by the batch's token count;
- ``dr_grpo``: sum over every token divided by (sequences x a constant completion length), and
  advantages that are not divided by the group's standard deviation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from evertrain.models.logprobs import grouped_logprobs
from evertrain.models.precision import autocast

Algorithm = str  # "grpo" | "dapo" | "dr_grpo"


def group_advantages(rewards: torch.Tensor, algorithm: Algorithm = "grpo", eps: float = 1e-4) -> torch.Tensor:
    """Advantages for a [groups, G] reward tensor: reward minus the group mean, scaled by its std (not for dr_grpo)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if algorithm == "dr_grpo":
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def zero_variance(rewards: torch.Tensor) -> torch.Tensor:
    """Which groups of a [groups, G] tensor have rewards that all agree: they carry no signal."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values).abs() < 1e-12


@dataclass
class LossNorm:
    """Denominators fixed for a whole minibatch, so gradient accumulation over microbatches is exact."""

    sequences: int
    tokens: int
    max_completion_length: int


def policy_loss(new_logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, norm: LossNorm, *, algorithm: Algorithm = "grpo",
                clip_low: float = 0.2, clip_high: float = 0.2,
                ref_logps: torch.Tensor | None = None, kl_coef: float = 0.0,
                is_weights: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate loss of one microbatch, scaled so microbatch losses sum to the minibatch's.

    ``new_logps``, ``old_logps`` (the ratio's anchor) and ``mask`` are [batch, T]; ``advantages`` is
    [batch]. ``is_weights`` ([batch, T], no gradient) multiply each token's surrogate: the truncated
    importance weights that correct for rollouts sampled by an older policy (decoupled PPO).
    """
    mask = mask.to(new_logps.dtype)
    log_ratio = (new_logps - old_logps) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    kl = None
    if ref_logps is not None and kl_coef > 0:
        # k3 estimator of KL(policy || reference), as in TRL
        delta = ref_logps - new_logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
    if algorithm == "grpo":
        lengths = mask.sum(-1).clamp(min=1)
        loss = ((per_token * mask).sum(-1) / lengths).sum() / norm.sequences
    elif algorithm == "dapo":
        loss = (per_token * mask).sum() / max(norm.tokens, 1)
    elif algorithm == "dr_grpo":
        loss = (per_token * mask).sum() / (norm.sequences * norm.max_completion_length)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        is_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
        stats = {
            "clip_fraction": float((is_clipped.float() * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "approx_kl_old": float(((ratio - 1) - log_ratio).mul(mask).sum() / tokens),
            "tokens": float(mask.sum()),
        }
        if kl is not None:
            stats["kl_ref"] = float((kl * mask).sum() / tokens)
    return loss, stats


G = TypeVar("G")


def pack_microbatches(groups: Sequence[G], size: int, max_tokens: int, members: Callable[[G], Sequence[Any]],
                      length: Callable[[Any], int], part: Callable[[G, list[Any]], G]) -> list[list[G]]:
    """Groups packed in order into forward/backward passes of at most ``size`` completions and at most
    ``max_tokens`` padded completion tokens (rows x the longest completion in the pass).

    A group stays whole when it fits a pass of its own (its completions share one prefill of the prompt);
    one that alone exceeds either limit is split into parts (``part(group, members)``), each a pass of its
    own that runs the prompt again. The loss of every pass is normalised by its whole minibatch, so how the
    minibatch is cut into passes changes memory, not the gradient. ``members(group)`` lists a group's
    completions and ``length(member)`` gives one's token count.
    """
    def fits(rows: int, width: int) -> bool:
        return rows <= size and rows * width <= max_tokens

    batches: list[list[G]] = []
    current: list[G] = []
    rows = width = 0
    for group in groups:
        own = list(members(group))
        longest = max((length(m) for m in own), default=0)
        if current and not fits(rows + len(own), max(width, longest)):
            batches.append(current)
            current, rows, width = [], 0, 0
        if not own or fits(rows + len(own), max(width, longest)):
            current.append(group)
            rows, width = rows + len(own), max(width, longest)
            continue
        chunk: list[Any] = []
        chunk_width = 0
        for member in own:  # the group alone is too large for one pass
            if chunk and not fits(len(chunk) + 1, max(chunk_width, length(member))):
                batches.append([part(group, chunk)])
                chunk, chunk_width = [], 0
            chunk.append(member)
            chunk_width = max(chunk_width, length(member))
        current, rows, width = [part(group, chunk)], len(chunk), chunk_width
    if current:
        batches.append(current)
    return batches


# --- one optimizer step: what the one-process and the data-parallel update both run ----------------------

LOGPROB_FLOOR = -1e4  # a token outside the trainer's nucleus (top-p): log-prob -inf, floored to keep sums finite


@dataclass
class Member:
    """One trainable completion: its tokens, their sampling log-probs, its advantage, which tokens are its own."""

    ids: list[int]
    logprobs: list[float]
    advantage: float
    loss_mask: list[int]  # 0 for tool output inside a multi-turn episode: context, not action
    lag: int = 0  # updates between the policy that sampled it and the trainee
    proximal: list[float] | None = None  # the trainee's own log-probs before this update (the ratio's anchor)
    temperature: float = 1.0  # what it was sampled with: its log-probs are recomputed under the same
    top_p: float = 1.0  # likewise its nucleus: the behaviour log-probs are those of the truncated distribution


@dataclass
class Group:
    """One problem's prompt and its trainable completions."""

    prompt: list[int]
    members: list[Member]
    env: str = ""


@dataclass(frozen=True)
class StepSettings:
    """How one optimizer step is taken (the update's settings, as :func:`train_step` needs them)."""

    algorithm: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    is_cap: float = 2.0
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    microbatch_size: int = 8
    microbatch_tokens: int | None = None
    autocast_dtype: torch.dtype | None = None
    pad_id: int = 0
    chunk: int | None = None  # logprob_chunk
    shared_prefix: bool = True  # False under gradient checkpointing (a recomputed layer must not refill a cache)


@dataclass
class StepResult:
    """One step's loss (this process's share), gradient norm, mean importance weight per pass, summed statistics."""

    loss: float
    grad_norm: float
    is_weights: list[float] = field(default_factory=list)
    stats_sum: dict[str, float] = field(default_factory=dict)


class LogProbs(torch.nn.Module):
    """The policy's per-token log-probs (:func:`grouped_logprobs`) as a module's forward: what a
    DistributedDataParallel wrapper must see to all-reduce the gradients of the backward that follows."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompts: list[list[int]], completions: list[list[list[int]]], temperature: torch.Tensor,
                top_p: torch.Tensor, pad_id: int, chunk: int | None,
                shared_prefix: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_logprobs(self.model, prompts, completions, temperature=temperature, top_p=top_p,
                                pad_id=pad_id, chunk=chunk, shared_prefix=shared_prefix)


def sampling_settings(part: Sequence[Member]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion temperatures and top-p values: the distribution each was sampled from."""
    return (torch.tensor([m.temperature for m in part], dtype=torch.float32),
            torch.tensor([m.top_p for m in part], dtype=torch.float32))


def floored(logps: torch.Tensor) -> torch.Tensor:
    """``logps`` with -inf (a token outside the nucleus) raised to LOGPROB_FLOOR; no gradient flows there."""
    return torch.where(torch.isfinite(logps), logps, torch.full_like(logps, LOGPROB_FLOOR))


def padded(rows: Sequence[Sequence[float]], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rows`` (ragged) right-padded with zeros into a tensor shaped like ``like``."""
    out = torch.zeros(like.shape, dtype=dtype or like.dtype, device=like.device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=out.dtype, device=out.device)
    return out


def micro_passes(groups: list[Group], settings: StepSettings) -> list[list[Group]]:
    """Forward/backward passes: ``microbatch_size`` completions and ``microbatch_tokens`` padded tokens at most."""
    return pack_microbatches(groups, settings.microbatch_size, settings.microbatch_tokens or 2**62,
                             lambda g: g.members, lambda m: len(m.ids),
                             lambda g, part: Group(g.prompt, part, g.env))


@torch.no_grad()
def reference_logprobs(reference: Any, micro: list[Group], settings: StepSettings) -> torch.Tensor:
    """The KL reference's log-probs on one pass, by the policy's own path: chunked and under its autocast."""
    temperature, top_p = sampling_settings([m for g in micro for m in g.members])
    with autocast(settings.autocast_dtype, reference):
        logps, _ = grouped_logprobs(reference, [g.prompt for g in micro], [[m.ids for m in g.members] for g in micro],
                                    temperature=temperature, top_p=top_p, pad_id=settings.pad_id,
                                    chunk=settings.chunk)
    return floored(logps)


def _pass_loss(scorer: Any, micro: list[Group], settings: StepSettings, norm: LossNorm,
               reference: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """One forward pass's loss, its applied importance weights and mask (for their mean), and its statistics."""
    part = [m for g in micro for m in g.members]
    temperature, top_p = sampling_settings(part)
    policy = scorer.module if isinstance(scorer, torch.nn.parallel.DistributedDataParallel) else scorer
    with autocast(settings.autocast_dtype, policy.model):
        new_logps, mask = scorer([g.prompt for g in micro], [[m.ids for m in g.members] for g in micro],
                                 temperature, top_p, settings.pad_id, settings.chunk, settings.shared_prefix)
    new_logps = floored(new_logps)
    behaviour = padded([m.logprobs for m in part], new_logps)
    mask = mask & padded([m.loss_mask for m in part], mask, torch.bool)
    # the ratio's anchor is the proximal policy (the trainee before this update; without it, the current
    # log-probs: one step of fresh rollouts); every token is weighted by the truncated importance weight
    # against the sampler's behaviour log-probs
    anchor = new_logps.detach().clone()
    for row, m in enumerate(part):
        if m.proximal is not None:
            anchor[row, :len(m.proximal)] = torch.tensor(m.proximal, dtype=anchor.dtype, device=anchor.device)
    anchor = floored(anchor)
    weights = torch.exp(anchor - behaviour).clamp(max=settings.is_cap) * mask
    ref_logps = reference_logprobs(reference, micro, settings) if reference is not None else None
    advantages = torch.tensor([m.advantage for m in part], dtype=torch.float32, device=mask.device)
    loss, stats = policy_loss(new_logps, anchor, advantages, mask, norm, algorithm=settings.algorithm,
                              clip_low=settings.clip_low, clip_high=settings.clip_high, ref_logps=ref_logps,
                              kl_coef=settings.kl_coef, is_weights=weights)
    return loss, weights.sum() / mask.sum().clamp(min=1), stats


def train_step(scorer: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               minibatch: list[Group], settings: StepSettings, *, reference: Any = None,
               max_completion_length: int | None = None, share: list[Group] | None = None) -> StepResult:
    """One optimizer step on ``minibatch`` (whole groups), accumulated over forward/backward passes.

    ``scorer`` is a :class:`LogProbs` of the trainee, or its DistributedDataParallel wrapper: then this
    process computes ``share`` (its groups of the minibatch), the gradients are all-reduced (summed) by the
    wrapper in the backward of the last pass, and every process takes the same step. Each pass's loss is
    normalised by the *whole* minibatch (``max_completion_length``: Dr.GRPO's constant, default the
    minibatch's longest completion), so passes and processes add up to the loss of one big batch.
    """
    members = [m for g in minibatch for m in g.members]
    norm = LossNorm(sequences=len(members), tokens=sum(sum(m.loss_mask) for m in members),
                    max_completion_length=max_completion_length or max(len(m.ids) for m in members))
    mine = minibatch if share is None else share
    # a process without groups in this minibatch still takes part in the all-reduce: one pass, weight 0
    passes, weight = (micro_passes(mine, settings), 1.0) if mine else (micro_passes(minibatch[:1], settings), 0.0)
    optimizer.zero_grad(set_to_none=True)
    result = StepResult(loss=0.0, grad_norm=0.0)
    for index, micro in enumerate(passes):
        last = index == len(passes) - 1
        # gradients are all-reduced once per step, in the backward of the last pass
        quiet = scorer.no_sync() if not last and hasattr(scorer, "no_sync") else contextlib.nullcontext()
        with quiet:
            loss, is_weight, stats = _pass_loss(scorer, micro, settings, norm, reference)
            (loss * weight).backward()
        if weight:
            result.loss += float(loss.detach())
            result.is_weights.append(float(is_weight))
            rows = sum(len(g.members) for g in micro)
            for key, value in stats.items():
                result.stats_sum[key] = result.stats_sum.get(key, 0.0) + value * rows
    result.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm))
    optimizer.step()
    return result
