"""The vLLM engine keys what it serves by content, not by folder: a checkpoint folder rewritten in place (an
in-process rerun of the update, the notebook's use) is served with its new weights.

Runs a real engine under ``.venv-vllm`` on the embedded tiny model (the one the smoke campaign uses).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from evertrain.config import CampaignConfig
from evertrain.models.policy import grouped_logprobs, load_policy, save_checkpoint, write_base_checkpoint
from tests.conftest import ROOT

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TOLERANCE = 2e-3  # as in tests/test_vllm.py: engine and trainer log-probs, float32 on both sides

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and os.environ.get("EVERTRAIN_REQUIRE_VLLM") != "1",
    reason=f"no vLLM interpreter at {VLLM_PYTHON} (build it with `make vllm`)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny model as built by default: every backend must run it."""
    from evertrain.models.tiny import build_tiny_model

    yield build_tiny_model(tmp_path_factory.mktemp("vllm-backend") / "tiny-llama")


@pytest.fixture(scope="module")
def engines():
    """The engines this module's samplers run on, stopped at its end."""
    from evertrain.models.sampler import Engines

    owned = Engines()
    yield owned
    owned.close()


def _config(model: Path, finetune: str) -> CampaignConfig:
    return CampaignConfig.model_validate({
        "model": {"path": str(model), "rollout_dtype": "float32"}, "update": {"finetune": finetune},
        "generation": {"backend": "vllm", "vllm_python": str(VLLM_PYTHON)}})


def _prompts() -> list[list[int]]:
    return [list(range(40, 60)), list(range(70, 85))]


def _gap(model, groups, prompts, temperature: float = 1.0) -> float:
    """Largest |engine log-prob - trainer log-prob| over every sampled token."""
    with torch.no_grad():
        trainer, mask = grouped_logprobs(model, prompts, [[s.completion_ids for s in g] for g in groups],
                                         temperature=temperature, pad_id=0)
    engine = torch.zeros_like(trainer)
    for row, s in enumerate(s for g in groups for s in g):
        engine[row, :len(s.logprobs)] = torch.tensor(s.logprobs)
    return float(((trainer - engine).abs() * mask).max())


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
def test_a_checkpoint_folder_rewritten_in_place_is_served_anew(tiny, tmp_path, finetune, engines):
    from evertrain.models.policy import checkpoint_digest
    from evertrain.models.sampler import open_sampler

    config = _config(tiny, finetune)
    base = write_base_checkpoint(tmp_path / "base", str(tiny))
    folder = tmp_path / "iteration-0"  # the update's output folder, written twice by a rerun
    prompts = _prompts()

    save_checkpoint(_policy(tiny, base, finetune, seed=1), folder, str(tiny))
    first = load_policy(folder)[0]
    sampler, _ = open_sampler(config, folder, engines)
    groups, _ = sampler.sample(prompts, 3, max_new_tokens=10, temperature=1.0)
    assert _gap(first, groups, prompts) < TOLERANCE
    assert sampler.engine.served == checkpoint_digest(folder)  # the engine read these very bytes

    save_checkpoint(_policy(tiny, base, finetune, seed=2), folder, str(tiny))  # the rerun: same folder, new weights
    second = load_policy(folder)[0]
    again, seconds = open_sampler(config, folder, engines)
    assert again.engine is sampler.engine and seconds > 0  # handed over again, to the same engine
    groups, _ = again.sample(prompts, 3, max_new_tokens=10, temperature=1.0)
    assert _gap(second, groups, prompts) < TOLERANCE  # the new weights are served...
    assert _gap(first, groups, prompts) > 10 * TOLERANCE  # ...not the old ones
    assert again.engine.served == checkpoint_digest(folder)
