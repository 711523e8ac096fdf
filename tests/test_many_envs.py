"""A campaign mixing twenty environments, reasoning-gym's and the project's own, runs a full iteration."""

from __future__ import annotations

import json

from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in

OWN = ["arithmetic", "gsm8k", "digits", "mbpp", "sql", "gsm8k-tools"]
RG = ["basic_arithmetic", "chain_sum", "leg_counting", "word_sorting", "spell_backward", "products",
      "number_sorting", "count_primes", "lcm", "base_conversion", "caesar_cipher", "simple_equations",
      "fraction_simplification", "count_bits"]


def test_twenty_environment_campaign_runs_an_iteration(tmp_path, models_dir):
    environments = [{"name": name, "weight": 1} for name in OWN]
    environments += [{"name": f"rg:{name}", "weight": 1, "options": {"eval_size": 4}} for name in RG]
    assert len(environments) == 20
    config = smoke_config_in(tmp_path, models_dir, name="mix", environments=environments,
                             problems_per_iteration=20, group_size=2, eval={"problems_per_env": 1},
                             generation={"max_new_tokens": 8, "temperature": 1.0})
    rt = Runtime.open(config)
    for stage in STAGES:
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    store = rt.store
    per_env = store.query("SELECT env, count(*) AS n, count(reward) AS scored FROM rollouts GROUP BY env")
    assert len(per_env) == 20 and (per_env["n"] == 2).all() and (per_env["scored"] == 2).all()
    assert len(store.query("SELECT DISTINCT env FROM evals")) == 20
    validated = store.query("SELECT env, ok FROM env_validations")
    assert len(validated) == 20 and validated["ok"].all()
    # sandboxed graders (mbpp, reasoning-gym scorers) left their audit rows
    purposes = set(store.query("SELECT DISTINCT purpose FROM sandbox_runs")["purpose"])
    assert {"candidate", "tests", "rg-scorer"} <= purposes
    metrics = json.loads(store.scalar("SELECT metrics FROM stage_runs WHERE stage = 'curate'"))
    assert metrics["problems"] == 20
