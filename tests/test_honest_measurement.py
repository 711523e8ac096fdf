"""Issue 13: learning you can trust, honest measurement, a cheaper gate.

Each test here fails without the fix it names: a seeded update, Dr.GRPO's normaliser from the trained
environments, no challenger from an update with nothing to learn, evaluation rows keyed by how they were
generated, DAPO's defaults, sealed splits, arithmetic transfer, evaluation every k updates, and
group-sequential efficacy stopping that spends the gate's error across looks.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from safetensors.torch import load_file

from evertrain.config import CampaignConfig, PromotionConfig, UpdateConfig
from evertrain.envs import registry
from evertrain.envs.arithmetic import TRAIN_PHRASINGS, TRANSFER_PHRASINGS
from evertrain.runtime import Runtime
from evertrain.stats import alpha_spent, efficacy_boundaries, z_statistic
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.evaluate import eval_problems, evaluate_sealed, evaluate_version, sealed_problems
from evertrain.tasks.promote import decide
from evertrain.tasks.update import Group, Member, gather_groups, normaliser_length, start_version_of
from tests.conftest import smoke_config_in

# --- the gate's statistics ---------------------------------------------------------------------------


def test_efficacy_boundaries_spend_the_error_across_looks():
    fractions, alpha = (0.25, 0.5, 0.75, 1.0), 0.1
    bounds = efficacy_boundaries(fractions, alpha)
    assert list(bounds) == sorted(bounds, reverse=True) and bounds[0] > 3.0  # O'Brien-Fleming: hard early
    # a challenger no better than the champion: the z statistics of a Brownian motion at the looks
    rng = np.random.default_rng(1)
    steps = np.diff((0.0, *fractions))
    z = np.cumsum(rng.standard_normal((100_000, 4)) * np.sqrt(steps), axis=1) / np.sqrt(fractions)
    sequential = float((z >= np.array(bounds)).any(axis=1).mean())
    naive = float((z >= 1.2816).any(axis=1).mean())  # P(better) >= 0.9 asked at every look
    assert sequential <= alpha + 0.005, sequential
    assert naive > 1.5 * alpha, naive  # what looking four times without spending would cost
    assert alpha_spent(0.25, alpha) < 0.002 and math.isclose(alpha_spent(1.0, alpha), alpha)


def test_gate_requires_the_sequential_boundary_and_stops_for_efficacy():
    rule = PromotionConfig(confidence=0.9, max_regression=0.2)
    # 11 wins, 5 losses on 100 problems: P(better) clears 0.9, z is about 1.5
    challenger = [1.0] * 11 + [0.0] * 5 + [0.0] * 84
    champion = [0.0] * 11 + [1.0] * 5 + [0.0] * 84
    frame = pd.DataFrame({"problem_id": [str(i) for i in range(100)], "env": "a",
                          "challenger": challenger, "champion": champion})
    assert decide(frame, rule, seed=1)["promoted"]
    kept = decide(frame, rule, seed=1, boundary=2.0)
    assert not kept["promoted"] and "group-sequential boundary" in kept["reason"]
    z = z_statistic(frame["challenger"].to_numpy(), frame["champion"].to_numpy(), frame["env"].to_numpy())
    assert 1.3 < z < 2.0
    # stopped early for efficacy: the boundary, not P(better) on the partial set, is the test
    assert decide(frame, rule, seed=1, boundary=1.3, stopped_early=True)["promoted"]


# --- the update ---------------------------------------------------------------------------------------


def test_dr_grpo_normaliser_comes_from_the_environments_trained_on(models_dir, tmp_path):
    config = smoke_config_in(tmp_path, models_dir, environments=[
        {"name": "arithmetic", "weight": 1, "max_new_tokens": 24},
        {"name": "gsm8k", "weight": 0, "max_new_tokens": 160},
        {"name": "gsm8k-tools", "weight": 0, "max_new_tokens": 100}])
    rt = SimpleNamespace(config=config, env=lambda name: registry.get(name))
    member = Member([1, 2], [0.0, 0.0], 1.0, [1, 1])
    assert normaliser_length(rt, [Group([1], [member], "arithmetic")]) == 24  # not 160: 6.7x the step
    tools = registry.get("gsm8k-tools").max_turns
    assert normaliser_length(rt, [Group([1], [member], "gsm8k-tools")]) == 100 * tools


def test_dapo_means_clip_higher_and_overlong_masking():
    dapo, grpo = UpdateConfig(algorithm="dapo"), UpdateConfig(algorithm="grpo")
    assert dapo.clip_upper == 0.28 and dapo.overlong_rule == "mask"
    assert grpo.clip_upper == 0.2 and grpo.overlong_rule == "keep"
    assert UpdateConfig(algorithm="dapo", clip_high=0.3, overlong="penalty").clip_upper == 0.3
    assert UpdateConfig(kl_reference="base").kl_reference == "base"


def test_dapo_masks_or_penalises_completions_cut_by_the_token_limit(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, name="overlong", environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=2, group_size=4, eval={"problems_per_env": 2, "sealed_problems": 0})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    # every group: rewards 0, .25, .5, .75 by sample, and its best-rewarded sample cut by the token limit
    with rt.store.transaction() as con:
        con.execute("UPDATE rollouts SET reward = sample * 0.25, "
                    "finish_reason = CASE WHEN sample = 3 THEN 'length' ELSE 'stop' END WHERE campaign = 'overlong'")

    def gathered(**update: object) -> list[Group]:
        rt.config.update = UpdateConfig(**{**config.update.model_dump(), **update})
        groups, info = gather_groups(rt, 0, start_version_of(rt, 0))
        assert info["overlong_completions"] == 2
        return groups

    kept = gathered(algorithm="grpo")
    masked = gathered(algorithm="dapo")
    penalised = gathered(algorithm="dapo", overlong="penalty")
    assert [len(g.members) for g in kept] == [4, 4] and [len(g.members) for g in penalised] == [4, 4]
    # masked: the cut completion is not trained on, but still counts in its group's baseline
    assert [len(g.members) for g in masked] == [3, 3]
    for keep, mask in zip(kept, masked, strict=True):
        assert [m.advantage for m in mask.members] == [m.advantage for m in keep.members[:3]]
    # penalised: the cut completion, the best-rewarded one, now has the lowest advantage of its group
    for group in penalised:
        advantages = [m.advantage for m in group.members]
        assert advantages[3] == min(advantages) < 0


# --- splits -------------------------------------------------------------------------------------------


def test_sealed_splits_are_disjoint_from_the_gate_and_from_training():
    for name in ("arithmetic", "gsm8k", "digits", "mbpp", "sql"):
        env = registry.get(name)
        gate = {p.id for p in env.problems("eval", 20, 0)}
        sealed = env.sealed_problems("test", 20, 0, gate=20)
        train = {p.id for p in env.problems("train", 200, 0)}
        assert sealed and all(p.split == "test" for p in sealed), name
        assert not {p.id for p in sealed} & gate and not {p.id for p in sealed} & train, name
        # the test split is stable when the gate grows (it is read from the far end of the pool)
        if (env.count("eval") or 0) >= 60:
            assert [p.id for p in env.sealed_problems("test", 5, 0, gate=40)] == [p.id for p in sealed[:5]], name


def test_arithmetic_varies_its_training_prompts_and_holds_out_a_transfer_split():
    env = registry.get("arithmetic", style="varied", ops=["+", "-"], ranges=[[0, 20], [2, 60]])
    train = env.problems("train", 300, 1)
    assert len({len(env.messages(p)) for p in train}) == 3  # 0, 1 or 2 worked examples
    templates = {t.split("{a}")[0] for t in TRAIN_PHRASINGS}
    assert sum(any(p.prompt.startswith(t) for t in templates if t) for p in train) < len(train)  # "{a} + {b} = ?"
    assert len({p.prompt.split()[0] for p in train}) >= 5
    transfer = env.sealed_problems("transfer", 60, 0, gate=100)
    heads = {t.split("{")[0] for t in TRANSFER_PHRASINGS}
    assert all(any(p.prompt.startswith(h) for h in heads) for p in transfer)
    assert all(len(env.messages(p)) == 2 for p in transfer)  # system prompt and question: no worked example
    assert any(" * " in p.payload["expr"] for p in transfer) and not any(" * " in p.payload["expr"] for p in train)
    train_texts = {p.prompt for p in env.problems("train", 5000, 2)}
    assert not any(p.prompt in train_texts for p in transfer)
    for p in train[:20] + transfer[:20]:
        assert env.verify(p, env.reference(p)).passed


# --- the loop -----------------------------------------------------------------------------------------


def _adapter(rt, iteration):
    return load_file(str(rt.checkpoint_dir(iteration) / "adapter_model.safetensors"))


def test_seeded_update_gate_every_k_generation_keys_and_sealed_splits(tmp_path, models_dir):
    config = smoke_config_in(
        tmp_path, models_dir, name="honest", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=4, group_size=4, eval={"problems_per_env": 4, "every": 2, "sealed_problems": 3},
        update={"learning_rate": 1e-2, "minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False,
                "lora": {"dropout": 0.1}},
        promotion={"bootstrap_samples": 200})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score", "update"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    first = _adapter(rt, 0)
    # a rerun of the update trains from the same fresh adapter, with the same dropout and minibatch order
    run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
    again = _adapter(rt, 0)
    assert first.keys() == again.keys() and all(bool((first[k] == again[k]).all()) for k in first)

    # eval.every = 2: iteration 0's gate does not run, and nothing counts as a failed gate
    evaluated = run_stage(rt, "evaluate", 0, STAGE_FUNCTIONS["evaluate"])
    promoted = run_stage(rt, "promote", 0, STAGE_FUNCTIONS["promote"])
    assert "every 2 updates" in evaluated["skipped"] and promoted["skipped"] == evaluated["skipped"]
    assert rt.store.query("SELECT * FROM promotions").empty
    assert rt.store.query("SELECT * FROM evals").empty
    for stage in ("curate", "rollout", "score", "update", "evaluate", "promote"):
        run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
    assert len(rt.store.query("SELECT * FROM promotions")) == 1

    # answers are reused only when generated the same way
    problems = eval_problems(rt)
    _, same = evaluate_version(rt, 1, problems, 2, "champion")
    assert same["reused"] == len(problems) and same["generated"] == 0
    longer = config.model_dump()
    longer["generation"]["max_new_tokens"] += 4
    # the same open store under a changed config (a view: it does not own, so never closes, rt's store)
    changed = Runtime(CampaignConfig.model_validate(longer), rt.store, rt.tracker, rt.envs)
    _, other = evaluate_version(changed, 1, problems, 2, "champion")
    assert other["reused"] == 0 and other["generated"] == len(problems)

    # the sealed split: measured apart, never among the gate's problems, and not seen by the gate's rerun
    sealed = sealed_problems(rt)
    assert len(sealed) == 3 and not {p.id for p in sealed} & {p.id for p in problems}
    evaluate_sealed(rt, 1, [1])
    run_stage(rt, "evaluate", 1, STAGE_FUNCTIONS["evaluate"])
    splits = rt.store.query("SELECT split, count(*) AS n FROM evals WHERE iteration = 1 GROUP BY split")
    assert dict(zip(splits["split"], splits["n"], strict=True))["test"] == 3
    run_stage(rt, "promote", 1, STAGE_FUNCTIONS["promote"])
    decision = rt.store.query("SELECT per_env FROM promotions WHERE iteration = 1")["per_env"].iloc[0]
    assert '"problems": 4' in decision  # the gate compared its own 4 problems, not the sealed 3

    # the report's learning plot: the gate's pass@1 with its interval, the sealed test pass@1 with its own
    from evertrain.data.lineage import iteration_report, sealed_curve
    from evertrain.plots import html_report, progress_figure

    curve = [p for p in sealed_curve(rt.store, "honest") if p["split"] == "test"]
    assert 1 in {p["version"] for p in curve} and all(p["problems"] == 3 for p in curve)
    passed = rt.store.query("SELECT count(*) AS n FROM evals WHERE split = 'test' AND model_version = 1 AND passed")
    mine = next(p for p in curve if p["version"] == 1)
    assert mine["pass1"] == passed["n"].iloc[0] / 3 and mine["low"] <= mine["pass1"] <= mine["high"]
    assert mine["high"] - mine["low"] > 0.3  # 3 problems: a wide interval, drawn as such
    rows = iteration_report(rt.store, "honest")
    figure = progress_figure(rows, "", curve)
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert any(label.startswith("sealed test pass@1") for label in labels), labels
    assert "gate pass@1, challenger (95% CI)" in labels and rows[-1]["gate_problems"] == 4
    bars = [c for c in figure.axes[0].containers if c.has_yerr]
    assert len(bars) == 3  # challenger, champion, sealed: each with its interval
    page = html_report("honest", rows, [], [("Curriculum levels", [], [("level", "level")], [])], sealed=curve)
    assert "Curriculum levels" not in page and "Champion against the base model" not in page  # nothing to show


def test_rotated_gate_sets_are_disjoint_held_out_and_each_gate_compares_on_its_own(tmp_path, models_dir):
    """eval.rotations = 2: the gate alternates between two disjoint sets, both kept out of training and of the
    sealed split, so a champion is judged at its next gate on problems that did not select it."""
    from evertrain.envs.quality import NgramIndex
    from evertrain.tasks.curate import RULES, select

    config = smoke_config_in(
        tmp_path, models_dir, name="rotate", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=4, group_size=4, eval={"problems_per_env": 3, "rotations": 2, "sealed_problems": 3},
        update={"learning_rate": 1e-2, "minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False},
        promotion={"bootstrap_samples": 200})
    rt = Runtime.open(config)
    first, second = [{p.id for p in eval_problems(rt, i)} for i in (0, 1)]
    assert len(first) == len(second) == 3 and not first & second
    assert {p.id for p in eval_problems(rt, 2)} == first  # the third gate takes the first set again
    assert {p.id for p in eval_problems(rt)} == first | second
    # both sets are held out: curation refuses them, and the sealed split lies beyond both
    pool = eval_problems(rt)
    dropped = dict.fromkeys(RULES, 0)
    assert select(rt, 0, rt.env("digits"), pool, len(pool), set(), NgramIndex(n=3), dropped) == []
    assert dropped["contaminated"] == 6
    assert len(sealed_problems(rt)) == 3 and not {p.id for p in sealed_problems(rt)} & (first | second)
    for iteration in (0, 1):
        for stage in ("curate", "rollout", "score", "update", "evaluate", "promote"):
            metrics = run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
            if stage == "evaluate":
                assert metrics["gate_rotation"] == iteration
    gate = rt.store.query("SELECT iteration, role, problem_id, reused_from FROM evals WHERE split = 'gate' "
                          "AND sample = 0")
    assert set(gate[gate["iteration"] == 0]["problem_id"]) == first
    assert set(gate[gate["iteration"] == 1]["problem_id"]) == second
    # the champion had never answered the second set: its answers there are new, not reused from the first gate
    champion = gate[(gate["iteration"] == 1) & (gate["role"] == "champion")]
    assert len(champion) == 3 and champion["reused_from"].isna().all()
    rt.close()


def test_an_update_with_nothing_to_learn_registers_no_challenger(tmp_path, models_dir):
    # the tiny model never writes a correct '#### <number>': every arithmetic group's rewards agree at 0
    config = smoke_config_in(
        tmp_path, models_dir, name="nothing", environments=[{"name": "arithmetic", "weight": 1}],
        problems_per_iteration=2, group_size=2, eval={"problems_per_env": 2, "sealed_problems": 0},
        update={"algorithm": "dapo", "skip_zero_variance": True, "minibatch_size": 4, "microbatch_size": 4})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    assert float(rt.store.scalar("SELECT max(reward) FROM rollouts")) == 0.0
    updated = run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
    assert "no informative group" in updated["skipped"] and updated["overlong_completions"] > 0
    assert rt.store.query("SELECT * FROM model_versions WHERE iteration = 0").empty
    evaluated = run_stage(rt, "evaluate", 0, STAGE_FUNCTIONS["evaluate"])
    promoted = run_stage(rt, "promote", 0, STAGE_FUNCTIONS["promote"])
    assert "registered no challenger" in evaluated["skipped"] and "skipped" in promoted
    assert rt.store.query("SELECT * FROM evals").empty and rt.store.query("SELECT * FROM promotions").empty
    assert rt.trainee_version() == rt.champion_version() == 1


def test_sealed_sets_measured_on_a_schedule_cost_nothing_in_between(tmp_path, models_dir):
    """eval.sealed_every = 2: the promote stage of iteration 0 measures nothing on the sealed split (whatever the
    gate decided), that of iteration 1 measures the base model and the champion in effect, once each."""
    config = smoke_config_in(
        tmp_path, models_dir, name="schedule", environments=[{"name": "digits", "weight": 1}],
        problems_per_iteration=4, group_size=4, eval={"problems_per_env": 4, "sealed_problems": 3, "sealed_every": 2},
        update={"learning_rate": 1e-2, "minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False},
        promotion={"bootstrap_samples": 200, "confidence": 0.0, "futility": 0.0})
    rt = Runtime.open(config)
    for iteration in (0, 1):
        for stage in ("curate", "rollout", "score", "update", "evaluate", "promote"):
            metrics = run_stage(rt, stage, iteration, STAGE_FUNCTIONS[stage])
        sealed = rt.store.query("SELECT model_version, count(*) AS n FROM evals WHERE split = 'test' "
                                "GROUP BY model_version")
        if iteration == 0:
            assert metrics.get("sealed_deferred") == 1.0 and sealed.empty
    decided = rt.store.query("SELECT champion_version, challenger_version, promoted FROM promotions "
                             "WHERE iteration = 1").iloc[0]
    champion = int(decided["challenger_version"] if decided["promoted"] else decided["champion_version"])
    assert dict(zip(sealed["model_version"], sealed["n"], strict=True)) == {rt.base_version(): 3, champion: 3}
    with pytest.raises(ValueError, match="sealed_every"):
        CampaignConfig.model_validate({"eval": {"every": 2, "sealed_every": 3}})
