"""The update stage with ``update.processes = 2`` (two CPU processes over gloo) trains like one process.

Both runs train iteration 0 on the same gathered rollouts from the same start (the second is a rerun of
the stage, which keeps its starting version, groups, advantages and minibatch order). Tolerance: every
trained weight and AdamW moment within 1e-5 (absolute), the metrics within 1e-4 (relative): the two
runs add the same gradients in another order and in other microbatches, which is all that may differ;
the weights move by far more than that (at least 1e-3) from the starting adapter. The settings exercise
what the processes must do as the stage does: the proximal anchor in a second epoch, Dr.GRPO's constant
length, the KL penalty to the base model, weight decay and several microbatches per process.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from evertrain.config import LoraConfig, UpdateConfig
from evertrain.models.checkpoint import load_policy, write_base_checkpoint
from evertrain.models.data_parallel import launch, write_spec
from evertrain.runtime import Runtime, seed_for
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.update import check_data_parallel, dropout_settings
from tests.conftest import smoke_config_in

TOLERANCE = 1e-5
ENVIRONMENTS = [{"name": "digits", "weight": 1}, {"name": "arithmetic", "weight": 1}]


def _starting_adapter(rt, iteration: int) -> dict[str, torch.Tensor]:
    """The fresh adapter the update starts from (its initialisation is seeded by the campaign and iteration)."""
    from peft import get_peft_model_state_dict

    cfg = rt.config.update
    torch.manual_seed(seed_for(rt.config.seed, iteration, "update", "init"))
    model, _ = load_policy(rt.checkpoint(rt.trainee_version()), trainable=True, lora=cfg.lora, finetune=cfg.finetune)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_update_stage_in_two_processes_trains_like_one(tmp_path, models_dir):
    # on the CPU even where GPUs exist: two gloo processes (one GPU each would need two GPUs)
    config = smoke_config_in(tmp_path, models_dir, environments=ENVIRONMENTS, model={
        "path": "embedded:tiny", "device": "cpu", "models_dir": str(models_dir)}, update={
        "algorithm": "dr_grpo", "epochs": 2, "minibatch_size": 16, "microbatch_size": 4, "learning_rate": 1e-2,
        "weight_decay": 0.1, "kl_coef": 0.1, "kl_reference": "base", "skip_zero_variance": False})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    start_version = rt.trainee_version()
    start = _starting_adapter(rt, 0)
    found = {}
    for processes in (1, 2):
        rt.config.update.processes = processes  # the second run is a rerun: same start, groups and order
        metrics = run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
        path = rt.checkpoint_dir(0)
        found[processes] = (metrics, load_file(str(path / "adapter_model.safetensors")),
                            torch.load(path / "optimizer.pt", weights_only=True))
        assert not path.with_name("iteration-0.data-parallel").exists()  # the processes' scratch is gone
    (one, weights1, moments1), (two, weights2, moments2) = found[1], found[2]
    assert one["processes"] == 1 and two["processes"] == 2
    assert one["steps"] == two["steps"] == 4 and one["trained_sequences"] == two["trained_sequences"] == 32

    assert weights1.keys() == weights2.keys() == start.keys()
    moved = max(float((weights1[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-3, moved  # the steps moved the weights (B starts at 0; weight decay shrinks A)
    worst = max(float((weights1[k] - weights2[k]).abs().max()) for k in weights1)
    assert worst < TOLERANCE, worst
    # the AdamW moments the next update restores
    states1, states2 = moments1["state"], moments2["state"]
    assert states1.keys() == states2.keys() and len(states1) == len(start)
    for index, state in states1.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(state[key], states2[index][key], atol=TOLERANCE, rtol=1e-4), (index, key)
    for key in ("loss", "grad_norm", "weight_delta_norm", "kl_ref", "is_weight_mean", "clip_fraction",
                "mismatch_kl", "normaliser_length"):
        assert math.isclose(one[key], two[key], rel_tol=1e-4, abs_tol=1e-6), (key, one[key], two[key])
    assert one["weight_delta_norm"] > 0.01 and one["kl_ref"] > 0
    # the challenger registered from the processes' checkpoint is the trainee, and loads
    version = rt.trainee_version()
    assert version != start_version and rt.tracker.alias("challenger") == version
    assert int(rt.store.model_version(rt.campaign, version)["parent_version"]) == start_version
    load_policy(rt.checkpoint(version))


def test_unsupported_data_parallel_settings_are_refused(tmp_path, models_dir):
    # dropout masks differ per process: refused when the config is validated ...
    with pytest.raises(ValidationError, match=r"update\.processes = 2 with update\.lora\.dropout = 0\.1"):
        UpdateConfig(processes=2, lora=LoraConfig(dropout=0.1))
    UpdateConfig(processes=1, lora=LoraConfig(dropout=0.1))  # one process: fine
    # ... and dropout the model itself applies is found at the start of the stage
    checkpoint = write_base_checkpoint(tmp_path / "base", str(models_dir / "tiny-llama"))
    assert dropout_settings(load_policy(checkpoint, trainable=True)[0]) == []
    found = dropout_settings(load_policy(checkpoint, trainable=True, lora=LoraConfig(dropout=0.1))[0])
    assert found and "p=0.1" in found[0]

    # the processes take one GPU each: a named device, too few GPUs, or another kind are refused, naming them
    def refused(device: str) -> str:
        config = smoke_config_in(tmp_path / device.replace(":", "-"), models_dir,
                                 model={"path": "embedded:tiny", "device": device, "models_dir": str(models_dir)},
                                 update={"processes": 2})
        with pytest.raises(ValueError) as error:
            check_data_parallel(config)
        return str(error.value)

    assert "model.device = 'cuda:1'" in refused("cuda:1") and "update.processes = 2" in refused("cuda:1")
    if torch.cuda.device_count() < 2:
        assert "one GPU per process" in refused("cuda")
    assert "not on model.device = 'mps'" in refused("mps")
    # refused at the start of the stage, before anything is gathered or trained
    config = smoke_config_in(tmp_path / "stage", models_dir,
                             model={"path": "embedded:tiny", "device": "cuda:1", "models_dir": str(models_dir)},
                             update={"processes": 2})
    rt = Runtime.open(config)
    with pytest.raises(ValueError, match=r"update\.processes = 2 takes one GPU per process"):
        run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
    assert rt.store.scalar("SELECT status FROM stage_runs WHERE stage = 'update'") == "failed"


def test_a_failed_launch_raises_with_the_processes_error(tmp_path):
    spec = write_spec(tmp_path / "spec.json", checkpoint=str(tmp_path / "missing"), groups=[], minibatches=[],
                      out=str(tmp_path / "out"), learning_rate=1e-3, microbatch_size=4, cpu=True, threads=1)
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit code [1-9]\d*\): \S*ModelError: \S*missing is not an "
                       r"evertrain checkpoint.*the end of its stderr:"):
        launch(spec, 2, cpu=True, threads=1)
