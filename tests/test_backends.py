"""The rollout-backend interface: declared capabilities, refusals at start, identity by content, log-probs.

None of these start a vLLM engine: what a backend refuses it refuses before starting one, and the reply
a VLLMSampler parses is fed to it by a stand-in for the engine's socket.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from evertrain.config import CampaignConfig
from evertrain.models.checkpoint import write_base_checkpoint
from tests.conftest import ROOT, smoke_config_in

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _vllm_config(model: Path, **generation: object) -> CampaignConfig:
    return CampaignConfig.model_validate({
        "model": {"path": str(model), "rollout_dtype": "float32", "device": "cpu"},
        "generation": {"backend": "vllm", "vllm_python": str(VLLM_PYTHON), **generation}})


def _head_size(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


# --- defect 4: missing log-probs ----------------------------------------------------------------------

class _Socketless:
    """Stands in for the engine process: answers every generate with one canned reply."""

    def __init__(self, model: Path, reply: dict) -> None:
        from evertrain.models.checkpoint import load_tokenizer

        self.options = {"model": str(model)}
        self.tokenizer = load_tokenizer(str(model))
        self.reply = reply

    def generate(self, *args: object, **kwargs: object) -> dict:
        return self.reply


def _reply(logprobs: list[float] | None, ids: tuple[int, ...] = (65, 66, 67)) -> dict:
    return {"groups": [[{"ids": list(ids), "logprobs": logprobs, "finish_reason": "length", "stop_reason": None}]],
            "cached_prompt_tokens": 0, "prompt_tokens": 3, "seconds": 0.01}


@pytest.mark.parametrize("logprobs", [None, [], [-0.5, -0.7]], ids=["none", "empty", "short"])
def test_missing_vllm_logprobs_raise(models_dir, tmp_path, logprobs):
    from evertrain.inference.vllm_sampler import EngineError, VLLMSampler

    model = models_dir / "tiny-llama"
    sampler = VLLMSampler(_Socketless(model, _reply(logprobs)), write_base_checkpoint(tmp_path / "b", str(model)))
    # a 0.0 in their place would be a behaviour probability of 1: every importance weight silently shrunk
    with pytest.raises(EngineError, match="log-prob"):
        sampler.sample([[1, 2, 3]], 1, max_new_tokens=3)


def test_complete_vllm_logprobs_pass_through(models_dir, tmp_path):
    from evertrain.inference.vllm_sampler import VLLMSampler

    model = models_dir / "tiny-llama"
    sampler = VLLMSampler(_Socketless(model, _reply([-0.5, -0.7, -0.1])),
                          write_base_checkpoint(tmp_path / "b", str(model)))
    groups, stats = sampler.sample([[1, 2, 3]], 1, max_new_tokens=3)
    assert groups[0][0].logprobs == [-0.5, -0.7, -0.1] and stats.completion_tokens == 3


# --- defect 6: a model a backend cannot run is refused at start; the embedded tiny model runs everywhere -----

def test_embedded_tiny_model_runs_on_every_backend(tmp_path):
    from evertrain.inference.backends import backend_for, check_backend
    from evertrain.inference.base import BackendWarning
    from evertrain.inference.vllm_sampler import VLLM_CPU_HEAD_SIZES
    from evertrain.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    assert _head_size(model) in VLLM_CPU_HEAD_SIZES  # vLLM's CPU attention kernels need one of these
    from safetensors.torch import load_file

    count = sum(t.numel() for t in load_file(model / "model.safetensors").values())
    assert count < 200_000, count  # still tiny: tests stay fast
    for backend in ("hf", "vllm"):
        config = _vllm_config(model) if backend == "vllm" else CampaignConfig.model_validate(
            {"model": {"path": str(model), "device": "cpu"}, "generation": {"backend": "hf"}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BackendWarning)  # vLLM's unhonoured seeds: another test's subject
            check_backend(config, str(model))  # no refusal
        assert backend_for(config).name == backend


def test_vllm_refuses_a_head_size_its_cpu_attention_cannot_run(tmp_path):
    from evertrain.inference.backends import check_backend, open_sampler
    from evertrain.inference.base import BackendError
    from evertrain.inference.vllm_sampler import Engines
    from evertrain.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "head16", hidden=64, heads=4)
    assert _head_size(model) == 16
    config = _vllm_config(model)
    engines = Engines()
    for refuse in (lambda: check_backend(config, str(model)),
                   lambda: open_sampler(config, write_base_checkpoint(tmp_path / "base", str(model)), engines)):
        with pytest.raises(BackendError, match=r"head size 16.*vLLM.*CPU attention.*generation\.backend") as refused:
            refuse()
        assert str(model) in str(refused.value)
    assert len(engines) == 0  # refused before any engine was started


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM interpreter at {VLLM_PYTHON}")
def test_campaign_on_vllm_refuses_before_its_first_stage(tmp_path, prefect_server):
    """The smoke campaign with a head-16 model on vLLM: refused before curate, not dead mid-rollout."""
    from evertrain.flows.campaign import campaign_flow
    from evertrain.inference.base import BackendError
    from evertrain.models.tiny import build_tiny_model
    from evertrain.runtime import Runtime

    model = build_tiny_model(tmp_path / "models" / "head16", hidden=64, heads=4)
    config = smoke_config_in(tmp_path, model.parent, model={"path": str(model), "rollout_dtype": "float32",
                                                            "models_dir": str(model.parent), "device": "cpu"},
                             generation={"backend": "vllm", "vllm_python": str(VLLM_PYTHON), "max_new_tokens": 8})
    with pytest.raises(BackendError, match="head size 16"):
        campaign_flow(config, 1)
    with Runtime.open(config) as rt:  # the flow's context was closed when it failed: the campaign can be opened
        assert rt.store.query("SELECT * FROM stage_runs").empty


# --- B: declared capabilities, and settings a backend cannot honour ----------------------------------------

def test_backends_declare_their_capabilities():
    from evertrain.inference.backends import BACKENDS

    hf, vllm = BACKENDS["hf"].capabilities, BACKENDS["vllm"].capabilities
    assert hf.per_request_seeds and hf.batch_size and hf.lora and hf.logprobs and hf.weights_in_process
    assert not vllm.per_request_seeds and not vllm.batch_size and vllm.lora and vllm.logprobs
    assert not vllm.weights_in_process
    # answers of the reference sampler keep the evaluation cache's old keys; another engine's are other answers
    assert hf.answers_identity is None and vllm.answers_identity == "vllm"


def test_vllm_warns_at_start_about_settings_it_cannot_honour(models_dir):
    from evertrain.inference.backends import check_backend
    from evertrain.inference.base import BackendWarning

    model = models_dir / "tiny-llama"
    with pytest.warns(BackendWarning) as caught:
        check_backend(_vllm_config(model, batch_size=16), str(model))
    text = " ".join(str(w.message) for w in caught)
    assert "generation.batch_size = 16" in text and "seed" in text
    with pytest.warns(BackendWarning) as caught:  # the default batch size was not asked for: no word on it
        check_backend(_vllm_config(model), str(model))
    assert "batch_size" not in " ".join(str(w.message) for w in caught)


def test_vllm_on_a_cluster_is_warned_that_shards_are_not_reproducible(models_dir):
    from evertrain.inference.backends import check_backend
    from evertrain.inference.base import BackendWarning

    model = models_dir / "tiny-llama"
    config = _vllm_config(model).model_copy(update={"cluster": CampaignConfig.model_validate(
        {"cluster": {"address": "local"}}).cluster})
    with pytest.warns(BackendWarning, match="cluster"):
        check_backend(config, str(model))


# --- identity by content hash (Ray workers and the vLLM engine alike) ------------------------------------

def _rewrite_same_size_same_mtime(path: Path, data: bytes) -> None:
    """New bytes of the old length with the old modification time: what a stat-based identity misses."""
    info = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_ray_checkpoint_identity_is_its_content(tmp_path):
    from evertrain.inference.ray_workers import checkpoint_key

    folder = tmp_path / "v2"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"a" * 64)
    (folder / "evertrain_checkpoint.json").write_text('{"kind": "lora", "base_model": "m"}')
    before = checkpoint_key(folder, 2)
    _rewrite_same_size_same_mtime(folder / "adapter_model.safetensors", b"b" * 64)
    assert checkpoint_key(folder, 2) != before  # new weights: a worker must load them
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for name in ("adapter_model.safetensors", "evertrain_checkpoint.json"):
        (copy / name).write_bytes((folder / name).read_bytes())
    assert checkpoint_key(copy, 2) == checkpoint_key(folder, 2)  # the same weights wherever they lie


def test_checkpoint_digest_follows_content_not_path_or_time(tmp_path):
    from evertrain.models.checkpoint import checkpoint_digest

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 128)
    first = checkpoint_digest(folder)
    assert checkpoint_digest(folder) == first
    _rewrite_same_size_same_mtime(folder / "model.safetensors", b"y" * 128)
    assert checkpoint_digest(folder) != first
    (folder / "model.safetensors").rename(folder / "renamed.safetensors")
    assert checkpoint_digest(folder) != first  # file names are part of the content
    with pytest.raises(Exception, match="does not exist"):
        checkpoint_digest(tmp_path / "missing")


def test_the_gate_cache_key_asks_the_capability(smoke_config, tmp_path):
    """The evaluation cache key of an hf campaign is unchanged; one on vLLM differs (other answers)."""
    from evertrain.envs.base import Problem
    from evertrain.inference.campaign import Inference
    from evertrain.runtime import Runtime
    from evertrain.tasks.evaluate import generation_key

    rt = Runtime.open(smoke_config)
    problem = rt.env("arithmetic").problems("eval", 1, 0)[0]
    assert isinstance(problem, Problem)
    hf_key = generation_key(rt, problem)
    vllm = smoke_config.model_copy(update={"generation": smoke_config.generation.model_copy(
        update={"backend": "vllm"})})
    rt_vllm = SimpleNamespace(config=vllm, env=rt.env, inference=Inference(vllm, rt.env))  # nothing started
    assert generation_key(rt_vllm, problem) != hf_key


def test_the_engine_hashes_a_folder_as_the_parent_does(tmp_path):
    """The vLLM engine's interpreter cannot import evertrain: its copy of the digest must agree."""
    from evertrain.inference.vllm_engine import folder_digest
    from evertrain.models.checkpoint import checkpoint_digest

    for name, data in [("a/b.bin", b"1"), ("a-c.bin", b"2"), ("z.json", b"{}"), ("a/d/e.safetensors", b"3" * 99)]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert folder_digest(str(tmp_path)) == checkpoint_digest(tmp_path)


