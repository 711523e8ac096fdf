"""The learner's log-probs: per-token log-probabilities of sampled completions under the policy being trained.

What the GRPO loss (:mod:`evertrain.models.grpo`) takes its importance ratios from: each group's prompt is read
once (:func:`evertrain.models.forward.prefill`), its cache repeated for the group's completions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from evertrain.models.forward import cache_keyword, prefill, top_p_filter


def grouped_logprobs(model: Any, prompts: list[list[int]], completions: list[list[list[int]]], *,
                     temperature: float | torch.Tensor = 1.0, pad_id: int = 0, top_p: float | torch.Tensor = 1.0,
                     chunk: int | None = None, shared_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of every completion of every group: a [completions, T] tensor and its mask.

    ``prompts[g]`` is group g's prompt and ``completions[g]`` its completions. Each prompt is run once
    (their common prefix once for all), its cache repeated for the group's completions, so the
    update costs about what the completions cost, not G copies of the prompt. Rows are the
    completions in order, right-padded to T.

    ``temperature`` is one number or one per completion (rollouts replayed with the settings they were
    sampled with); so is ``top_p``: below 1 it gives log-probs of the truncated distribution (tokens outside
    it: -inf).
    With ``chunk``, log-probs are computed from the decoder's hidden states ``chunk`` positions at a
    time (recomputed in the backward pass), so no [rows, T, vocabulary] float32 tensor exists for the
    whole batch: what keeps a 150k-token vocabulary with long completions in memory. ``shared_prefix =
    False`` runs every completion with its whole prompt and no KV cache (what gradient checkpointing
    needs: a recomputed layer would write to a shared cache twice).
    """
    device = next(model.parameters()).device
    flat = [c for group in completions for c in group]
    ids, completion_mask = _right_pad(flat, pad_id)
    ids, completion_mask = ids.to(device), completion_mask.to(device)
    counts = [len(c) for c in completions]
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=device, dtype=torch.float32)
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.to(device=device, dtype=torch.float32)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    # logit soft-capping or scaling (Gemma, Cohere) lives in the causal-LM head's forward: keep the full path
    chunkable = chunk is not None and not any(getattr(config, k, None) for k in ("final_logit_softcapping",
                                                                                   "logit_scale"))
    if not shared_prefix:
        return _unshared_logprobs(model, inner, prompts, counts, ids, completion_mask, temperature, top_p,
                                  chunk if chunkable else None, pad_id)
    state = prefill(model, prompts, pad_id)
    state.select(torch.arange(len(prompts), device=device).repeat_interleave(torch.tensor(counts, device=device)))
    width = ids.shape[1]
    mask = torch.cat([state.mask, completion_mask], dim=-1)
    positions = state.next_position[:, None] + torch.arange(width, device=device)[None, :]
    first = _logprobs_of(state.last_logits[:, None, :], ids[:, :1], temperature, top_p)
    if chunkable:
        body = inner.get_decoder()
        hidden = body(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      use_cache=True, **{cache_keyword(body): state.cache}).last_hidden_state
        rest = _chunked_logprobs(inner.get_output_embeddings(), hidden, ids[:, 1:], temperature, top_p, chunk)
        return torch.cat([first, rest], dim=1), completion_mask.bool()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{cache_keyword(model): state.cache})
    rest = _logprobs_of(out.logits[:, :-1, :], ids[:, 1:], temperature, top_p)
    return torch.cat([first, rest], dim=1), completion_mask.bool()


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                 top_p: float | torch.Tensor) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), top-p truncated; float32 whatever the model's dtype."""
    if isinstance(temperature, torch.Tensor):  # one per row
        temperature = temperature.view(-1, *([1] * (logits.dim() - 1)))
    scaled = logits.float() / temperature
    if isinstance(top_p, torch.Tensor):  # one per row (rollouts replayed with the nucleus they were sampled with)
        if bool((top_p < 1.0).any()):
            # a row with top_p = 1 keeps every token, float rounding of the cumulative sum included
            cut = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, math.inf))
            scaled = top_p_filter(scaled, cut.view(-1, *([1] * (logits.dim() - 1))))
    elif top_p < 1.0:
        scaled = top_p_filter(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def _chunked_logprobs(head: Any, hidden: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                      top_p: float | torch.Tensor, chunk: int) -> torch.Tensor:
    """``_logprobs_of(head(hidden))`` ``chunk`` positions at a time; under autograd each chunk's logits are
    recomputed in the backward pass instead of kept (activation checkpointing of the head and softmax)."""
    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _logprobs_of(head(h), t, temperature, top_p)

    parts = []
    for start in range(0, hidden.shape[1], chunk):
        h, t = hidden[:, start:start + chunk], targets[:, start:start + chunk]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if torch.is_grad_enabled() else piece(h, t))
    if not parts:
        return hidden.new_zeros((hidden.shape[0], 0), dtype=torch.float32)
    return torch.cat(parts, dim=1)


def _unshared_logprobs(model: Any, inner: Any, prompts: list[list[int]], counts: list[int], ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor,
                       chunk: int | None, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_logprobs without a shared KV cache: each row is its prompt and completion, right-padded."""
    device = ids.device
    owners = [g for g, count in enumerate(counts) for _ in range(count)]
    rows = [prompts[g] + [int(x) for x in ids[r, :int(completion_mask[r].sum())]] for r, g in enumerate(owners)]
    full, full_mask = _right_pad(rows, pad_id)
    full, full_mask = full.to(device), full_mask.to(device)
    # hidden state at position L-1+t predicts completion token t (L: the row's prompt length)
    starts = torch.tensor([len(prompts[g]) - 1 for g in owners], device=device)
    index = (starts[:, None] + torch.arange(ids.shape[1], device=device)[None, :]).clamp(max=full.shape[1] - 1)
    if chunk is not None:
        hidden = inner.get_decoder()(input_ids=full, attention_mask=full_mask, use_cache=False).last_hidden_state
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        return _chunked_logprobs(inner.get_output_embeddings(), picked, ids, temperature, top_p, chunk), \
            completion_mask.bool()
    logits = model(input_ids=full, attention_mask=full_mask, use_cache=False).logits
    picked = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
    return _logprobs_of(picked, ids, temperature, top_p), completion_mask.bool()


def _right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask

