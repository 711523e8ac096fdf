"""The endpoint over vLLM's own OpenAI-compatible server (``generation.backend = "vllm"``), with the official
``openai`` client: vLLM answers (its reply names the version), the trace is stored, and a promotion to a LoRA
version is loaded into the running vLLM server at runtime and served.

vLLM runs under its own interpreter (``.venv-vllm``, built by ``make vllm``): skipped without it, unless
EVERTRAIN_REQUIRE_VLLM=1 (``make test``), where a missing interpreter fails instead.
"""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest
import torch

from evertrain.runtime import Runtime
from evertrain.serving.app import MODEL_HEADER, EndpointServer
from evertrain.tasks.promote import rollback
from tests.conftest import ROOT, api_key, smoke_config_in

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and os.environ.get("EVERTRAIN_REQUIRE_VLLM") != "1",
    reason=f"no vLLM interpreter at {VLLM_PYTHON} (build it with `make vllm`)")


@pytest.fixture(scope="module")
def on_vllm(tmp_path_factory, models_dir):
    """Campaign 'vl': v1 the tiny base model, v2 a LoRA adapter on it that changes what it writes."""
    from peft import LoraConfig, get_peft_model

    from evertrain.data.store import now
    from evertrain.models.checkpoint import load_policy, save_checkpoint, write_base_checkpoint

    root = tmp_path_factory.mktemp("endpoint-vllm")
    base = models_dir / "tiny-llama"
    config = smoke_config_in(
        root, models_dir, name="vl", environments=[{"name": "calculator", "weight": 1}],
        model={"path": str(base), "rollout_dtype": "float32"}, torch_threads=1,
        update={"finetune": "lora", "lora": {"rank": 8}},
        generation={"backend": "vllm", "vllm_python": str(VLLM_PYTHON), "vllm_kv_cache_gib": 0.25,
                    "max_new_tokens": 16},
        serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2})
    rt = Runtime.open(config)
    rt.ensure_started()
    torch.manual_seed(1)
    peft = get_peft_model(load_policy(write_base_checkpoint(root / "b", str(base)))[0],
                          LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    for name, weight in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(weight, std=0.5)
    lora = save_checkpoint(peft, root / "checkpoints" / "v2", str(base))
    version = rt.tracker.register(lora, run_id=None, iteration=0)
    rt.store.replace("model_versions", {"campaign": "vl", "version": version}, [{
        "campaign": "vl", "version": version, "iteration": 0, "kind": "lora", "path": rt.stored_path(lora),
        "parent_version": 1, "created_at": now()}])
    with EndpointServer(config, port=0, store=rt.store) as server:  # the context's connection, shared
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key(rt.store), max_retries=0, timeout=300)
        yield config, rt, server, client, version


def test_vllm_answers_names_the_version_and_the_trace_is_stored(on_vllm):
    _config, rt, server, client, v2 = on_vllm
    servers = server.endpoint.champion.rt.inference.endpoint_servers
    assert servers is not None and servers.base.process.poll() is None  # vLLM's own server, a process of its own
    assert httpx.get(f"{servers.base.url}/health", timeout=30).status_code == 200

    raw = client.chat.completions.with_raw_response.create(
        model="vl", messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=8, temperature=0)
    first = raw.parse()
    assert first.model == raw.headers[MODEL_HEADER] == "vl@v1"
    extra = first.model_extra["evertrain"]
    assert extra["backend"] == "vllm-server" and extra["served_by"] == "vl@base" and extra["model_version"] == 1
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0

    # a promotion to the LoRA version: loaded into the running vLLM server (runtime LoRA API), then served
    rollback(rt, to_version=v2, reason="the LoRA version promoted by hand", allow_unpromoted=True)
    deadline = time.monotonic() + 300
    while True:
        answer = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                                max_tokens=8, temperature=0)
        if answer.model == f"vl@v{v2}":
            break
        assert answer.model == "vl@v1"
        assert time.monotonic() < deadline, server.endpoint.champion.last_error
        time.sleep(0.5)
    assert answer.model_extra["evertrain"]["served_by"] == f"vl@v{v2}"  # vLLM's own reply names the adapter
    assert f"vl@v{v2}" in servers.base.models()
    # no restart
    assert servers.base.process.pid == server.endpoint.champion.rt.inference.endpoint_servers.base.process.pid
    assert answer.choices[0].message.content != first.choices[0].message.content  # the adapter's answer

    assert server.endpoint.writer.flush(60)
    traces = server.endpoint.store.query(
        "SELECT trace_id, model_version, model, status, prompt_tokens, completion_tokens, cost_usd FROM traces "
        "WHERE trace_id IN (?, ?)", [first.id, answer.id]).set_index("trace_id")
    assert traces.loc[first.id, "model_version"] == 1 and traces.loc[answer.id, "model_version"] == v2
    assert traces.loc[answer.id, "model"] == f"vl@v{v2}" and (traces["status"] == "ok").all()
    assert (traces["prompt_tokens"] > 0).all() and (traces["completion_tokens"] > 0).all()
    assert traces.loc[first.id, "completion_tokens"] == first.usage.completion_tokens


def test_a_full_weights_version_gets_a_vllm_server_of_its_own(on_vllm, tmp_path):
    """Promoted to fully fine-tuned weights: a second vLLM server is started from the folder before the swap
    (the current version is served meanwhile), and it answers as that version."""
    from evertrain.data.store import now
    from evertrain.models.checkpoint import load_policy, save_checkpoint, write_base_checkpoint

    _config, rt, server, client, _v2 = on_vllm
    base = rt.base_model
    model = load_policy(write_base_checkpoint(tmp_path / "b", base))[0]
    torch.manual_seed(2)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.5)
    folder = save_checkpoint(model, tmp_path / "v3", base)
    version = rt.tracker.register(folder, run_id=None, iteration=1)
    rt.store.replace("model_versions", {"campaign": "vl", "version": version}, [{
        "campaign": "vl", "version": version, "iteration": 1, "kind": "full", "path": str(folder),
        "parent_version": 1, "created_at": now()}])
    champion = server.endpoint.champion
    before = champion.current.version
    rollback(rt, to_version=version, reason="full weights promoted by hand", allow_unpromoted=True)
    # while the new version's server starts, the one before is served; then the swap. The wait watches the
    # endpoint's own swap (no request): vLLM's worker spins for a second after every request it reads, so a
    # client asking every second would keep one core busy while the second server starts on the other
    meanwhile = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                               max_tokens=8, temperature=0)
    # (a server start takes seconds: answered before the swap, so by the version before)
    assert meanwhile.model == f"vl@v{before}" or champion.current.version == version
    deadline = time.monotonic() + 600
    while champion.current.version != version:
        assert time.monotonic() < deadline, champion.last_error
        time.sleep(0.2)
    answer = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                            max_tokens=8, temperature=0)
    assert answer.model == f"vl@v{version}"
    servers = server.endpoint.champion.rt.inference.endpoint_servers
    assert answer.model_extra["evertrain"]["served_by"] == f"vl@v{version}"
    full = servers.full[version]
    assert full.process.pid != servers.base.process.pid and full.models() == [f"vl@v{version}"]
