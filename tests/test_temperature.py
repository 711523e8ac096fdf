"""The entropy-targeted temperature (generation.target_entropy): an iteration whose samples collapsed makes the next
sample hotter, within bounds, read from the stored rollouts only (reruns and refills keep the first temperature)."""

from __future__ import annotations

import pytest
import torch

from evertrain.config import ConfigError, load_config
from evertrain.models.checkpoint import load_policy
from evertrain.models.logprobs import grouped_logprobs
from evertrain.runtime import Runtime
from evertrain.tasks.rollout import next_temperature
from tests.conftest import ROOT, smoke_config_in


def test_the_temperature_rises_below_the_target_falls_above_twice_it_and_stays_in_bounds():
    up = {"low": 0.8, "high": 1.5, "step": 1.25}
    assert next_temperature(0.8, 0.05, 0.3, **up) == 1.0
    assert next_temperature(1.4, 0.05, 0.3, **up) == 1.5  # capped
    assert next_temperature(1.0, 0.45, 0.3, **up) == 1.0  # inside the band [target, 2 x target]: unchanged
    assert next_temperature(1.25, 0.7, 0.3, **up) == 1.0
    assert next_temperature(0.9, 0.7, 0.3, **up) == 0.8  # never below the configured temperature


def test_a_campaign_samples_hotter_after_its_entropy_fell_and_trains_at_the_stored_temperature(tmp_path, models_dir):
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    # a target no sampler reaches: every iteration is "collapsed", so the temperature climbs to its cap
    config = smoke_config_in(
        tmp_path, models_dir, name="hot", environments=[{"name": "digits", "weight": 1}], problems_per_iteration=4,
        generation={"max_new_tokens": 12, "temperature": 0.8, "target_entropy": 100.0, "max_temperature": 1.1,
                    "temperature_step": 1.2},
        update={"finetune": "full", "learning_rate": 1e-3, "minibatch_size": 16, "microbatch_size": 16})
    rt = Runtime.open(config)
    updates = []
    for iteration in range(3):
        for stage in ("curate", "rollout", "score", "update"):
            metrics = run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
        updates.append(metrics)
    stored = rt.store.query("SELECT iteration, min(temperature) AS low, max(temperature) AS high FROM rollouts "
                            "GROUP BY 1 ORDER BY 1")
    assert stored["low"].tolist() == pytest.approx([0.8, 0.96, 1.1])
    assert stored["low"].tolist() == stored["high"].tolist()
    # the samples were drawn at that temperature: their stored log-probs are the policy's at 1.1, not at 0.8
    rows = rt.store.query("SELECT prompt_ids, completion_ids, logprobs, policy_version FROM rollouts "
                          "WHERE iteration = 2 ORDER BY problem_id, sample LIMIT 4")
    model, _ = load_policy(rt.checkpoint(int(rows["policy_version"].iloc[0])))
    stored = torch.tensor([float(x) for row in rows["logprobs"] for x in row])

    def at(temperature: float) -> torch.Tensor:
        logps, mask = grouped_logprobs(model, [list(p) for p in rows["prompt_ids"]],
                                       [[list(c)] for c in rows["completion_ids"]], temperature=temperature)
        return logps[mask.bool()]

    assert (at(1.1) - stored).abs().max() < 1e-4
    assert (at(0.8) - stored).abs().mean() > 10 * (at(1.1) - stored).abs().mean()
    assert all(m["groups"] > 0 for m in updates)
    # a rerun samples at the iteration's first temperature, not one step further
    assert run_stage(rt, "rollout", 1, STAGE_FUNCTIONS["rollout"])["temperature"] == pytest.approx(0.96)
    assert rt.store.scalar("SELECT DISTINCT temperature FROM rollouts WHERE iteration = 1") == pytest.approx(0.96)
    rt.close()


def test_a_max_temperature_below_the_temperature_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text((ROOT / "configs" / "smoke.toml").read_text().replace(
        "temperature = 1.0", "temperature = 1.0\ntarget_entropy = 0.3\nmax_temperature = 0.9"))
    with pytest.raises(ConfigError, match="max_temperature"):
        load_config(path)
