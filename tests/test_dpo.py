"""The optional sft stage with ``sft.method = "dpo"``: (passed, failed) pairs of one group, TRL's DPOTrainer."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from evertrain.data.store import now
from evertrain.models.checkpoint import load_policy
from evertrain.models.logprobs import grouped_logprobs
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.dpo import DEFAULT_DPO_SELECT, PairCollator, selection_sql
from evertrain.tasks.sft import checkpoint_dir, checkpoint_for, sft
from tests.conftest import smoke_config_in

# verdicts per problem (in problem_id order) for the 4 samples of each group
MIXED, TAIL_PASS, ALL_PASS, ALL_FAIL = [True, False, True, False], [False, False, False, True], [True] * 4, [False] * 4
LAYOUT = [MIXED] * 5 + [ALL_PASS, ALL_FAIL, TAIL_PASS]


@pytest.fixture
def scored(tmp_path, models_dir):
    # sft.select left at its default: with dpo it becomes "groups holding both a pass and a fail"
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "digits", "weight": 1}],
                             sft={"enabled": True, "method": "dpo", "max_examples": 8, "learning_rate": 5e-3,
                                  "batch_size": 4, "epochs": 2})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    return rt


def _set_verdicts(rt, layout):
    """Overwrite the graded verdicts: problem i's samples get ``layout[i]`` (groups of known make-up)."""
    rollouts = rt.store.query("SELECT problem_id, sample FROM rollouts WHERE campaign = ? AND iteration = 0 "
                              "ORDER BY problem_id, sample", [rt.campaign])
    problems = sorted(rollouts.problem_id.unique())
    assert len(problems) == len(layout) and rollouts.groupby("problem_id").size().eq(4).all()
    passed = [layout[problems.index(r.problem_id)][int(r.sample)] for r in rollouts.itertuples()]
    rt.store.update_rollout_scores(rt.campaign, 0, pd.DataFrame({
        "problem_id": rollouts.problem_id, "sample": rollouts["sample"], "reward": [float(p) for p in passed],
        "passed": passed, "reason": "test", "detail": "{}", "scored_at": now()}))
    return problems


def _adapter(path):
    return load_file(str(path / "adapter_model.safetensors"))


def _pair_margins(model, tokenizer, pairs):
    """log p(chosen) - log p(rejected) of every pair, over the policy's tokens (the loss masks)."""
    prompts = [p["prompt"] for p in pairs]
    completions = [[p["chosen"], p["rejected"]] for p in pairs]
    with torch.no_grad():
        logps, pad_mask = grouped_logprobs(model, prompts, completions, pad_id=tokenizer.pad_token_id or 0)
    masks = [m for p in pairs for m in (p["chosen_mask"], p["rejected_mask"])]
    loss_mask = torch.zeros_like(logps)
    for i, m in enumerate(masks):
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=logps.dtype)
    sums = (logps.masked_fill(~pad_mask, 0) * loss_mask).sum(dim=1)
    return sums[0::2] - sums[1::2]