def test_vllm_without_its_interpreter_is_refused_at_start(models_dir, tmp_path):
    from evertrain.inference.backends import check_backend
    from evertrain.inference.base import BackendError

    model = models_dir / "tiny-llama"
    config = _vllm_config(model, vllm_python=str(tmp_path / "no-such" / "python"))
    with pytest.raises(BackendError, match=r"generation\.vllm_python = .*no-such.*does not exist"):
        check_backend(config, str(model))


def test_the_head_size_refusal_is_for_cpu_engines_only(tmp_path):
    """Workers that reserve a GPU run vLLM's GPU kernels: a head size the CPU kernels lack is no reason to refuse."""
    from evertrain.inference.backends import check_backend
    from evertrain.inference.base import BackendError, BackendWarning
    from evertrain.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "head16", hidden=64, heads=4)
    config = _vllm_config(model)
    on_gpus = config.model_copy(update={
        "model": config.model.model_copy(update={"device": "auto"}),
        "cluster": CampaignConfig.model_validate({"cluster": {"address": "local", "gpus_per_worker": 1}}).cluster})
    with pytest.warns(BackendWarning):
        check_backend(on_gpus, str(model))
    on_cpus = on_gpus.model_copy(update={"cluster": on_gpus.cluster.model_copy(update={"gpus_per_worker": 0})})
    with pytest.raises(BackendError, match="head size 16"):
        check_backend(on_cpus, str(model))


def test_checkpoint_digest_reads_a_file_again_only_when_it_changed(tmp_path):
    """The endpoint and the workers take a checkpoint's digest on every open: a second digest of unchanged
    weights costs a stat per file, not a read of every byte; a rewrite (same size) is still seen."""
    from evertrain.models.checkpoint import checkpoint_digest

    folder = tmp_path / "big"
    folder.mkdir()
    weights = folder / "model.safetensors"
    with weights.open("wb") as file:  # sparse: 512 MiB to hash, no disk used
        file.truncate(512 << 20)
    time.sleep(2.2)  # older than the racy window: a file this old may be remembered
    began = time.perf_counter()
    first = checkpoint_digest(folder)
    cold = time.perf_counter() - began
    began = time.perf_counter()
    assert checkpoint_digest(folder) == first
    warm = time.perf_counter() - began
    assert warm < cold / 20, (cold, warm)
    with weights.open("r+b") as file:
        file.seek(100)
        file.write(b"\1")
    assert checkpoint_digest(folder) != first
