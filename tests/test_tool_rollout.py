"""A real multi-turn tool-use rollout: the policy calls the SQL tool, reads its reply, answers.

The tiny model is first taught (a few hundred steps of supervised training, here in the test) to
reproduce the reference episode of the problem curate will choose; then the rollout stage runs the
episode for real: the tool executes, its reply is appended, the policy continues. The stored rows
are then replayed turn by turn and must reproduce the stored tool replies.
"""

from __future__ import annotations

import json

import torch

from evertrain.envs.base import Problem
from evertrain.envs.tools import replay_transcript
from evertrain.models.checkpoint import load_tokenizer
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import check_one_tool_call, smoke_config_in


def _teach(model_dir, out_dir, messages: list[dict[str, str]], steps: int = 300) -> None:
    """Overfit the tiny model on one chat (loss on the assistant turns only)."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids, labels = [], []
    for end in range(len(messages)):
        prefix = tokenizer.apply_chat_template(messages[:end], tokenize=False) if end else ""
        text = tokenizer.apply_chat_template(messages[:end + 1], tokenize=False)
        piece = tokenizer(text[len(prefix):], add_special_tokens=False)["input_ids"]
        ids += piece
        trained = messages[end]["role"] == "assistant" and end >= len(messages) - 3
        labels += piece if trained else [-100] * len(piece)
    x, y = torch.tensor([ids]), torch.tensor([labels])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def test_tool_rollout_is_stored_turn_by_turn_and_replays(tmp_path, models_dir):
    settings = {"name": "tools", "problems_per_iteration": 1, "group_size": 2,
                "environments": [{"name": "sql", "weight": 1, "max_new_tokens": 160}],
                "generation": {"temperature": 0.05, "max_new_tokens": 160}}
    probe = smoke_config_in(tmp_path / "probe", models_dir, **settings)
    rt = Runtime.open(probe)
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    row = rt.store.query("SELECT * FROM problems").iloc[0]
    env = rt.env("sql")
    problem = Problem("sql", row["problem_id"], row["prompt"], json.loads(row["payload"]))
    episode = env.reference_transcript(problem)
    chat = env.messages(problem) + [{"role": m["role"], "content": m["content"]} for m in episode]
    _teach(models_dir / "tiny-llama", tmp_path / "taught", chat)

    config = smoke_config_in(tmp_path / "run", models_dir, **settings,
                             model={"path": str(tmp_path / "taught"), "rollout_dtype": "float32"})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    rollouts = rt.store.query("SELECT * FROM rollouts ORDER BY sample")
    assert (rollouts["problem_id"] == problem.id).all()
    for rollout in rollouts.itertuples(index=False):
        # only the policy's tokens are trained on: the tool message is masked out
        turns, start, end = check_one_tool_call(rollout)
        assert all(lp == 0.0 for lp in list(rollout.logprobs)[start:end])
        # replay from the stored rows: the same calls give the same tool replies
        replayed = replay_transcript(env, problem, turns)
        stored_tools = [(t["name"], t["content"], t["error"]) for t in turns if t["role"] == "tool"]
        assert [(t["name"], t["content"], t["error"]) for t in replayed if t["role"] == "tool"] == stored_tools
