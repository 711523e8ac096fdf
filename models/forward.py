"""The forward pass both parts share: reading a batch of prompts into one KV cache, their common prefix once.

The in-house sampler (:mod:`evertrain.inference.local`) decodes from a :class:`Prefill`; the learner's log-probs
(:mod:`evertrain.models.logprobs`) score completions from one, differentiably. Neither imports the other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_DECODING = "evertrain_sdpa"  # transformers' SDPA attention, a decoding step's grouped heads attended in place


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _grouped_decoding_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a one-token query (a decoding step) of a model whose query heads
    share key/value heads (grouped-query attention: SmolLM2-135M has 9 query heads on 3) attends the shared heads in
    place (SDPA's ``enable_gqa``). transformers copies every key/value head once per query head whenever a padding
    mask is given (its CUDA kernels need that); on a CPU the copies cost several times the attention itself. The
    output is the same to the bit (tests/test_grouped_decoding.py); longer queries (prompts, the learner's forward and
    backward, where SDPA's grouped kernel is not faster) take transformers' own path unchanged."""
    if query.shape[2] == 1 and getattr(module, "num_key_value_groups", 1) > 1 and not kwargs.get("position_bias"):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(GROUPED_DECODING, _grouped_decoding_attention)
AttentionMaskInterface.register(GROUPED_DECODING, sdpa_mask)  # the masks SDPA gets, as before


def use_grouped_decoding(model: Any) -> None:
    """Decode with :func:`_grouped_decoding_attention` where the model uses transformers' SDPA attention (the
    default); any other attention (eager, flash) is left as chosen."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    if getattr(inner.config, "_attn_implementation", None) == "sdpa":
        inner.set_attn_implementation(GROUPED_DECODING)


def cache_keyword(model: Any) -> str:
    # transformers 5 renames forward's `past_key_values` to `cache`; some architectures keep the old name
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix that every row shares."""
    first = rows[0]
    length = min(len(row) for row in rows)
    for row in rows[1:]:
        i = 0
        while i < length and row[i] == first[i]:
            i += 1
        length = i
    return length


@dataclass
class Prefill:
    """The KV cache after reading a batch of prompts, and what decoding from it needs."""

    cache: Any
    last_logits: torch.Tensor  # [batch, vocab]: the distribution of each prompt's next token
    mask: torch.Tensor  # [batch, cached length]: 1 where a real token sits, 0 for padding
    next_position: torch.Tensor  # [batch]: position id of each row's next token
    computed_tokens: int  # prompt tokens actually run through the model

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) rows by ``index``; gradients flow back to the shared rows."""
        self.cache.batch_select_indices(index)
        self.last_logits = self.last_logits[index]
        self.mask = self.mask[index]
        self.next_position = self.next_position[index]


def prefill(model: Any, prompts: list[list[int]], pad_id: int, min_shared: int = 16) -> Prefill:
    """Read ``prompts`` into a KV cache, computing their common prefix only once.

    Prompts of one environment share a long prefix (system prompt, worked examples): it is run once
    for the whole batch and its cache copied to every row, then each row's remainder is read with
    padding between prefix and remainder (masked out; position ids stay contiguous).
    Differentiable: under autograd, gradients of every row flow back into the shared prefix.
    """
    device = next(model.parameters()).device
    cache_kw = cache_keyword(model)
    cache = DynamicCache()
    shared = common_prefix_length(prompts) if len(prompts) > 1 else 0
    shared = min(shared, min(len(p) for p in prompts) - 1)  # every row keeps >= 1 token to read
    computed = 0
    if shared >= min_shared:
        head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
        model(input_ids=head, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        cache.batch_repeat_interleave(len(prompts))
        computed += shared
    else:
        shared = 0
    ids, rest_mask = _left_pad([p[shared:] for p in prompts], pad_id)
    ids, rest_mask = ids.to(device), rest_mask.to(device)
    mask = torch.cat([torch.ones((len(prompts), shared), dtype=torch.long, device=device), rest_mask], dim=-1)
    positions = shared + (rest_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    computed += int(rest_mask.sum())
    return Prefill(cache=cache, last_logits=out.logits[:, -1, :], mask=mask,
                   next_position=mask.sum(-1), computed_tokens=computed)

