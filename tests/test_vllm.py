"""Sampling through a real vLLM engine (``generation.backend = "vllm"``), on the embedded tiny Llama as built by
default (every backend must run it).

The engine runs under its own interpreter (``.venv-vllm``, built by ``make vllm``; ``make test`` builds it
and sets EVERTRAIN_REQUIRE_VLLM=1, so these tests fail there instead of skipping when it is missing).
Every vLLM engine test lives in this file (one pytest-xdist worker, ``--dist loadfile``): the sampler tests and the
campaign tests share the module's ``engines`` (the LoRA and the full-weights engines on the tiny model start once
each, about 40 CPU-seconds a start), lent to each campaign's context (``Runtime.open(config, engines=...)``);
the tool-episode test's context (its own, taught model) starts and stops its own, as a campaign run does.

Tolerances, float32 on both sides: a behaviour log-prob returned by the engine and the trainer's
recomputation of it agree within 2e-3 per token (vLLM's CPU attention and matrix kernels are not
transformers'); measured here they differ by about 1e-5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from evertrain.config import CampaignConfig
from evertrain.models.checkpoint import load_policy, save_checkpoint, write_base_checkpoint
from evertrain.models.logprobs import grouped_logprobs
from tests.conftest import ROOT, check_one_tool_call, smoke_config_in

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOLERANCE = 2e-3

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and os.environ.get("EVERTRAIN_REQUIRE_VLLM") != "1",
    reason=f"no vLLM interpreter at {VLLM_PYTHON} (build it with `make vllm`)")


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny Llama as built by default (2 heads of 32: vLLM's CPU attention needs at least 32)."""
    from evertrain.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    yield build_tiny_model(root / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def engines():
    """The engines this module's samplers run on (one per model and settings), stopped at its end."""
    from evertrain.inference.vllm_sampler import Engines

    owned = Engines()
    yield owned
    owned.close()


@pytest.fixture(scope="module")
def taught_model(vllm_model: Path) -> Path:
    """The tiny Llama taught (supervised, here) to reproduce the reference episode of one SQL problem."""
    from evertrain.envs.base import Problem
    from evertrain.runtime import Runtime
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage
    from tests.test_tool_rollout import _teach

    root = vllm_model.parents[1]
    probe = smoke_config_in(root / "probe", vllm_model.parent, **_tool_settings())
    rt = Runtime.open(probe)
    run_stage(rt, "curate", 0, STAGE_FUNCTIONS["curate"])
    row = rt.store.query("SELECT * FROM problems").iloc[0]
    env = rt.env("sql")
    problem = Problem("sql", row["problem_id"], row["prompt"], json.loads(row["payload"]))
    chat = env.messages(problem) + [{"role": m["role"], "content": m["content"]}
                                    for m in env.reference_transcript(problem)]
    _teach(vllm_model, root / "taught", chat)
    return root / "taught"


def _tool_settings() -> dict:
    return {"name": "tools", "problems_per_iteration": 1, "group_size": 2,
            "environments": [{"name": "sql", "weight": 1, "max_new_tokens": 160}],
            "generation": {"temperature": 0.05, "max_new_tokens": 160}}


def _config(model: Path, finetune: str = "lora") -> CampaignConfig:
    return CampaignConfig.model_validate({
        "model": {"path": str(model), "rollout_dtype": "float32"}, "update": {"finetune": finetune},
        "generation": {"backend": "vllm", "vllm_python": str(VLLM_PYTHON)}})


def _prompts() -> list[list[int]]:
    # three prompts sharing a 64-token prefix: two whole 32-token blocks for the prefix cache
    shared = list(range(40, 104))
    return [[*shared, 7, 8, 9], [*shared, 11, 12], shared + list(range(120, 140))]


def _agreement(model, groups, prompts, temperature: float, top_p: float = 1.0) -> float:
    """Largest |engine log-prob - trainer log-prob| over every sampled token."""
    with torch.no_grad():
        trainer, mask = grouped_logprobs(model, prompts, [[s.completion_ids for s in g] for g in groups],
                                         temperature=temperature, top_p=top_p, pad_id=0)
    engine = torch.zeros_like(trainer)
    for row, s in enumerate(s for g in groups for s in g):
        engine[row, :len(s.logprobs)] = torch.tensor(s.logprobs)
    return float(((trainer - engine).abs() * mask).max())


def test_lora_versions_reach_one_engine_and_logprobs_match_the_trainer(vllm_model, tmp_path, engines):
    from peft import LoraConfig, get_peft_model

    from evertrain.inference.backends import open_sampler
    from evertrain.inference.vllm_sampler import VLLMSampler

    config = _config(vllm_model)
    base = write_base_checkpoint(tmp_path / "base", str(vllm_model))
    sampler, _ = open_sampler(config, base, engines)
    assert isinstance(sampler, VLLMSampler)
    prompts = _prompts()
    from evertrain.tasks.base import cpu_seconds

    own, engine_cpu, counted = os.times(), engines.cpu_seconds(), cpu_seconds(engines)
    groups, stats = sampler.sample(prompts, 4, max_new_tokens=12, temperature=0.9)
    # a stage's cost counts the engine's CPU (its processes sample while this one waits)
    used = engines.cpu_seconds() - engine_cpu
    mine = sum(os.times()[:2]) - sum(own[:2])
    assert used > 0 and cpu_seconds(engines) - counted >= used + mine - 0.05
    assert [len(g) for g in groups] == [4, 4, 4]
    assert all(len(s.logprobs) == len(s.completion_ids) > 0 for g in groups for s in g)
    model, _ = load_policy(base)
    assert _agreement(model, groups, prompts, 0.9) < TOLERANCE
    # the engine's own count of prompt tokens served from its prefix cache
    assert stats.cached_prompt_tokens > 0

    # a policy version as a LoRA adapter: handed to the running engine, no restart
    torch.manual_seed(1)
    peft = get_peft_model(load_policy(base)[0], LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, weight in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(weight, std=0.2)
    lora = save_checkpoint(peft, tmp_path / "v2", str(vllm_model))
    process = sampler.engine.process.pid
    tuned, seconds = open_sampler(config, lora, engines)
    assert tuned.engine is sampler.engine and tuned.engine.process.pid == process and seconds > 0
    groups, _ = tuned.sample(prompts, 4, max_new_tokens=12, temperature=0.9)
    merged, _ = load_policy(lora)
    assert _agreement(merged, groups, prompts, 0.9) < TOLERANCE
    assert _agreement(model, groups, prompts, 0.9) > 10 * TOLERANCE  # the adapter did change the policy

    # top_p < 1: the log-probs are those of the truncated distribution actually sampled from
    groups, _ = tuned.sample(prompts, 4, max_new_tokens=12, temperature=0.9, top_p=0.7)
    assert _agreement(merged, groups, prompts, 0.9, top_p=0.7) < TOLERANCE
    assert _agreement(merged, groups, prompts, 0.9) > TOLERANCE


def test_full_weights_are_reloaded_in_place(vllm_model, tmp_path, engines):
    from evertrain.inference.backends import open_sampler

    config = _config(vllm_model, finetune="full")
    base = write_base_checkpoint(tmp_path / "base", str(vllm_model))
    model, _ = load_policy(base, trainable=True, finetune="full")
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    full = save_checkpoint(model, tmp_path / "full", str(vllm_model))
    prompts = _prompts()
    sampler, _ = open_sampler(config, full, engines)
    groups, _ = sampler.sample(prompts, 2, max_new_tokens=10, temperature=1.0)
    assert _agreement(load_policy(full)[0], groups, prompts, 1.0) < TOLERANCE
    # back to the base weights in the same engine: the prefix cache must not serve the old weights' KV
    again, _ = open_sampler(config, base, engines)
    assert again.engine is sampler.engine
    groups, _ = again.sample(prompts, 2, max_new_tokens=10, temperature=1.0)
    assert _agreement(load_policy(base)[0], groups, prompts, 1.0) < TOLERANCE


def test_tool_episode_through_vllm(taught_model, tmp_path):
    from evertrain.envs.base import Problem
    from evertrain.envs.tools import replay_transcript
    from evertrain.runtime import Runtime
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    settings = _tool_settings()
    settings["generation"].update(backend="vllm", vllm_python=str(VLLM_PYTHON))
    config = smoke_config_in(tmp_path, taught_model.parent / "models", **settings,
                             model={"path": str(taught_model), "rollout_dtype": "float32",
                                    "models_dir": str(taught_model.parent / "models")})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    rollouts = rt.store.query("SELECT * FROM rollouts ORDER BY sample")
    env = rt.env("sql")
    for rollout in rollouts.itertuples(index=False):
        turns, _, _ = check_one_tool_call(rollout)
        problem = Problem("sql", rollout.problem_id, "", json.loads(rt.store.scalar(
            "SELECT payload FROM problems WHERE problem_id = ?", [rollout.problem_id])))
        replayed = replay_transcript(env, problem, turns)
        assert [t["content"] for t in replayed if t["role"] == "tool"] == \
            [t["content"] for t in turns if t["role"] == "tool"]
    metrics = json.loads(rt.store.scalar("SELECT metrics FROM stage_runs WHERE stage = 'rollout'"))
    assert "weight_sync_s" in metrics and metrics["cached_prompt_tokens"] > 0
    # the weights the engine was handed are, by content, those of the policy version the rollouts name
    from evertrain.models.checkpoint import checkpoint_digest
    (version,) = set(rollouts["policy_version"])
    assert len(rt.inference.engines) == 1  # the context's one engine, which the stages shared
    engine = rt.inference.engines.get(config, rt.base_model)
    assert engine.served == checkpoint_digest(rt.checkpoint(int(version)))
    rt.close()
    assert engine.process.poll() is not None  # the context's own engine stops with it


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_iteration_campaign_on_vllm(vllm_model, tmp_path, finetune, prefect_server, engines):
    from evertrain.flows.campaign import run_campaign
    from evertrain.runtime import Runtime

    config = smoke_config_in(tmp_path, vllm_model.parent,
                             model={"path": str(vllm_model), "rollout_dtype": "float32",
                                    "models_dir": str(vllm_model.parent)},
                             environments=[{"name": "digits", "weight": 1}],
                             generation={"backend": "vllm", "vllm_python": str(VLLM_PYTHON), "max_new_tokens": 12,
                                         "temperature": 1.0},
                             update={"finetune": finetune, "learning_rate": 1e-3 if finetune == "full" else 1e-2,
                                     "minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False})
    # campaign_flow's body in a context opened here, on the module's engines (the same model and engine settings
    # as the sampler tests': one engine start spared): its engines can be counted
    rt = Runtime.open(config, engines=engines)
    engine = engines.get(config, rt.base_model)  # the campaign's engine, started here or by an earlier test
    count = len(engines)
    assert run_campaign(rt, 2) == [0, 1]
    # one engine, that one, served both iterations' rollouts and evaluations: the campaign started no other
    assert rt.inference.engines is engines and len(engines) == count and engines.get(config, rt.base_model) is engine
    versions = rt.store.query("SELECT kind FROM model_versions WHERE campaign = ? ORDER BY version", [config.name])
    assert versions["kind"].tolist() == ["base", finetune, finetune]
    rollouts = rt.store.query("SELECT iteration, policy_version, logprobs, completion_ids FROM rollouts")
    assert sorted(set(rollouts["iteration"])) == [0, 1]
    assert rollouts["policy_version"].nunique() == 2  # iteration 1 sampled from iteration 0's challenger
    assert all(len(lp) == len(ids) for lp, ids in zip(rollouts["logprobs"], rollouts["completion_ids"], strict=True))
    stages = rt.store.query("SELECT iteration, stage, metrics FROM stage_runs WHERE stage IN ('rollout', 'update')")
    for row in stages.itertuples(index=False):
        metrics = json.loads(row.metrics)
        assert "weight_sync_s" in metrics
        if row.stage == "update":
            # the correction runs on every group; float32 engine and float32 trainer nearly agree
            assert metrics["mismatch_kl"] < 1e-3 and metrics["is_clipped_share"] == 0.0
    rt.close()
    assert engine.process.poll() is None  # lent: the closed context left it running for the module's other tests


# moved from tests/test_vllm_backend.py: its engines (the tiny model's, LoRA and full) are this module's
def _short_prompts() -> list[list[int]]:
    return [list(range(40, 60)), list(range(70, 85))]


def _policy(tiny: Path, base: Path, finetune: str, seed: int):
    """A policy version distinct from the base (and from other seeds) by a wide margin."""
    torch.manual_seed(seed)
    if finetune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(load_policy(base)[0], LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(weight, std=0.3)
        return model
    model, _ = load_policy(base, trainable=True, finetune="full")
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.1)
    return model


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_checkpoint_folder_rewritten_in_place_is_served_anew(vllm_model, tmp_path, finetune, engines):
    """The engine keys what it serves by content, not by folder: a checkpoint folder rewritten in place (an
    in-process rerun of the update, the notebook's use) is served with its new weights."""
    from evertrain.inference.backends import open_sampler
    from evertrain.models.checkpoint import checkpoint_digest

    tiny = vllm_model
    config = _config(tiny, finetune)
    base = write_base_checkpoint(tmp_path / "base", str(tiny))
    folder = tmp_path / "iteration-0"  # the update's output folder, written twice by a rerun
    prompts = _short_prompts()

    save_checkpoint(_policy(tiny, base, finetune, seed=1), folder, str(tiny))
    first = load_policy(folder)[0]
    sampler, _ = open_sampler(config, folder, engines)
    groups, _ = sampler.sample(prompts, 3, max_new_tokens=10, temperature=1.0)
    assert _agreement(first, groups, prompts, 1.0) < TOLERANCE
    assert sampler.engine.served == checkpoint_digest(folder)  # the engine read these very bytes

    save_checkpoint(_policy(tiny, base, finetune, seed=2), folder, str(tiny))  # the rerun: same folder, new weights
    second = load_policy(folder)[0]
    again, seconds = open_sampler(config, folder, engines)
    assert again.engine is sampler.engine and seconds > 0  # handed over again, to the same engine
    groups, _ = again.sample(prompts, 3, max_new_tokens=10, temperature=1.0)
    assert _agreement(second, groups, prompts, 1.0) < TOLERANCE  # the new weights are served...
    assert _agreement(first, groups, prompts, 1.0) > 10 * TOLERANCE  # ...not the old ones
    assert again.engine.served == checkpoint_digest(folder)
