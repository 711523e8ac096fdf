"""The project's GRPO losses agree with TRL's GRPOTrainer on the same inputs; advantages are right."""

from __future__ import annotations

import pytest
import torch

from evertrain.models.checkpoint import load_policy, write_base_checkpoint
from evertrain.models.grpo import LossNorm, group_advantages, policy_loss, zero_variance
from evertrain.models.logprobs import grouped_logprobs


def test_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = group_advantages(rewards, "grpo")
    assert torch.allclose(grpo[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.57735 + 1e-4), atol=1e-3)
    assert torch.equal(group_advantages(rewards, "dr_grpo")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert zero_variance(rewards).tolist() == [False, True]
    assert torch.equal(grpo[1], torch.zeros(4))


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory, models_dir):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tmp = tmp_path_factory.mktemp("trl")
    model, tokenizer = load_policy(write_base_checkpoint(tmp / "base", str(models_dir / "tiny-llama")))
    model.eval()

    def trainer(loss_type: str, epsilon_high: float, beta: float = 0.0) -> GRPOTrainer:
        args = GRPOConfig(output_dir=str(tmp / loss_type), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, use_cpu=True, report_to=[], loss_type=loss_type, beta=beta,
                          # evertrain's KL term is TRL's k3 estimator without TRL 1.16's default
                          # DeepSeek-V3.2 correction (the KL multiplied by the importance ratio)
                          use_bias_correction_kl=False,
                          epsilon=0.2, epsilon_high=epsilon_high, temperature=1.0, logging_strategy="no",
                          save_strategy="no")
        return GRPOTrainer(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                           args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                           processing_class=tokenizer)

    return model, tokenizer, trainer


@pytest.mark.parametrize(("loss_type", "epsilon_high", "beta"),
                         [("grpo", 0.2, 0.0), ("dapo", 0.28, 0.0), ("dr_grpo", 0.2, 0.0),
                          ("grpo", 0.2, 0.1), ("dapo", 0.28, 0.1)])  # beta > 0: the KL term against TRL's
def test_policy_loss_matches_trl(trl_setup, loss_type, epsilon_high, beta):
    model, tokenizer, make_trainer = trl_setup
    trainer = make_trainer(loss_type, epsilon_high, beta)
    trainer.model.eval()  # TRL's eval mode: no gradient-accumulation scaling of the loss
    torch.manual_seed(0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    completions = [[20, 21, 22], [23, 24, 25, 26, 27, 28], [29], [30, 31, 32, 33]]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])

    with torch.no_grad():
        ours, mask = grouped_logprobs(model, prompts, [[c] for c in completions], pad_id=pad)
        # TRL's own per-token log-probs of the same batch: the loss formulas are compared on identical inputs
        trl_logps = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            completion_ids.size(1))[0]
        # old log-probs off by up to +-0.5, so some ratios fall outside the clip range on both sides
        old = trl_logps + (torch.rand_like(trl_logps) - 0.5) * mask
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                  "completion_mask": completion_mask, "advantages": advantages, "old_per_token_logps": old,
                  "num_items_in_batch": completion_mask.sum()}
        # a reference that differs from the policy by up to +-0.4 per token, so the KL term is not zero
        ref = trl_logps + (torch.rand_like(trl_logps) - 0.5) * 0.8 * mask
        if beta:
            inputs["ref_per_token_logps"] = ref
        theirs = trainer._compute_loss(model, inputs)
        norm = LossNorm(sequences=4, tokens=int(mask.sum()), max_completion_length=8)
        mine, stats = policy_loss(trl_logps, old, advantages, mask, norm, algorithm=loss_type, clip_low=0.2,
                                  clip_high=epsilon_high, ref_logps=ref if beta else None, kl_coef=beta)
        if beta:
            assert stats["kl_ref"] > 1e-3  # the comparison exercises the KL term
            without_kl, _ = policy_loss(trl_logps, old, advantages, mask, norm, algorithm=loss_type,
                                        clip_low=0.2, clip_high=epsilon_high)
            assert abs(float(mine - without_kl)) > 1e-4
    assert 0 < stats["clip_fraction"] < 1  # the comparison exercises clipping
    torch.testing.assert_close(mine, theirs.float(), atol=1e-6, rtol=1e-5)
    # and the log-probs agree where no padding is involved (TRL takes position ids from the padded layout)
    longest = max(range(4), key=lambda i: len(prompts[i]))
    n = len(completions[longest])
    torch.testing.assert_close(ours[longest, :n], trl_logps[longest, :n].float(), atol=1e-4, rtol=1e-4)


def test_importance_correction_is_active_and_bounded_for_bf16_sampling(tmp_path, models_dir):
    """Rollouts sampled in bfloat16, the update in float32: every group is corrected against the sampler's
    behaviour log-probs; the mismatch is logged, and it is far larger than with float32 sampling."""
    import json

    from evertrain.runtime import Runtime
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage
    from tests.conftest import smoke_config_in

    found = {}
    for dtype in ("float32", "bfloat16"):
        # is_cap = 1: every token the trainer finds likelier than the sampler did is truncated, so the
        # truncation visibly fires whenever the two disagree
        config = smoke_config_in(tmp_path / dtype, models_dir, model={
            "path": "embedded:tiny", "rollout_dtype": dtype, "models_dir": str(models_dir)},
            update={"is_cap": 1.0, "minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False,
                    "learning_rate": 1e-2})
        rt = Runtime.open(config)
        for stage in ("curate", "rollout", "score"):
            run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
        metrics = run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
        stored = json.loads(rt.store.scalar("SELECT metrics FROM stage_runs WHERE stage = 'update'"))
        assert stored["mismatch_kl"] == metrics["mismatch_kl"]  # logged with the stage, so also to MLflow
        found[dtype] = metrics
    f32, bf16 = found["float32"], found["bfloat16"]
    assert f32["mismatch_kl"] < 1e-6 and f32["is_weight_max"] < 1.001  # float32 sampler and trainer agree
    assert bf16["mismatch_kl"] > 100 * max(f32["mismatch_kl"], 1e-9)
    # active: weights differ from 1 and some exceeded the cap; bounded: the mean applied weight is within the cap
    assert bf16["is_weight_max"] > 1.0 and 0 < bf16["is_clipped_share"] < 1
    assert 0 < bf16["is_weight_mean"] <= 1.0 and bf16["is_weight_mean"] != 1.0


def test_microbatches_keep_groups_whole_until_a_long_completion_would_pad_every_row():
    from evertrain.models.grpo import pack_microbatches

    def pack(groups, size=16, tokens=2048):
        return pack_microbatches(groups, size, tokens, lambda g: g[1], len, lambda g, part: (g[0], part))

    short = [("a", [[1] * 24] * 8), ("b", [[1] * 24] * 8), ("c", [[1] * 24] * 8)]
    assert [[g[0] for g in p] for p in pack(short)] == [["a", "b"], ["c"]]  # by count: groups stay whole
    # one 564-token completion (a tool's long output) in a group: 16 rows x 564 would be 9,024 padded tokens
    long = [("a", [[1] * 24] * 8), ("t", [[1] * 30] * 7 + [[1] * 564]), ("b", [[1] * 24] * 8)]
    passes = pack(long)
    for p in passes:
        rows = [m for g in p for m in g[1]]
        assert len(rows) <= 16 and len(rows) * max(len(m) for m in rows) <= 2048
    members = [m for p in passes for g in p for m in g[1]]
    assert members == [m for g in long for m in g[1]]  # every completion once, in order
    assert [g[0] for p in passes for g in p] == ["a", "t", "t", "b"]  # only the too-large group split