def test_dpo_pairs_a_pass_with_a_fail_of_one_group_and_prefers_the_pass(scored):
    rt = scored
    problems = _set_verdicts(rt, LAYOUT)
    assert selection_sql(rt.config.sft) == DEFAULT_DPO_SELECT
    metrics = run_stage(rt, "sft", 0, sft)
    assert metrics["pairs"] == 8 and metrics["selected"] == 16 and metrics["steps"] == 4  # 2 epochs of 2 batches
    examples = rt.store.query(
        "SELECT e.pair, e.role, e.source_iteration, e.problem_id, e.sample, r.passed, r.prompt_ids, "
        "r.completion_ids, r.loss_mask FROM sft_examples e JOIN rollouts r ON r.campaign = e.campaign "
        "AND r.iteration = e.source_iteration AND r.problem_id = e.problem_id AND r.sample = e.sample "
        "WHERE e.campaign = ? AND e.iteration = 0 ORDER BY e.pair, e.role", [rt.campaign])
    # (a) every pair: one passed rollout chosen, one failed rejected, both of one group; no rollout twice
    assert len(examples) == 16 and not examples.duplicated(["problem_id", "sample"]).any()
    assert sorted(examples.pair.unique()) == list(range(8))
    pairs = []
    for _, pair in examples.groupby("pair"):
        chosen, rejected = pair[pair.role == "chosen"].iloc[0], pair[pair.role == "rejected"].iloc[0]
        assert len(pair) == 2 and chosen.passed and not rejected.passed, pair
        assert chosen.problem_id == rejected.problem_id and chosen.source_iteration == rejected.source_iteration
        pairs.append({"group": chosen.problem_id, "prompt": list(chosen.prompt_ids),
                      "chosen": list(chosen.completion_ids), "chosen_mask": list(chosen.loss_mask),
                      "rejected": list(rejected.completion_ids), "rejected_mask": list(rejected.loss_mask)})
    groups = [p["group"] for p in pairs]
    # (c) a group of passes only, or of fails only, gives no pair; one per group first, then second pairs
    assert problems[5] not in groups and problems[6] not in groups
    assert len(set(groups[:6])) == 6 and groups[6:] == [problems[0], problems[1]]
    assert groups.count(problems[7]) == 1  # three fails but one pass: one pair
    # (b) the checkpoint the update starts from prefers each chosen completion more than the trainee did
    path = checkpoint_for(rt, 0)
    assert path == checkpoint_dir(rt, 0) and json.loads((path / "evertrain_checkpoint.json").read_text())[
        "method"] == "dpo"
    assert not (path / "ref").exists()  # TRL's frozen reference adapter is not saved with the trainee
    before, tokenizer = load_policy(rt.checkpoint(metrics["start_version"]), device="cpu")
    after, _ = load_policy(path, device="cpu")
    rose = _pair_margins(after, tokenizer, pairs) - _pair_margins(before, tokenizer, pairs)
    assert rose.mean() > 0 and (rose > 0).sum() >= 6, rose
    assert metrics["reward_margin_last"] > 0 and metrics["loss_last"] < metrics["loss_first"]


def test_dpo_without_a_pair_is_skipped_and_drops_an_earlier_checkpoint(scored):
    rt = scored
    _set_verdicts(rt, LAYOUT)
    rt.config.sft.max_examples = 1
    assert run_stage(rt, "sft", 0, sft)["pairs"] == 1 and checkpoint_for(rt, 0) is not None
    trained, before = _adapter(checkpoint_dir(rt, 0)), rt.store.counts()
    # a rerun replaces its rows and its checkpoint, and (seeded) trains the same weights
    assert run_stage(rt, "sft", 0, sft)["pairs"] == 1 and rt.store.counts() == before
    for key, value in _adapter(checkpoint_dir(rt, 0)).items():
        assert torch.allclose(value, trained[key], atol=1e-4), key
    # every group one-sided (only passes, or only fails): no pair, the stage records itself as skipped
    _set_verdicts(rt, [ALL_PASS, ALL_FAIL] * 4)
    metrics = run_stage(rt, "sft", 0, sft)
    assert metrics["pairs"] == 0 and metrics["selected"] == 0 and "skipped" in metrics
    assert rt.store.stage_status(rt.campaign, 0)["sft"] == "completed"
    assert checkpoint_for(rt, 0) is None and not checkpoint_dir(rt, 0).exists()
    assert not rt.store.scalar("SELECT count(*) FROM sft_examples WHERE campaign = ?", [rt.campaign])


def test_the_pair_collator_scores_the_policy_tokens_only():
    # a tool episode's completion: policy tokens, tool output (mask 0), policy tokens
    batch = PairCollator(pad_id=0)([{"prompt_ids": [5, 6], "chosen_ids": [7, 8, 9, 10],
                                     "chosen_mask": [1, 0, 0, 1], "rejected_ids": [11], "rejected_mask": [1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10], [5, 6, 11, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0]]
