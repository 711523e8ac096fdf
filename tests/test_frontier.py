"""The frontier (evertrain.frontier): guidance for kinds that fail every sample, withdrawn as they learn; candidates
predicted uninformative skipped; everything decided from the store, so reruns and resumed campaigns agree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

from evertrain.curriculum import broad_problems, ensure_broad, gate_problems
from evertrain.data.lineage import iteration_report
from evertrain.data.store import now
from evertrain.envs import registry
from evertrain.frontier import predicted
from evertrain.models.checkpoint import encode_chat
from evertrain.report import format_frontier
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"style": "varied", "ops": ["+", "-"], "ranges": [[0, 20], [2, 60]]}
NEG, POS = "- 2d neg", "+ 2d"


def _config(tmp_path: Path, models_dir: Path, **frontier: object):
    return smoke_config_in(tmp_path, models_dir, problems_per_iteration=24,
                           environments=[{"name": "arithmetic", "weight": 1, "options": OPTIONS}],
                           frontier={"enabled": True, "window": 4, "min_groups": 2, **frontier},
                           curriculum={"broad_per_level": 2})


def _plant(rt, iteration: int, kind: str, pass_counts: list[int], guidance: int = 0, size: int = 4) -> None:
    """Scored groups of ``kind`` at ``iteration`` (problems rows with the kind and guidance level, and rollouts):
    one group per pass count."""
    problems, rollouts = [], []
    for g, passes in enumerate(pass_counts):
        pid = f"planted-{iteration}-{kind}-{guidance}-{g}"
        problems.append({"campaign": rt.campaign, "iteration": iteration, "problem_id": pid, "env": "arithmetic",
                         "split": "train", "prompt": "planted", "payload": "{}", "messages": "[]",
                         "created_at": now(), "refill_round": 0, "kind": kind, "guidance": guidance})
        rollouts += [{"campaign": rt.campaign, "iteration": iteration, "problem_id": pid, "sample": s,
                      "env": "arithmetic", "completion": f"c{s}", "reward": float(s < passes), "passed": s < passes}
                     for s in range(size)]
    rt.store.append("problems", problems)
    rt.store.append("rollouts", rollouts)


def _problems(rt, iteration: int) -> pd.DataFrame:
    return rt.store.query("SELECT problem_id, kind, guidance, predicted_informative, payload, messages FROM problems "
                          "WHERE campaign = ? AND iteration = ? AND prompt <> 'planted' ORDER BY problem_id",
                          [rt.campaign, iteration])


def _state(rt, iteration: int, kind: str) -> tuple[int, str]:
    row = rt.store.query("SELECT level, action FROM frontier WHERE campaign = ? AND iteration = ? AND kind = ?",
                         [rt.campaign, iteration, kind])
    assert len(row) == 1, row
    return int(row["level"].iloc[0]), str(row["action"].iloc[0])


def test_a_kind_failing_every_sample_gets_a_hint_and_loses_it_as_its_pass_rate_rises(tmp_path, models_dir):
    config = _config(tmp_path, models_dir, bare_share=0.5)
    rt = Runtime.open(config)
    curate = STAGE_FUNCTIONS["curate"]
    run_stage(rt, "curate", 0, curate)
    first = _problems(rt, 0)
    assert set(first["kind"]) >= {NEG, POS} and (first["guidance"] == 0).all()
    assert all(json.loads(m)[-1]["role"] == "user" for m in first["messages"])
    # every sample of the negative differences failed; the sums pass half the time
    _plant(rt, 0, NEG, [0, 0, 0])
    _plant(rt, 0, POS, [2, 2, 2])
    metrics = run_stage(rt, "curate", 1, curate)
    assert _state(rt, 1, NEG) == (1, "raise") and _state(rt, 1, POS) == (0, "hold")
    rows = _problems(rt, 1)
    neg = rows[rows["kind"] == NEG]
    assert len(neg) >= 2 and (neg["guidance"] == 1).all()  # no bare probe while the hint has not worked yet
    assert metrics["guided_share"] > 0
    for row in neg.itertuples():
        payload, chat = json.loads(row.payload), json.loads(row.messages)
        prefix = payload["guidance"]["prefix"]
        assert prefix.endswith("= -(") and chat[-1] == {"role": "assistant", "content": prefix}
        assert not re.search(rf"(?<![\d-]){re.escape(payload['answer'])}(?!\d)", prefix)  # a foothold, no answer
    for row in rows[rows["kind"] != NEG].itertuples():  # the other kinds are asked bare
        assert "guidance" not in json.loads(row.payload) and json.loads(row.messages)[-1]["role"] == "user"
    # guided, it passes a quarter of its samples: the level holds, and some of its problems are asked bare (probes)
    _plant(rt, 1, NEG, [1, 1, 1], guidance=1)
    run_stage(rt, "curate", 2, curate)
    assert _state(rt, 2, NEG) == (1, "hold")
    neg = _problems(rt, 2).query("kind == @NEG")
    assert set(neg["guidance"]) == {0, 1}
    # guided at level 1 it now passes 3 of 4: the guidance is withdrawn, the problems are asked bare again
    _plant(rt, 2, NEG, [3, 3, 3], guidance=1)
    run_stage(rt, "curate", 3, curate)
    assert _state(rt, 3, NEG) == (0, "withdraw")
    assert (_problems(rt, 3)["guidance"] == 0).all()
    # a kind still failing at level 1 climbs to level 2: the partial answer says more (the reversed difference)
    _plant(rt, 3, NEG, [0, 0])
    run_stage(rt, "curate", 4, curate)
    assert _state(rt, 4, NEG) == (1, "raise")
    _plant(rt, 4, NEG, [0, 0], guidance=1)
    run_stage(rt, "curate", 5, curate)
    assert _state(rt, 5, NEG) == (2, "raise")
    stronger = _problems(rt, 5).query("guidance == 2")
    assert len(stronger) and all(json.loads(p)["guidance"]["prefix"].endswith(") = -") for p in stronger["payload"])
    # no hint ever reaches a held-out set: the gate's, the sealed splits' and the broad set's problems are bare
    env = rt.env("arithmetic")
    ensure_broad(rt)
    held = gate_problems(env, config) + [p for split in ("test", "transfer")
                                         for p in env.sealed_problems(split, 20, config.seed, 20)]
    held += broad_problems(rt)
    assert held and all("guidance" not in p.payload and env.guided_messages(p)[-1]["role"] == "user"
                        for p in held)
    trained = set(rt.store.query("SELECT problem_id FROM problems WHERE campaign = ? AND guidance > 0",
                                 [rt.campaign])["problem_id"])
    assert trained and not trained & {p.id for p in held}
    # shown per iteration: the report's frontier lines and MLflow's curve over iterations
    lines = format_frontier(iteration_report(rt.store, rt.campaign))
    assert any(line.startswith("frontier i=1: predicted informative") and "guided" in line for line in lines), lines
    history = rt.tracker.client.get_metric_history(rt.tracker.campaign_run(), "curate/guided_share")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4, 5] and max(m.value for m in history) > 0


def test_hint_tokens_are_prompt_and_carry_no_policy_gradient(tmp_path, models_dir):
    """The update trains on log-probs of completion tokens only: a guided rollout's partial answer (written for the
    policy, which continued it) lies in its prompt ids, never among the tokens the loss weighs (this fails if the
    prefix were stored as part of the completion)."""
    import torch

    from evertrain.models.checkpoint import load_policy
    from evertrain.models.logprobs import grouped_logprobs
    from evertrain.tasks.update import gather_groups

    config = _config(tmp_path, models_dir)
    rt = Runtime.open(config)
    rt.ensure_started()
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    _plant(rt, 0, NEG, [0, 0, 0])
    _plant(rt, 0, POS, [2, 2, 2])
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
    rows = rt.store.query("SELECT r.problem_id, r.sample, r.prompt_ids, r.completion_ids, r.loss_mask, r.reward, "
                          "p.payload FROM rollouts r JOIN problems p USING (campaign, iteration, problem_id) "
                          "WHERE r.campaign = ? AND r.iteration = 1 AND p.guidance > 0", [rt.campaign])
    assert len(rows), "no guided rollout"
    tokenizer = rt.inference.tokenizer(rt.checkpoint(rt.trainee_version()))
    for row in rows.itertuples():
        prefix = json.loads(row.payload)["guidance"]["prefix"]
        prompt, completion = list(row.prompt_ids), list(row.completion_ids)
        assert tokenizer.decode(prompt).endswith(prefix), "the prompt the policy continued does not end with it"
        assert not tokenizer.decode(completion).startswith(prefix.strip())
        assert len(row.loss_mask) == len(completion)
    # force every group informative so the update's data holds the guided groups, then weigh the tokens
    frame = rt.store.query("SELECT problem_id, sample FROM rollouts WHERE campaign = ? AND iteration = 1",
                           [rt.campaign])
    scores = frame.assign(reward=(frame["sample"] % 2).astype(float), passed=frame["sample"] % 2 == 1,
                          reason="planted", detail="{}", scored_at=now())
    rt.store.update_rollout_scores(rt.campaign, 1, scores)
    groups, _ = gather_groups(rt, 1, rt.trainee_version())
    guided_ids = set(rows["problem_id"])
    prompts = {tuple(p) for p in rows["prompt_ids"]}
    mine = [g for g in groups if tuple(g.prompt) in prompts]
    assert len(mine) == len(guided_ids)
    policy, _tok = load_policy(rt.checkpoint(rt.trainee_version()))
    completions = [[m.ids for m in g.members] for g in mine]
    count = sum(len(m.ids) for g in mine for m in g.members)
    logps, mask = grouped_logprobs(policy, [g.prompt for g in mine], completions,
                                   temperature=torch.ones(sum(len(c) for c in completions)),
                                   top_p=torch.ones(sum(len(c) for c in completions)), pad_id=0, chunk=None)
    assert int(mask.sum()) == count  # one weighed log-prob per sampled completion token, none for the prompt's
    assert logps.shape[1] == max(len(m.ids) for g in mine for m in g.members)


_CHILD = """
import sys
from evertrain.config import CampaignConfig
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
config = CampaignConfig.model_validate_json(open(sys.argv[1]).read())
run_stage(Runtime.open(config), "curate", int(sys.argv[2]), STAGE_FUNCTIONS["curate"])
"""


def test_selection_is_predicted_from_stored_rollouts_and_survives_a_sigkill_and_a_rerun(tmp_path, models_dir):
    config = _config(tmp_path, models_dir, guidance=False, explore=0.1)
    rt = Runtime.open(config)
    curate = STAGE_FUNCTIONS["curate"]
    run_stage(rt, "curate", 0, curate)
    # a planted history: the sums always pass (their groups agree), the positive differences disagree
    _plant(rt, 0, POS, [4, 4, 4, 4, 4])
    _plant(rt, 0, "- 2d", [1, 2, 3, 2])
    metrics = run_stage(rt, "curate", 1, curate)
    rows = _problems(rt, 1)
    by_kind = rows.groupby("kind")["predicted_informative"].first().to_dict()
    assert by_kind["- 2d"] == round(predicted(4, 4), 4)  # 5/6 from the stored rollouts
    assert POS not in by_kind or by_kind[POS] == round(predicted(4, 0), 4)  # the last window (4) of 5 groups
    assert metrics["dropped_uninformative"] > 0
    kept_pos = int((rows["kind"] == POS).sum())
    assert kept_pos <= metrics["frontier_explored"]  # a sum is kept only by the exploration share
    assert kept_pos < len(rows) / 4  # without the frontier about a third of the candidates are sums
    first = rows[["problem_id", "kind", "guidance", "predicted_informative"]].reset_index(drop=True)
    rt.close()
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    env = {**os.environ, "EVERTRAIN_PROGRESS": "0", "EVERTRAIN_KILL_AT": "curate:before_commit"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == -9, done.stderr[-2000:]
    rt = Runtime.open(config)
    pd.testing.assert_frame_equal(_problems(rt, 1)[first.columns].reset_index(drop=True), first)
    run_stage(rt, "curate", 1, curate)  # the rerun decides the same from the same store
    pd.testing.assert_frame_equal(_problems(rt, 1)[first.columns].reset_index(drop=True), first)


def test_curriculum_too_hard_and_sft_count_bare_groups_only(tmp_path, models_dir):
    """Guidance must not make a level look mastered, a problem look solved, or a continuation look like the policy's."""
    config = _config(tmp_path, models_dir)
    rt = Runtime.open(config)
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    _plant(rt, 0, NEG, [4, 4], guidance=2)
    _plant(rt, 0, POS, [1])
    rates = rt.store.recent_group_pass_rates(rt.campaign, "arithmetic", 0, 1, 10)
    assert len(rates) == 1 and float(rates["pass_rate"].iloc[0]) == 0.25  # the guided groups are left out
    history = rt.store.attempt_history(rt.campaign, 1, [f"planted-0-{NEG}-2-0", f"planted-0-{POS}-0-0"], 8)
    assert list(history) == [f"planted-0-{POS}-0-0"]
    # sft imitates bare rollouts only: a guided one continued a start the policy did not write
    from evertrain.config import DEFAULT_SFT_SELECT

    picked = rt.store.sft_rollouts(rt.campaign, 0, DEFAULT_SFT_SELECT, 100)
    assert set(picked["problem_id"]) == {f"planted-0-{POS}-0-0"}


