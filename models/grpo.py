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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

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
