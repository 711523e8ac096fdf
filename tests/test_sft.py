"""The optional sft stage: trajectories chosen by SQL, TRL's SFTTrainer, rerun- and crash-safe hand-over."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from evertrain.data.store import now
from evertrain.flows.campaign import next_iteration
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.sft import checkpoint_dir, checkpoint_for, sft
from tests.conftest import smoke_config_in

ALL_OF_THIS_ITERATION = ("SELECT iteration, problem_id, sample FROM rollouts "
                         "WHERE campaign = $campaign AND iteration = $iteration AND reward > 0")


@pytest.fixture
def scored(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "digits", "weight": 1}],
                             sft={"enabled": True, "select": ALL_OF_THIS_ITERATION, "max_examples": 6,
                                  "learning_rate": 5e-3, "batch_size": 3})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    return rt


def _adapter(path):
    return load_file(str(path / "adapter_model.safetensors"))


def test_sft_trains_on_the_selected_trajectories_and_update_starts_from_it(scored, capsys):
    rt = scored
    positive = int(rt.store.scalar("SELECT count(*) FROM rollouts WHERE reward > 0"))
    assert positive > 0  # the digits reward gives the tiny model something to imitate
    metrics = run_stage(rt, "sft", 0, sft)
    assert metrics["selected"] == min(6, positive) and metrics["steps"] >= 1
    # the trainer's raw log dictionaries stay off the terminal (EVERTRAIN_VERBOSE=1 brings them back)
    assert "{'loss'" not in capsys.readouterr().out
    examples = rt.store.query("SELECT * FROM sft_examples ORDER BY problem_id, sample")
    assert len(examples) == metrics["selected"]
    # one per group first: no group holds two picks before every group holds one
    per_group = examples.groupby("problem_id").size()
    assert per_group.max() - per_group.min() <= 1
    path = checkpoint_for(rt, 0)
    assert path == checkpoint_dir(rt, 0) and (path / "evertrain_checkpoint.json").exists()
    trained = _adapter(path)
    assert any(k for k in trained if "lora_B" in k)
    assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)  # B starts at 0: it moved
    # a rerun replaces its rows and its checkpoint: same selection, nothing grows
    before = rt.store.counts()
    again = run_stage(rt, "sft", 0, sft)
    assert again["selected"] == metrics["selected"] and rt.store.counts() == before
    for k, v in _adapter(path).items():
        assert torch.allclose(v, trained[k], atol=1e-4), k  # seeded: the rerun trains the same weights
    # the update of the iteration starts from the sft checkpoint: the challenger is the sft adapter moved by
    # exactly the update's own steps (from a fresh adapter, or the trainee's, it would lie far from it)
    update = run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
    assert update["steps"] >= 1
    started, challenger = _adapter(path), _adapter(rt.checkpoint(update["challenger_version"]))
    assert started.keys() == challenger.keys()
    distance = math.sqrt(sum(float((challenger[k] - started[k]).pow(2).sum()) for k in started))
    assert math.isclose(distance, update["weight_delta_norm"], rel_tol=1e-3), (distance, update["weight_delta_norm"])


def test_a_killed_or_empty_sft_run_is_ignored_and_iterations_resume_correctly(scored):
    rt = scored
    run_stage(rt, "sft", 0, sft)
    # a later run killed mid-way leaves the stage 'running': its checkpoint must not be used
    rt.store.record_stage(rt.campaign, 0, "sft", "running", started_at=now())
    assert checkpoint_for(rt, 0) is None
    # the optional stage does not count as one of the six: iteration 0 is still unfinished
    assert next_iteration(rt) == 0
    # selecting nothing removes the earlier checkpoint: the update then starts from the trainee itself
    rt.config.sft.select = "SELECT iteration, problem_id, sample FROM rollouts WHERE false"
    metrics = run_stage(rt, "sft", 0, sft)
    assert metrics["selected"] == 0 and checkpoint_for(rt, 0) is None
    assert not checkpoint_dir(rt, 0).exists()
    # a bad selection names the setting
    rt.config.sft.select = "SELECT nope FROM nowhere"
    with pytest.raises(ValueError, match=r"sft\.select"):
        run_stage(rt, "sft", 0, sft)


def test_bare_prompt_drops_the_worked_examples_and_keeps_system_and_question():
    from evertrain.tasks.sft import bare_chat

    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": "#### 3"}, {"role": "user", "content": "Q"}]
    assert bare_chat(chat) == [chat[0], chat[-1]]
    assert bare_chat(chat[1:]) == [chat[-1]]
    with pytest.raises(ValueError, match="no stored chat"):
        bare_chat([])


def test_bare_sft_trains_the_completion_after_the_prompt_without_examples(scored, monkeypatch):
    """Context distillation: the selected completions are trained after the chat without its worked examples."""
    import json

    from transformers import AutoTokenizer

    from evertrain.models.checkpoint import encode_chat
    from evertrain.tasks import sft as sft_module

    rt = scored
    # give the stored chats worked examples (digits has none), as a few-shot environment stores them
    # (and sampled from them)
    tokenizer = AutoTokenizer.from_pretrained(rt.base_model)
    shots = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "12"}]
    with rt.store.transaction() as con:
        stored = con.execute("SELECT problem_id, messages FROM problems WHERE iteration = 0").fetchall()
        for problem_id, messages in stored:
            chat = json.loads(messages)
            chat = [chat[0], *shots, *chat[1:]]
            con.execute("UPDATE problems SET messages = ? WHERE problem_id = ? AND iteration = 0",
                        [json.dumps(chat), problem_id])
            con.execute("UPDATE rollouts SET prompt_ids = ? WHERE problem_id = ? AND iteration = 0",
                        [encode_chat(tokenizer, chat), problem_id])
    rt.config.sft.prompt = "bare"
    trained: list[list[int]] = []
    real = sft_module.prompt_ids_for
    monkeypatch.setattr(sft_module, "prompt_ids_for", lambda *a: trained.append(real(*a)) or trained[-1])
    metrics = run_stage(rt, "sft", 0, sft)
    assert metrics["selected"] > 0 and metrics["prompts_rewritten"] == metrics["selected"] == len(trained)
    rows = rt.store.query("""SELECT p.messages, r.prompt_ids FROM sft_examples s
                             JOIN rollouts r ON r.problem_id = s.problem_id AND r.sample = s.sample AND r.iteration = 0
                             JOIN problems p ON p.problem_id = s.problem_id AND p.iteration = 0""")
    sampled = [list(ids) for ids in rows.prompt_ids]
    bare = [encode_chat(tokenizer, sft_module.bare_chat(json.loads(m))) for m in rows.messages]
    with_shots = [encode_chat(tokenizer, json.loads(m)) for m in rows.messages]
    assert sampled == with_shots
    assert all(prompt in bare and prompt not in with_shots for prompt in trained)
    assert all(len(b) < len(w) for b, w in zip(bare, with_shots, strict=True))


def test_first_iterations_makes_sft_a_warm_start(scored):
    rt = scored
    rt.config.sft.first_iterations = 1
    assert rt.config.sft.runs_in(0) and not rt.config.sft.runs_in(1)
    run_stage(rt, "sft", 0, sft)
    assert checkpoint_for(rt, 0) is not None
    rt.config.sft.first_iterations = 0  # 0: every iteration
    assert rt.config.sft.runs_in(7)
    rt.config.sft.enabled = False
    assert not rt.config.sft.runs_in(0) and checkpoint_for(rt, 0) is None
