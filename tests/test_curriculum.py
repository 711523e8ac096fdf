"""Curricula that move with the model, the broad sealed set, diversity from stored rollouts, the gate's power."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evertrain.curriculum import (
    LADDERS,
    ArithmeticLadder,
    BandLadder,
    Ladder,
    broad_ids,
    broad_problems,
    format_levels,
    ladder_for,
    levels_over_iterations,
    register_ladder,
)
from evertrain.data.lineage import diversity, diversity_metrics
from evertrain.envs import registry
from evertrain.envs.quality import NgramIndex
from evertrain.runtime import Runtime
from evertrain.stats import discordant_share, independent_discordance, min_detectable_gain
from evertrain.stats import gate_power as stats_gate_power
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in

ROOT = Path(__file__).resolve().parents[1]


def _groups(campaign: str, iteration: int, env: str, pass_rates: list[float], size: int = 4) -> list[dict]:
    """Scored rollouts: one group per pass rate, ``size`` samples each (the first round(rate * size) pass)."""
    rows = []
    for g, rate in enumerate(pass_rates):
        passes = round(rate * size)
        rows += [{"campaign": campaign, "iteration": iteration, "problem_id": f"{env}-{iteration}-{g}", "sample": s,
                  "env": env, "completion": f"c{s}", "reward": float(s < passes), "passed": s < passes}
                 for s in range(size)]
    return rows


def _config(tmp_path: Path, models_dir: Path, **curriculum: object):
    return smoke_config_in(tmp_path, models_dir, environments=[{"name": "arithmetic", "weight": 1}],
                           curriculum={"window": 4, "enabled": True, **curriculum})


def _level(rt, iteration: int, env: str = "arithmetic") -> tuple[int, str]:
    row = rt.store.query("SELECT level, action FROM curriculum WHERE campaign = ? AND iteration = ? AND env = ?",
                         [rt.campaign, iteration, env])
    assert len(row) == 1, row
    return int(row["level"].iloc[0]), str(row["action"].iloc[0])


def _numbers(rt, iteration: int) -> list[int]:
    prompts = rt.store.query("SELECT prompt FROM problems WHERE campaign = ? AND iteration = ?",
                             [rt.campaign, iteration])["prompt"]
    return [int(x) for prompt in prompts for x in re.findall(r"\d+", prompt)]


def test_level_advances_above_the_band_and_retreats_below(tmp_path, models_dir):
    rt = Runtime.open(_config(tmp_path, models_dir))
    curate = STAGE_FUNCTIONS["curate"]
    first = run_stage(rt, "curate", 0, curate)
    assert _level(rt, 0) == (0, "start") and first["curriculum_level_arithmetic"] == 0
    assert max(_numbers(rt, 0)) <= 60  # level 0: the configured generator, 2..60
    # 3 groups is fewer than the window (4): the level holds however well they did
    rt.store.append("rollouts", _groups(rt.campaign, 0, "arithmetic", [1.0, 1.0, 1.0]))
    run_stage(rt, "curate", 1, curate)
    assert _level(rt, 1) == (0, "hold")
    # a full window above the band (0.8): advance, and the iteration's problems are drawn at level 1 (2..120)
    rt.store.append("rollouts", _groups(rt.campaign, 1, "arithmetic", [1.0, 1.0, 0.75, 1.0]))
    second = run_stage(rt, "curate", 2, curate)
    assert _level(rt, 2) == (1, "advance") and second["curriculum_level_arithmetic"] == 1
    assert max(_numbers(rt, 2)) > 60
    # inside the band (0.5): hold; groups from before the level was entered do not count
    rt.store.append("rollouts", _groups(rt.campaign, 2, "arithmetic", [0.5, 0.5, 0.5, 0.5]))
    run_stage(rt, "curate", 3, curate)
    assert _level(rt, 3) == (1, "hold")
    # below the band (0.2) over the last 4 groups at level 1: retreat
    rt.store.append("rollouts", _groups(rt.campaign, 3, "arithmetic", [0.0, 0.25, 0.0, 0.0]))
    run_stage(rt, "curate", 4, curate)
    assert _level(rt, 4) == (0, "retreat")
    assert max(_numbers(rt, 4)) <= 60
    # the report section and MLflow show the level per iteration
    lines = format_levels(levels_over_iterations(rt.store, rt.campaign))
    assert lines[2] == "curriculum i=2: arithmetic 1/4 advance" and lines[4] == "curriculum i=4: arithmetic 0/4 retreat"
    runs = rt.tracker.client.search_runs([rt.tracker.experiment_id])
    assert any("curate/curriculum_level_arithmetic" in run.data.metrics for run in runs)
    from evertrain.data.lineage import iteration_report

    assert [r["curriculum_levels"] for r in iteration_report(rt.store, rt.campaign)] == [
        {"arithmetic": level} for level in (0, 0, 1, 1, 0)]


def test_disabled_curriculum_draws_as_before(tmp_path, models_dir):
    rt = Runtime.open(_config(tmp_path, models_dir, enabled=False))
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    assert rt.store.counts()["curriculum"] == 0
    env = rt.env("arithmetic")
    from evertrain.runtime import seed_for

    drawn = [p.id for p in env.problems("train", 8 * rt.config.curation.oversample, seed_for(0, 0, "arithmetic"))]
    stored = list(rt.store.query("SELECT problem_id FROM problems WHERE iteration = 0")["problem_id"])
    assert set(stored) <= set(drawn)


_CHILD = """
import sys
from evertrain.config import CampaignConfig
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
config = CampaignConfig.model_validate_json(open(sys.argv[1]).read())
run_stage(Runtime.open(config), "curate", int(sys.argv[2]), STAGE_FUNCTIONS["curate"])
"""


def test_level_survives_sigkill_and_stage_rerun(tmp_path, models_dir):
    config = _config(tmp_path, models_dir)
    rt = Runtime.open(config)
    curate = STAGE_FUNCTIONS["curate"]
    run_stage(rt, "curate", 0, curate)
    rt.store.append("rollouts", _groups(rt.campaign, 0, "arithmetic", [1.0] * 4))
    run_stage(rt, "curate", 1, curate)
    assert _level(rt, 1) == (1, "advance")
    rt.store.append("rollouts", _groups(rt.campaign, 1, "arithmetic", [1.0] * 4))
    rt.close()  # the child process must be the campaign's one writer
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    env = {**os.environ, "EVERTRAIN_PROGRESS": "0"}
    for point in ("before_commit", "end"):  # killed inside the level's write, then after the stage's writes
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path), "2"], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env={**env, "EVERTRAIN_KILL_AT": f"curate:{point}"})
        assert done.returncode == -9, done.stderr[-2000:]
    rt = Runtime.open(config)
    assert _level(rt, 1) == (1, "advance")  # what was stored before the kills is intact
    assert rt.store.stage_status(rt.campaign, 2).get("curate") != "completed"
    # the rerun (here, like a resumed campaign) decides from earlier iterations only: the same level, one row
    run_stage(rt, "curate", 2, curate)
    assert _level(rt, 2) == (2, "advance")
    rows, problems = rt.store.counts()["curriculum"], rt.store.counts()["problems"]
    run_stage(rt, "curate", 2, curate)
    assert _level(rt, 2) == (2, "advance")
    assert rt.store.counts()["curriculum"] == rows == 3 and rt.store.counts()["problems"] == problems


def test_broad_sealed_set_never_enters_curation_or_the_gate(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, curriculum={"window": 4, "broad_per_level": 6, "enabled": True},
                             environments=[{"name": "arithmetic", "weight": 1, "options": {"high": 20}},
                                           {"name": "gsm8k", "weight": 1}])
    rt = Runtime.open(config)
    curate = STAGE_FUNCTIONS["curate"]
    run_stage(rt, "curate", 0, curate)
    stored = rt.store.query("SELECT * FROM broad_sealed WHERE campaign = ?", [rt.campaign])
    arithmetic = stored[stored["env"] == "arithmetic"]
    ladder = ladder_for(rt.env("arithmetic"))
    assert ladder is not None
    assert sorted(arithmetic["level"].dropna().astype(int).unique()) == list(range(ladder.levels))
    assert set(arithmetic["source"]) == {"level", "transfer"}
    # a fixed data set has no generated levels: its broad share is its sealed test split
    assert set(stored[stored["env"] == "gsm8k"]["source"]) == {"test"}
    ids = broad_ids(rt)
    from evertrain.tasks.evaluate import eval_problems, sealed_problems

    assert ids and not ids & {p.id for p in eval_problems(rt)}  # not the gate's
    # curation refuses every broad problem offered to it, as contaminated
    from evertrain.tasks.curate import RULES, select

    offered = [p for p in broad_problems(rt) if p.env == "arithmetic"]
    dropped = dict.fromkeys(RULES, 0)
    kept = select(rt, 1, rt.env("arithmetic"), offered, len(offered), set(), NgramIndex(n=3), dropped)
    assert kept == [] and dropped["contaminated"] == len(offered)
    # a few iterations at a high level (2..2000, a small space with the broad set inside it) never train on one
    rt.store.append("rollouts", _groups(rt.campaign, 0, "arithmetic", [1.0] * 4))
    for iteration in range(1, 4):
        run_stage(rt, "curate", iteration, curate)
        rt.store.append("rollouts", _groups(rt.campaign, iteration, "arithmetic", [1.0] * 4))
    trained = set(rt.store.query("SELECT problem_id FROM problems WHERE campaign = ?", [rt.campaign])["problem_id"])
    assert _level(rt, 3)[0] == 3 and not trained & ids
    # drawn once: a later curate does not redraw it
    assert broad_ids(rt) == ids
    # measured by promote beside the sealed splits, as split 'broad', never as the gate's: also where the sealed
    # splits are off, as in this config (promote once measured nothing then, and the broad set went unmeasured)
    from evertrain.tasks.promote import _sealed

    assert not config.eval.sealed_problems and not any(s.sealed_problems for s in config.environments)
    assert _sealed(rt, 3, rt.champion_version())["sealed_problems"] == len(ids - {p.id for p in sealed_problems(rt)})
    evals = rt.store.query("SELECT split, problem_id FROM evals WHERE campaign = ? AND sample = 0", [rt.campaign])
    broad_rows = set(evals[evals["split"] == "broad"]["problem_id"])
    sealed = {p.id for p in sealed_problems(rt)}
    assert broad_rows == ids - sealed and not set(evals[evals["split"] == "gate"]["problem_id"]) & ids


def test_a_gate_across_levels_measures_every_level_and_is_never_trained_on(tmp_path, models_dir):
    """eval.levels = 'curriculum': a champion that solves the configured level can no longer hide a trainee's
    gain at higher levels (the agent campaign's gate saw +0.000 for trainees trained at levels 1-2)."""
    from evertrain.tasks.curate import RULES, select
    from evertrain.tasks.evaluate import eval_problems, slices

    config = smoke_config_in(tmp_path, models_dir, curriculum={"window": 4, "broad_per_level": 4, "enabled": True},
                             environments=[{"name": "arithmetic", "weight": 1, "options": {"high": 20}}])
    with Runtime.open(config) as configured:
        numbers = [int(x) for p in eval_problems(configured) for x in re.findall(r"\d+", p.prompt)]
    assert max(numbers) <= 20  # the configured gate: operands 2..20, all of it at level 0
    config = config.model_copy(update={"eval": config.eval.model_copy(update={"levels": "curriculum",
                                                                               "problems_per_env": 20})})
    rt = Runtime.open(config)
    gate = eval_problems(rt)
    assert len(gate) == 20 and len({p.id for p in gate}) == 20 and {p.split for p in gate} == {"eval"}
    ladder = ladder_for(rt.env("arithmetic"))
    assert ladder is not None and ladder.levels == 5  # 2..40 +, 2..40 +-, 2..200 +-, 20..2000 +-

    def spread(problems: list) -> tuple[int, bool]:
        values = [int(x) for p in problems for x in re.findall(r"\d+", p.prompt)]
        return max(values), any(" - " in p.prompt or "minus" in p.prompt.lower() for p in problems)

    assert spread(gate)[0] > 200 and spread(gate)[1]  # the top level's operands, and the subtraction levels
    # the first of two sequential looks already holds a share of every level, not only level 0's problems
    first = slices(gate, 2)[0]
    assert len(first) == 10 and spread(first)[0] > 200 and spread(first)[1]
    assert any(max(int(x) for x in re.findall(r"\d+", p.prompt)) <= 20 for p in first)
    # curation refuses every gate problem offered to it, at any level, as contaminated
    dropped = dict.fromkeys(RULES, 0)
    kept = select(rt, 1, rt.env("arithmetic"), gate, len(gate), set(), NgramIndex(n=3), dropped)
    assert kept == [] and dropped["contaminated"] == len(gate)
    # the broad sealed set is drawn around the gate's problems, and a curate at the top level trains on none
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    assert broad_ids(rt) and not broad_ids(rt) & {p.id for p in gate}
    # a pure function of the config: the same problems in a fresh runtime (a rerun, a resumed campaign)
    from evertrain.curriculum import gate_problems

    assert [p.id for p in gate_problems(registry.get("arithmetic", high=20), config)] == [p.id for p in gate]


def test_levels_whose_answers_the_turn_limit_cuts_off_are_not_climbed(tmp_path, models_dir):
    """At 24 tokens a turn the agent campaign could not close a level-3 or level-4 tool call (33 and 45 tokens with
    SmolLM2's tokenizer): those levels could only fail. The ladder stops below them, and says why."""
    from evertrain.curriculum import reachable_top, reference_turn_tokens

    env = registry.get("calculator")
    ladder = ladder_for(env)
    assert ladder is not None and ladder.levels == 5

    def chars(text: str) -> int:  # any counter will do for the rule: characters here
        return len(text)

    def median(level: int) -> int:
        needs = sorted(reference_turn_tokens(env, p, chars) for p in ladder.problems(level, 16, 3, lambda ids: {}))
        return needs[len(needs) // 2]

    assert median(0) < median(2) < median(4)  # more operands, more digits: longer calls
    assert reachable_top(ladder, 10_000, chars, 3) == (4, None)
    top, why = reachable_top(ladder, median(2), chars, 3)
    assert 2 <= top < 4 and f"capped at level {top}" in why and "max_new_tokens" in why
    assert reachable_top(ladder, 1, chars, 3)[0] == 0  # level 0 is never capped: the configured problems stay
    # in a campaign: the stored level stops at the cap however well the groups pass, and the reason says why
    config = smoke_config_in(tmp_path, models_dir, curriculum={"window": 4, "enabled": True},
                             environments=[{"name": "calculator", "weight": 1, "max_new_tokens": 4}])
    with Runtime.open(config) as rt:
        curate = STAGE_FUNCTIONS["curate"]
        first = run_stage(rt, "curate", 0, curate)
        assert first["curriculum_capped_calculator"] == 0
        rt.store.append("rollouts", _groups(rt.campaign, 0, "calculator", [1.0] * 4))
        run_stage(rt, "curate", 1, curate)
        level, action = _level(rt, 1, "calculator")
        row = rt.store.query("SELECT max_level, reason FROM curriculum WHERE campaign = ? AND iteration = 1",
                             [rt.campaign])
        assert (level, action) == (0, "hold") and int(row["max_level"].iloc[0]) == 0
        assert "over the turn limit of 4" in row["reason"].iloc[0]
    # a gate across the levels leaves the capped ones out: both models could only score 0 on them
    from evertrain.curriculum import gate_problems

    gated = config.model_copy(update={"eval": config.eval.model_copy(update={"levels": "curriculum",
                                                                              "problems_per_env": 20})})

    def operands(problems: list) -> int:
        return max(len(re.findall(r"\d+", p.prompt)) for p in problems)

    capped = gate_problems(registry.get("calculator"), gated)
    assert len(capped) == 20 and operands(capped) == 2
    assert [p.id for p in capped] == [p.id for p in registry.get("calculator").problems("eval", 20, gated.seed)]
    roomy = gated.model_copy(update={"environments": [gated.environments[0].model_copy(
        update={"max_new_tokens": 400})]})
    assert operands(gate_problems(registry.get("calculator"), roomy)) == 4


def test_diversity_from_stored_rollouts_with_known_duplicates(tmp_path, models_dir):
    rt = Runtime.open(_config(tmp_path, models_dir))
    c = rt.campaign

    def row(problem: str, sample: int, completion: str, reward: float, logprobs: list[float], mask: list[int]):
        return {"campaign": c, "iteration": 5, "problem_id": problem, "sample": sample, "env": "arithmetic",
                "policy_version": 1, "completion": completion, "reward": reward, "passed": reward == 1.0,
                "logprobs": logprobs, "loss_mask": mask}

    rt.store.append("rollouts", [
        # group a: 3 copies of one answer and 1 other, rewards disagree; a tool token (mask 0, log-prob 0)
        row("a", 0, "#### 5", 1.0, [-0.5, -1.5, 0.0], [1, 1, 0]),
        row("a", 1, "#### 5", 1.0, [-0.5, -1.5, 0.0], [1, 1, 0]),
        row("a", 2, "#### 5", 1.0, [-0.5, -1.5, 0.0], [1, 1, 0]),
        row("a", 3, "#### 7", 0.0, [-2.0, -4.0, 0.0], [1, 1, 0]),
        # group b: 4 copies of the same wrong answer: no signal
        *[row("b", s, "#### 9", 0.0, [-0.25, -0.25], [1, 1]) for s in range(4)],
        # an unscored rollout does not count
        {"campaign": c, "iteration": 5, "problem_id": "z", "sample": 0, "env": "arithmetic", "policy_version": 1,
         "completion": "x"},
    ])
    [got] = diversity(rt.store, c, 5)
    assert got["groups"] == 2
    assert got["distinct_completions"] == pytest.approx(1.5)  # (2 + 1) / 2
    assert got["distinct_share"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert got["informative_share"] == pytest.approx(0.5)
    # -mean log-prob of the 16 policy tokens: (3 * 2.0 + 6.0 + 4 * 0.5) / 16
    assert got["token_entropy"] == pytest.approx((3 * 2.0 + 6.0 + 4 * 0.5) / 16)
    metrics = diversity_metrics(rt.store, c, 5)
    assert metrics["diversity_distinct_completions"] == pytest.approx(1.5)
    assert diversity_metrics(rt.store, c, 6) == {}
    # the score stage records them from the store, into stage_runs and MLflow (here a score stage that
    # graded nothing new: the metrics come from the rollouts as stored)
    recorded = run_stage(rt, "score", 5, lambda rt, iteration: {})
    assert recorded["diversity_informative_share"] == pytest.approx(0.5)
    runs = rt.tracker.client.search_runs([rt.tracker.experiment_id])
    assert any(run.data.metrics.get("score/diversity_distinct_completions") == 1.5 for run in runs)


def test_gate_power_is_the_paired_test_solved_for_the_gain():
    from statistics import NormalDist

    gain = min_detectable_gain(100, 0.1, 0.8, 0.3)
    assert gain is not None and 0.05 < gain < 0.3
    z_a, z_b = NormalDist().inv_cdf(0.9), NormalDist().inv_cdf(0.8)
    needed = (z_a * 0.3 ** 0.5 + z_b * (0.3 - gain ** 2) ** 0.5) ** 2 / gain ** 2
    assert needed == pytest.approx(100, rel=1e-3)  # the formula, solved back
    bigger = min_detectable_gain(400, 0.1, 0.8, 0.3)
    assert bigger is not None and bigger < gain / 1.8  # 4x the problems: about half the gain
    assert min_detectable_gain(3, 0.1, 0.8, 0.05) is None  # too few problems to see anything
    # the report's inputs: the measured discordant share, else the independent one at the champion's pass@1
    assert discordant_share([1, 1, 0, 0], [1, 0, 1, 0]) == 0.5
    assert independent_discordance(0.9, 100) == pytest.approx(0.18)
    assert independent_discordance(None, 100) == 0.5 and independent_discordance(1.0, 40) == 1 / 40
    assert stats_gate_power(100, 0.1, 0.8, 0.3) == {
        "min_gain": gain, "min_gain_2x": min_detectable_gain(200, 0.1, 0.8, 0.3), "min_gain_4x": bigger}


def test_generator_levels_grade_their_own_references():
    for name, options in [("arithmetic", {}), ("arithmetic", {"style": "varied"}), ("calculator", {}),
                          ("rg:basic_arithmetic", {})]:
        env = registry.get(name, **options)
        ladder = ladder_for(env)
        assert ladder is not None and ladder.levels >= 4
        for level in range(ladder.levels):
            problems = ladder.problems(level, 6, seed=3, history=lambda ids: {})
            assert problems and all(p.env == env.name and p.split == "train" for p in problems)
            for problem in problems[:3]:
                assert env.verify(problem, env.reference(problem) or "").passed, (name, level, problem)
                assert not env.verify(problem, "#### 0").passed or problem.payload.get("answer") == "0"
    arithmetic = registry.get("arithmetic")
    ladder = ladder_for(arithmetic)
    ops = {p.payload.get("expr", p.prompt).split()[-2] for level in range(ladder.levels)
           for p in ladder.problems(level, 40, seed=1, history=lambda ids: {})}
    assert "*" not in ops  # the transfer split's operator is never trained on at any level
    # reasoning-gym's caesar_cipher curriculum asks a rotation of 50 from its level 2, which its own config
    # refuses: the ladder stops below the first level the generator cannot build
    assert ladder_for(registry.get("rg:caesar_cipher")).levels == 2
    # a reasoning-gym config that fixes a field the curriculum moves keeps that difficulty: no ladder
    assert ladder_for(registry.get("rg:basic_arithmetic", config={"max_terms": 3})) is None


def test_band_levels_order_by_measured_pass_rate():
    env = registry.get("gsm8k")
    ladder = ladder_for(env)
    assert isinstance(ladder, BandLadder) and ladder.start == 1
    pool = env.problems("train", 8, 5)
    assert [p.id for p in ladder.problems(1, 4, 5, lambda ids: {})] == [p.id for p in env.problems("train", 4, 5)]
    drawn = ladder.problems(0, 4, 5, lambda ids: {})
    rates = {drawn[-1].id: 1.0, drawn[-2].id: 0.0}
    easy, hard = ladder.problems(0, 4, 5, lambda ids: rates), ladder.problems(2, 4, 5, lambda ids: rates)
    assert easy[0].id == drawn[-1].id and easy[-1].id == drawn[-2].id
    assert hard[0].id == drawn[-2].id and hard[-1].id == drawn[-1].id
    assert pool  # the pool is the environment's own


def test_terminal_level_zero_tasks_pass_their_reference_and_nothing_else():
    from evertrain.envs.terminal_levels import TEMPLATES, task_names

    env = registry.get("terminal")
    ladder = ladder_for(env)
    assert ladder is not None and ladder.levels == 3
    problems = ladder.problems(0, 2 * len(TEMPLATES), seed=0, history=lambda ids: {})
    templates = {p.payload["task"].split(":")[1] for p in problems}
    assert templates == set(TEMPLATES)
    seen = set()
    for problem in problems:
        template = problem.payload["task"].split(":")[1]
        if template in seen:
            continue
        seen.add(template)
        assert env.verify(problem, env.reference(problem) or "").passed, problem.payload["task"]
        assert not env.verify(problem, "Done.").passed
        assert not env.verify(problem, "<bash>\nls\n</bash>").passed
    # level 1 is the vendored one-command tasks, level 2 all vendored training tasks (code fixes included)
    one = {p.payload["task"] for p in ladder.problems(1, 40, 0, lambda ids: {})}
    every = {p.payload["task"] for p in ladder.problems(2, 60, 0, lambda ids: {})}
    assert not any(name.startswith("fix-") for name in one) and any(name.startswith("fix-") for name in every)
    assert task_names(5, 1) == task_names(5, 1) != task_names(5, 2)


def test_terminal_generated_held_out_tasks_are_new_tasks_of_the_trained_kinds():
    """held_out = "generated": the gate's and the sealed test split's tasks are level-0 kinds with names, words and
    folders no training task uses; curation keeps them out by id; each passes its reference and nothing else."""
    from evertrain.envs.terminal_levels import TEMPLATES, generated_spec, task_names

    env = registry.get("terminal", held_out="generated")
    assert env.templated and not registry.get("terminal").templated
    with pytest.raises(ValueError, match="held_out"):
        registry.get("terminal", held_out="everything")
    gate = env.problems("eval", 18, 0)
    sealed = env.sealed_problems("test", 18, 0, 18)
    assert env.count("eval") is None and [p.payload["task"] for p in env.problems("eval", 9, 0)] == \
        [p.payload["task"] for p in gate[:9]]  # a prefix: the gate's size moves nothing else
    assert {p.id for p in gate}.isdisjoint({p.id for p in sealed}) and len({p.id for p in gate + sealed}) == 36
    assert {p.payload["task"].split(":")[1] for p in gate} == set(TEMPLATES)

    def words(problems: list) -> set[str]:
        return {w for p in problems for w in re.findall(r"[a-z]+", p.prompt + " ".join(p.payload["files"]))}

    training = [p for seed in range(20) for p in ladder_for(env).problems(0, 18, seed, lambda ids: {})]
    names = {"notes", "todo", "report", "draft", "list", "summary", "plan", "data", "memo", "ideas", "tasks",
             "backup", "archive", "docs", "old", "src", "out", "apple", "river", "stone", "cloud", "maple"}
    assert words(training) & names and not words(gate + sealed) & names  # its own vocabulary (.log: an extension)
    assert not {generated_spec(p.payload["task"])["prompt"] for p in gate + sealed} & {p.prompt for p in training}
    assert not {p.payload["task"] for p in gate + sealed} & set(task_names(500, 0))
    for problem in gate[:len(TEMPLATES)]:
        assert env.verify(problem, env.reference(problem) or "").passed, problem.payload["task"]
        assert not env.verify(problem, "<bash>\nls\n</bash>").passed


def test_an_environment_outside_the_project_brings_its_own_ladder(monkeypatch):
    """An environment declares its ladder by registering it for its class (no switch over the project's classes to
    edit); its subclasses inherit it, a registration of the subclass itself wins, and the project's own are there."""
    from evertrain.envs.arithmetic import Arithmetic
    from evertrain.envs.base import Problem

    class Outside(Arithmetic):  # as a plugin package would subclass a project environment, or Environment itself
        name = "outside"

    class TwoSteps(Ladder):
        levels = 2

        def problems(self, level: int, n: int, seed: int, history) -> list[Problem]:
            return [Problem("outside", f"o{level}-{i}", f"step {level}", {"answer": str(level)}) for i in range(n)]

        def describe(self, level: int) -> str:
            return f"step {level}"

    monkeypatch.setattr("evertrain.curriculum.LADDERS", dict(LADDERS))  # the registry as it was, after the test
    assert isinstance(ladder_for(Outside()), ArithmeticLadder)  # inherited from the project's Arithmetic
    register_ladder(Outside, TwoSteps)
    ladder = ladder_for(Outside())
    assert isinstance(ladder, TwoSteps) and ladder.levels == 2
    assert [p.id for p in ladder.problems(1, 2, 0, lambda ids: {})] == ["o1-0", "o1-1"]
    assert isinstance(ladder_for(registry.get("arithmetic")), ArithmeticLadder)  # the project's own: unchanged
