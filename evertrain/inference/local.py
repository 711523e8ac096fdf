"""The in-house sampler (``generation.backend = "hf"``): a transformers model held in this process.

Prompts are read once (:func:`evertrain.models.forward.prefill`), finished rows leave the batch, and every
sampled token's log-prob is that of the distribution it was drawn from (after temperature and top-p).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from evertrain.inference.base import HF_CAPABILITIES, Sample, SamplingStats
from evertrain.models.checkpoint import load_policy
from evertrain.models.forward import cache_keyword, prefill, top_p_filter
from evertrain.models.precision import sampling_dtype

if TYPE_CHECKING:
    from evertrain.config import CampaignConfig

_closers: dict[tuple[int, tuple[str, ...]], frozenset[int]] = {}


def _closing_tokens(tokenizer: Any, stop_strings: tuple[str, ...]) -> frozenset[int]:
    """Token ids whose text contains a stop string's last character: only they trigger the decoding check."""
    if not stop_strings:
        return frozenset()
    key = (id(tokenizer), stop_strings)
    if key not in _closers:
        last = {s[-1] for s in stop_strings}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        _closers[key] = frozenset(i for i, piece in enumerate(pieces)
                                  if piece and any(c in tokenizer.convert_tokens_to_string([piece]) for c in last))
    return _closers[key]


@torch.no_grad()
def sample(model: Any, tokenizer: Any, prompts: list[list[int]], n: int, *, max_new_tokens: int,
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, batch_size: int = 64,
           seed: int = 0, progress: Any = None, stop_strings: tuple[str, ...] = (),
           seeds: list[int] | None = None) -> tuple[list[list[Sample]], SamplingStats]:
    """Sample ``n`` completions for every prompt (token ids), with each token's log-probability.

    Prompts are read once (their common prefix once for the whole batch, each prompt once for its
    group of ``n``) and the KV cache is copied; finished sequences leave the batch so the rest decode
    faster. Log-probs are taken in float32 from ``logits / temperature`` after the top-p cut: the
    distribution each token was actually drawn from, which importance weights are computed against. A
    row also stops when its text ends with one of ``stop_strings`` (the closing tag of a tool call: the
    tool must answer, not the policy); such rows finish with reason ``"stop_string"`` and keep the stop
    string in their text.

    With ``seeds`` (one per prompt) each prompt's ``n`` samples draw from a generator of their own, so
    a group's completions do not depend on which other groups share its batch or in what order: what
    lets rollouts be split over workers and still equal those of one process. Otherwise one generator
    seeded by ``seed`` serves the whole call.
    """
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompts)} prompts (one per prompt)")
    closers = _closing_tokens(tokenizer, stop_strings)
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    eos = torch.tensor(sorted({tokenizer.eos_token_id, *configured} - {None}))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    stats = SamplingStats()
    results: list[list[Sample]] = [[] for _ in prompts]
    per_chunk = max(1, batch_size // n)
    cache_kw = cache_keyword(model)
    for start in range(0, len(prompts), per_chunk):
        chunk = prompts[start:start + per_chunk]
        generators = None if seeds is None else [
            torch.Generator(device=device).manual_seed(s) for s in seeds[start:start + per_chunk]]
        began = time.perf_counter()
        state = prefill(model, chunk, tokenizer.pad_token_id)
        stats.prompt_tokens += state.computed_tokens
        stats.cached_prompt_tokens += sum(len(p) for p in chunk) * n - state.computed_tokens
        if n > 1:
            state.select(torch.arange(len(chunk), device=device).repeat_interleave(n))
        cache, mask, positions = state.cache, state.mask, state.next_position
        logits = state.last_logits.float()
        batch = logits.shape[0]
        active = torch.arange(batch)  # which original rows are still decoding
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logps: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        for _step in range(max_new_tokens):
            scaled = logits if greedy else logits / temperature
            # log-probs of the distribution actually sampled from (after top-p): what importance weights need
            filtered = top_p_filter(scaled, top_p) if top_p < 1.0 and not greedy else scaled
            logp_all = torch.log_softmax(filtered, dim=-1)
            if greedy:
                chosen = scaled.argmax(-1)
            else:
                probs = torch.softmax(filtered, -1)
                if generators is None:
                    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                else:
                    chosen = _draw_per_group(probs, active // n, generators)
            chosen_logp = logp_all.gather(-1, chosen[:, None]).squeeze(-1)
            done = torch.isin(chosen.cpu(), eos)
            for row, (token, lp, stop) in enumerate(zip(chosen.tolist(), chosen_logp.tolist(), done.tolist(),
                                                        strict=True)):
                original = int(active[row])
                tokens[original].append(token)
                logps[original].append(lp)
                if stop:
                    finish[original] = "stop"
                elif token in closers:
                    tail = tokenizer.decode(tokens[original][-16:], skip_special_tokens=True).rstrip()
                    if tail.endswith(stop_strings):
                        finish[original] = "stop_string"
                        done[row] = True
            keep = ~done
            if not bool(keep.any()):
                break
            if not bool(keep.all()):
                index = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(index.to(device))
                active, chosen, mask, positions = active[index], chosen[index], mask[index], positions[index]
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=-1)
            out = model(input_ids=chosen[:, None].to(device), attention_mask=mask,
                        position_ids=positions[:, None].to(device), use_cache=True, **{cache_kw: cache})
            positions = positions + 1
            logits = out.logits[:, -1, :].float()
        stats.forward_seconds += time.perf_counter() - began
        for row in range(batch):
            completion = tokens[row]
            stats.completion_tokens += len(completion)
            text_ids = completion[:-1] if finish[row] == "stop" else completion
            results[start + row // n].append(Sample(
                completion_ids=completion, logprobs=logps[row], finish_reason=finish[row],
                text=tokenizer.decode(text_ids, skip_special_tokens=True),
            ))
        if progress is not None:
            progress.update(len(chunk) * n)
    return results, stats


def _draw_per_group(probs: torch.Tensor, owners: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row drawn from the generator of the group that owns it (``owners[row]``)."""
    chosen = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for group in torch.unique(owners).tolist():
        rows = (owners == group).nonzero().squeeze(-1).to(probs.device)
        chosen[rows] = torch.multinomial(probs[rows], 1, generator=generators[group]).squeeze(-1)
    return chosen



class HFSampler:
    """The in-house sampler over a transformers model held in this process."""

    backend = "hf"
    capabilities = HF_CAPABILITIES

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def sample(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, greedy: bool = False, batch_size: int = 64, seed: int = 0,
               seeds: list[int] | None = None, stop_strings: tuple[str, ...] = (),
               progress: Any = None) -> tuple[list[list[Sample]], SamplingStats]:
        return sample(self.model, self.tokenizer, prompts, n, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_p=top_p, greedy=greedy, batch_size=batch_size, seed=seed, progress=progress,
                      stop_strings=stop_strings, seeds=seeds)


def open_local(config: CampaignConfig, checkpoint: str | Path, engines: Any = None) -> tuple[HFSampler, float]:
    """The in-house sampler over ``checkpoint``'s weights loaded into this process, and the seconds the load took
    (``engines`` is not used: the weights live here)."""
    began = time.perf_counter()
    dtype = sampling_dtype(config.model.rollout_dtype, config.model.device)
    model, tokenizer = load_policy(checkpoint, dtype=getattr(torch, dtype), device=config.model.device)
    return HFSampler(model, tokenizer), time.perf_counter() - began
