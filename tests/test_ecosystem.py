"""Environments written for other systems, in one campaign: a verifiers taskset (vf-sums), a multi-turn verifiers
environment (vf-guess), an OpenEnv environment server (openenv-count) and a built-in one, each from a real
package in environments/ installed with pip by `make setup`; and the OpenEnv adapter on its own."""

from __future__ import annotations

import contextlib
import json

import psutil
import pytest

from evertrain.envs import registry
from tests.conftest import smoke_config_in

GUESS = {"num_tasks": 40, "answer_field": "target", "answer_format": "plain", "max_turns": 3, "templated": True}
COUNT = {"app": "openenv_count.server:app", "action_field": "answer", "action_type": "int",
         "oracle_field": "expected", "train_seeds": 120, "eval_seeds": 20, "max_turns": 3}


@pytest.fixture(scope="module")
def count():
    env = registry.get("openenv:count", **COUNT)
    yield env
    env.close()


def _servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "openenv_count.server:app" in " ".join(p.cmdline())]


def test_an_openenv_episode_of_several_steps_is_played_and_graded_from_the_replies(count):
    problem = count.problems("train", 1, 0)[0]
    assert problem.prompt.startswith("Start at ") and isinstance(problem.payload["seed"], int)
    servers = _servers()
    assert servers, "the adapter started no server"
    # served in the jail (bwrap: no network), on a Unix socket: no TCP port is open
    assert any(p.name() == "bwrap" for p in servers), [p.cmdline()[:3] for p in servers]
    for server in servers:
        with contextlib.suppress(psutil.Error):
            assert not [c for c in server.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    first = problem.payload["answer"]
    said = count.reply(problem, [{"role": "assistant", "content": f"The total is {first}."}])
    assert said is not None and said.startswith(f"Right: {first}.")  # the server's next observation
    reference = count.reference(problem)
    verdict = count.verify(problem, reference)
    assert verdict.passed and verdict.detail["return"] == 1.0 and len(verdict.detail["steps"]) == 2
    assert [s["done"] for s in verdict.detail["steps"]] == [False, True]  # every step kept, with its reward
    wrong = count.verify(problem, json.dumps({"replies": [first, "0"]}))
    assert wrong.reason == "wrong" and wrong.reward == 0.0
    # an observation cannot be written by the policy: a reply that spells out the end is one (invalid) action
    assert count.verify(problem, "Right: 9. Done. reward 1").reward == 0.0
    assert count.verify(problem, "no number at all").reason == "invalid_action"
    assert count.verify(problem, first).reason == "incomplete"  # one step of two


def test_the_held_out_seeds_are_apart_and_the_self_test_holds(count):
    from evertrain.envs.quality import validate

    train, held = count.problems("train", 1000, 0), count.problems("eval", 1000, 0)
    assert len(held) == 20 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert min(p.payload["seed"] for p in held) > max(p.payload["seed"] for p in train)
    report = validate(count, problems=2)
    assert report.ok, report.failures
    assert report.by_label()["good"]["cases"] >= 4  # the reference episodes played by the server's own state


def test_a_server_that_is_gone_costs_a_grader_error_and_bad_options_are_named():
    with pytest.raises(ValueError, match="exactly one of app"):
        registry.get("openenv:count")
    with pytest.raises(ValueError, match="action_type"):
        registry.get("openenv:count", url="http://127.0.0.1:9", action_type="float")
    gone = registry.get("openenv:count", url="http://127.0.0.1:9", timeout_s=2)  # nothing listens there
    from evertrain.envs.base import Problem

    verdict = gone.verify(Problem("openenv:count", "x", "Start at 1.", {"seed": 3}), "4")
    assert verdict.reason == "grader_error" and verdict.reward == 0.0


def test_a_campaign_iteration_on_three_formats_at_once(tmp_path, models_dir):
    """One iteration end to end: each environment's rollouts graded by its own rubric or server (the components in
    each row's detail), the multi-turn episodes with the environment's turns masked out of the update, every
    held-out split in the gate, every self-test stored, and the OpenEnv server stopped with the context. The
    curriculum is on: the packages that declare levels (vf-sums, openenv-count) train at their easiest, the
    others by pass-rate bands, as a built-in fixed pool."""
    from evertrain.data.store import Store
    from evertrain.runtime import Runtime
    from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage

    config = smoke_config_in(tmp_path, models_dir, name="eco", problems_per_iteration=12, environments=[
        {"name": "verifiers:vf-sums", "weight": 1, "options": {"num_tasks": 60, "templated": True}},
        {"name": "verifiers:vf-guess", "weight": 1, "options": GUESS},
        {"name": "openenv:count", "weight": 1, "options": COUNT},
        {"name": "digits", "weight": 1}], curriculum={"enabled": True})
    before = {p.pid for p in _servers()}
    with Runtime.open(config) as rt:
        for stage in STAGES:
            run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
        assert {p.pid for p in _servers()} - before, "the campaign started no OpenEnv server"
    assert not {p.pid for p in _servers()} - before, "the campaign's OpenEnv server outlived its context"
    with Store(config.paths.store, read_only=True) as store:
        rollouts = store.query("SELECT env, detail, turns, loss_mask FROM rollouts WHERE campaign = 'eco'")
        evaluations = store.query("SELECT DISTINCT env, split FROM evals WHERE campaign = 'eco'")
        validations = store.query("SELECT env, ok FROM env_validations")
        levels = store.query("SELECT env, level, max_level FROM curriculum WHERE campaign = 'eco'")
        problems = store.query("SELECT env, payload FROM problems WHERE campaign = 'eco' AND split = 'train'")
    # the declared ladders start at their easiest level (max_level: the highest the turn limit leaves reachable),
    # vf-guess at the bands' middle (as drawn), as a fixed pool
    assert {(row.env, row.level) for row in levels.itertuples()} >= {
        ("verifiers:vf-sums", 0), ("openenv:count", 0), ("verifiers:vf-guess", 1)}
    assert levels.set_index("env").loc["openenv:count", "max_level"] == 2  # one-number replies fit every level
    for env in ("verifiers:vf-sums", "openenv:count"):
        payloads = [json.loads(p) for p in problems[problems["env"] == env]["payload"]]
        assert payloads and all(p["level"] == 0 for p in payloads), env  # trained at the package's easiest level
    assert all(len(json.loads(d)["steps"]) <= 1 for d in rollouts[rollouts["env"] == "openenv:count"]["detail"])
    graded_by = {"verifiers:vf-sums": lambda d: set(d["rewards"]) == {"correct"},
                 "verifiers:vf-guess": lambda d: set(d["rewards"]) == {"solved", "efficiency"},
                 "openenv:count": lambda d: "steps" in d and "return" in d}
    for env, graded in graded_by.items():
        ours = rollouts[rollouts["env"] == env]
        assert len(ours) > 0, env
        assert all(graded(json.loads(detail)) for detail in ours["detail"]), env
        assert (env, "gate") in set(zip(evaluations["env"], evaluations["split"], strict=True)), env
        assert bool(validations.set_index("env").loc[env, "ok"]), env
    for env in ("verifiers:vf-guess", "openenv:count"):
        ours = rollouts[rollouts["env"] == env]
        spoken = [(json.loads(turns), list(mask)) for turns, mask in zip(ours["turns"], ours["loss_mask"], strict=True)
                  if any(t["role"] == "user" for t in json.loads(turns))]
        assert spoken or env == "openenv:count", f"{env}: no episode got a word from the environment"
        for turns, mask in spoken:
            assert [t["role"] for t in turns][:3] == ["assistant", "user", "assistant"]
            for turn in turns:
                start, end = turn["tokens"]
                assert set(mask[start:end]) == ({1} if turn["role"] == "assistant" else {0})


def test_evertrain_envs_builds_a_campaign_s_environments_with_their_options(tmp_path, capfd):
    """`evertrain envs --config`: an adapter that needs options (an OpenEnv server's app) is built with the
    campaign's; without them its row says what it needs instead of failing the listing."""
    from evertrain import cli

    campaign = tmp_path / "eco.toml"
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in COUNT.items())
    campaign.write_text(f'name = "eco"\n[[environments]]\nname = "openenv:count"\noptions = {{ {options} }}\n')
    assert cli.main(["envs", "--config", str(campaign), "--json"]) == 0
    (row,) = json.loads(capfd.readouterr().out)
    assert row["name"] == "openenv:count" and row["problems"].endswith("train / 20 eval"), row
    assert cli.main(["envs", "--env", "openenv:count", "--json"]) == 0
    (row,) = json.loads(capfd.readouterr().out)
    assert row["problems"].startswith("needs options") and "app" in row["problems"], row
    assert cli.main(["envs", "--config", str(campaign), "--env", "digits"]) == 2  # not one of the campaign's
    assert "not an environment of" in capfd.readouterr().err


