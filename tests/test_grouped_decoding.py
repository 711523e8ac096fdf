"""Decoding steps attend grouped key/value heads in place (SDPA's enable_gqa) instead of transformers' per-head
copies: every policy evertrain loads decodes that way, and the samples and their log-probs are the same to the bit
as with transformers' own SDPA attention (issue 43: the copies cost more than the attention on a CPU)."""

from __future__ import annotations

import torch

from evertrain.inference.local import sample
from evertrain.models import forward
from evertrain.models.checkpoint import load_policy, write_base_checkpoint


def test_grouped_decoding_samples_exactly_what_transformers_sdpa_samples(tmp_path, models_dir, monkeypatch):
    checkpoint = write_base_checkpoint(tmp_path / "base", str(models_dir / "tiny-llama"))
    model, tokenizer = load_policy(checkpoint)
    assert model.config._attn_implementation == forward.GROUPED_DECODING
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads: the path is taken
    steps = []
    original = forward._grouped_decoding_attention

    def counted(module, query, *args, **kwargs):
        steps.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setitem(forward.AttentionInterface._global_mapping, forward.GROUPED_DECODING, counted)
    # prompts of different lengths (padding masks in every step), a group of 4 each, finished rows leaving the batch
    prompts = [tokenizer("What is 2 + 3?")["input_ids"], tokenizer("Name a colour, then stop.")["input_ids"],
               tokenizer("1 2 3")["input_ids"]]
    grouped, _ = sample(model, tokenizer, prompts, 4, max_new_tokens=12, temperature=1.0, seed=7)
    assert steps.count(1) > 0  # decoding steps went through the grouped path
    model.set_attn_implementation("sdpa")  # transformers' own attention: key/value heads copied per query head
    plain, _ = sample(model, tokenizer, prompts, 4, max_new_tokens=12, temperature=1.0, seed=7)
    for ours, theirs in zip(grouped, plain, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.completion_ids == b.completion_ids
            assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
