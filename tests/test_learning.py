"""A few GRPO updates raise the reward of a tiny model on a fixed, learnable toy environment."""

from __future__ import annotations

from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in


def test_a_few_updates_raise_the_reward(tmp_path, models_dir):
    config = smoke_config_in(
        tmp_path, models_dir, name="learn", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=8, group_size=8,
        update={"learning_rate": 1e-2, "finetune": "full", "minibatch_size": 32, "microbatch_size": 32, "epochs": 2},
    )
    rt = Runtime.open(config)
    rewards = []
    for iteration in range(6):
        for stage in ("curate", "rollout", "score", "update"):
            metrics = run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
            if stage == "score":
                rewards.append(metrics["mean_reward"])
    assert rewards[-1] > rewards[0] + 0.2, rewards