class _Solver:
    """A sampler that answers openenv-count's observations right (it reads the last one from the prompt), so an
    episode runs to its end: every other part is real (the server, the chat template, the batched loop)."""

    backend = "scripted"
    capabilities = None

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _answer(self, context: str) -> str:
        import re

        said = context.rsplit("<|im_start|>user", 1)[-1]
        total = int(re.search(r"(?:Start at|Right:) (-?\d+)", said).group(1))
        sign, operand = re.search(r"(Add|Subtract) (\d+)", said).groups()
        return str(total + int(operand) * (1 if sign == "Add" else -1))

    def sample(self, prompts, n, **_):
        from evertrain.inference.base import Sample, SamplingStats

        groups = []
        for prompt in prompts:
            text = self._answer(self.tokenizer.decode(prompt))
            ids = self.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
            groups.append([Sample(ids, [-0.5] * len(ids), "stop", text) for _ in range(n)])
        return groups, SamplingStats()


def test_an_openenv_episode_runs_to_its_end_turn_by_turn_in_the_rollout_loop(count, models_dir):
    from transformers import AutoTokenizer

    from evertrain.inference.episodes import sample_episodes
    from evertrain.models.checkpoint import encode_chat

    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny-llama")
    problems = count.problems("train", 3, 0)
    prompts = [encode_chat(tokenizer, count.messages(p)) for p in problems]
    groups, _ = sample_episodes(_Solver(tokenizer), count, problems, prompts, 2, max_new_tokens=8)
    for problem, group in zip(problems, groups, strict=True):
        for episode in group:
            assert [t["role"] for t in episode.turns] == ["assistant", "user", "assistant"]
            observation = episode.turns[1]
            assert observation["content"].startswith("Right: ")  # the server's own words, masked from the update
            start, end = observation["tokens"]
            assert set(episode.loss_mask[start:end]) == {0} and sum(episode.loss_mask) > 0
            verdict = count.verify(problem, episode.text)
            assert verdict.passed and [s["reward"] for s in verdict.detail["steps"]] == [0.0, 1.0]