def test_an_environment_without_hints_is_selected_but_never_guided(tmp_path, models_dir):
    env = registry.get("calculator")
    problem = env.problems("train", 1, 0)[0]
    assert env.hint_levels == 0 and env.hint(problem, 1) is None
    assert env.problem_kind(problem) == problem.id  # a fixed kind per problem by default
    arithmetic = registry.get("arithmetic", **OPTIONS)
    sample = arithmetic.problems("train", 50, 0)
    assert {arithmetic.problem_kind(p) for p in sample} >= {NEG, POS}
    tokenizer = _tokenizer(models_dir)
    tokens = encode_chat(tokenizer, arithmetic.guided_messages(sample[0]))
    assert tokens == encode_chat(tokenizer, arithmetic.messages(sample[0]))  # unguided: unchanged
    guided = replace(sample[0], payload={**sample[0].payload, "guidance": {"level": 1, "prefix": "12 + 7 = "}})
    continued = tokenizer.decode(encode_chat(tokenizer, arithmetic.guided_messages(guided)))
    assert continued.startswith(tokenizer.decode(tokens)) and continued.endswith("12 + 7 = ")


def _tokenizer(models_dir: Path):
    from evertrain.models.checkpoint import load_tokenizer, resolve_base

    config = smoke_config_in(models_dir.parent / "frontier-tok", models_dir)
    return load_tokenizer(resolve_base(config.model))


def test_weighted_selection_gives_kinds_likelier_to_teach_more_of_the_iteration(tmp_path, models_dir):
    shares = {}
    for weighted in (False, True):
        rt = Runtime.open(_config(tmp_path / str(weighted), models_dir, guidance=False, explore=0.0,
                                  weighted=weighted))
        run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
        _plant(rt, 0, "- 2d", [1, 2, 3, 2])  # every group informative: predicted 5/6
        _plant(rt, 0, NEG, [1, 2, 3, 2])
        _plant(rt, 0, POS, [4, 4, 4, 1])  # one in four: predicted 2/6, above skip_below (0.2)
        run_stage(rt, "curate", 1, STAGE_FUNCTIONS["curate"])
        rows = _problems(rt, 1)
        assert len(rows) == 24  # the oversampled candidates still fill the iteration
        shares[weighted] = float((rows["kind"] == POS).mean())
        rt.close()
    assert 0 < shares[True] < 0.7 * shares[False], shares
