"""Properties of the update's loss that the TRL comparison does not cover: gradient accumulation over
microbatches equals one big batch, and tokens the policy did not write (tool results) get no gradient."""

from __future__ import annotations

import pytest
import torch

from evertrain.models.checkpoint import load_policy, write_base_checkpoint
from evertrain.models.grpo import LossNorm, policy_loss
from evertrain.models.logprobs import grouped_logprobs

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
COMPLETIONS = [[[20, 21, 22], [23, 24, 25, 26], [27], [28, 29]], [[30, 31], [32, 33, 34, 35, 36], [37, 38, 39], [40]]]
ADVANTAGES = [[1.0, -0.5, 0.7, -1.2], [0.3, -0.9, 1.1, -0.5]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, models_dir):
    base = write_base_checkpoint(tmp_path_factory.mktemp("losses") / "base", str(models_dir / "tiny-llama"))
    model, tokenizer = load_policy(base, trainable=True, finetune="full", device="cpu")
    reference, _ = load_policy(base, trainable=False, device="cpu")
    with torch.no_grad():  # move the trainee off the reference so ratios and the KL term are not trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model, reference, tokenizer.pad_token_id


def _grads(model, reference, pad, groups: list[int], norm: LossNorm, algorithm: str) -> dict[str, torch.Tensor]:
    """Accumulated gradients of the loss over ``groups``, one backward pass per group (a microbatch each)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    for g in groups:
        new, mask = grouped_logprobs(model, [PROMPTS[g]], [COMPLETIONS[g]], pad_id=pad)
        with torch.no_grad():
            ref, _ = grouped_logprobs(reference, [PROMPTS[g]], [COMPLETIONS[g]], pad_id=pad)
        old = (new.detach() + 0.3 * torch.sin(torch.arange(new.numel()).reshape(new.shape))) * mask
        loss, _ = policy_loss(new, old, torch.tensor(ADVANTAGES[g]), mask, norm, algorithm=algorithm,
                              ref_logps=ref, kl_coef=0.05)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _whole_batch_grads(model, reference, pad, norm: LossNorm, algorithm: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    new, mask = grouped_logprobs(model, PROMPTS, COMPLETIONS, pad_id=pad)
    with torch.no_grad():
        ref, _ = grouped_logprobs(reference, PROMPTS, COMPLETIONS, pad_id=pad)
    # the same "old" log-probs as the microbatched run: row by row, the same formula
    olds = []
    for g in range(2):
        part = new[4 * g:4 * g + 4].detach()
        width = max(len(c) for c in COMPLETIONS[g])
        olds.append(part[:, :width] + 0.3 * torch.sin(torch.arange(4 * width).reshape(4, width)))
    old = torch.zeros_like(new)
    for g, o in enumerate(olds):
        old[4 * g:4 * g + 4, :o.shape[1]] = o
    old = old * mask
    loss, _ = policy_loss(new, old, torch.tensor(ADVANTAGES[0] + ADVANTAGES[1]), mask, norm, algorithm=algorithm,
                          ref_logps=ref, kl_coef=0.05)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_gradient_accumulation_equals_one_big_batch(tiny, algorithm):
    model, reference, pad = tiny
    tokens = sum(len(c) for group in COMPLETIONS for c in group)
    norm = LossNorm(sequences=8, tokens=tokens, max_completion_length=6)
    accumulated = _grads(model, reference, pad, [0, 1], norm, algorithm)
    whole = _whole_batch_grads(model, reference, pad, norm, algorithm)
    assert accumulated.keys() == whole.keys() and accumulated
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_tool_result_tokens_get_zero_gradient(algorithm):
    """In a multi-turn episode the tool's answer sits among the policy's tokens with loss_mask 0 (the update
    ANDs it into the mask): the loss must not push on those tokens, KL term included."""
    torch.manual_seed(1)
    new = torch.randn(2, 6, requires_grad=True)
    old = (new.detach() + 0.1 * torch.randn(2, 6))
    ref = new.detach() + 0.2 * torch.randn(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 2:4] = False  # a tool result in the middle of the first completion
    mask[1, 5] = False  # and a padding position
    loss, _ = policy_loss(new, old, torch.tensor([0.8, -0.6]), mask, LossNorm(2, int(mask.sum()), 6),
                          algorithm=algorithm, ref_logps=ref, kl_coef=0.1)
    loss.backward()
    assert torch.all(new.grad[~mask] == 0)
    assert torch.all(new.grad[mask] != 0)
    # and changing the masked tokens' log-probs does not change the loss
    moved = new.detach().clone()
    moved[~mask] += 5.0
    again, _ = policy_loss(moved, old, torch.tensor([0.8, -0.6]), mask, LossNorm(2, int(mask.sum()), 6),
                           algorithm=algorithm, ref_logps=ref, kl_coef=0.1)
    torch.testing.assert_close(again, loss.detach())
