"""API keys on the real endpoint (a free local port, the real store, the tiny model): made, listed and revoked by
`evertrain keys` in its own process, required by default, checked per route scope, stored only hashed.

Keys made by the command (another process, another store connection) are the case a watcher would lag on: a
key must work on its first request, and a revoked one must stop working within ``serving.auth_cache_seconds``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from evertrain.config import CampaignConfig, ConfigError
from evertrain.runtime import Runtime
from evertrain.serving.app import TRACE_HEADER, EndpointServer
from tests.conftest import api_key, bearer, smoke_config_in

CACHE_SECONDS = 1.0  # serving.auth_cache_seconds here: the bound on a revoked key
CHAT = {"model": "keys", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def keys_command(store: str, *args: str) -> subprocess.CompletedProcess:
    """`evertrain keys ...` in its own process, on the test's store."""
    return subprocess.run([sys.executable, "-m", "evertrain.cli", "keys", *args, "--store", store],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "EVERTRAIN_PROGRESS": "0"})


@pytest.fixture(scope="module")
def served(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("keys")
    config = smoke_config_in(root, models_dir, name="keys", torch_threads=1,
                             serving={"poll_seconds": 0.5, "trace_flush_seconds": 0.2,
                                      "auth_cache_seconds": CACHE_SECONDS})
    assert config.serving.auth == "keys"  # the default
    with Runtime.open(config) as rt:  # closed before the endpoint opens the store
        rt.ensure_started()
    with EndpointServer(config, port=0) as server:
        yield config, server


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()["error"]
    assert body["code"] == code and body["type"] and body["message"], body
    return body


def test_no_key_or_a_wrong_key_gets_a_401_and_health_stays_open(served):
    _config, server = served
    url = server.url
    for path, method in (("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/feedback", "POST"),
                         ("/docs", "GET")):
        response = httpx.request(method, f"{url}{path}", json=CHAT, timeout=60)
        body = _error(response, 401, "invalid_api_key")
        assert body["type"] == "invalid_request_error" and "keys create" in body["message"]
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert TRACE_HEADER not in response.headers  # refused before it reached the model: nothing traced
    for wrong in ("et-" + "x" * 43, "sk-not-ours", "et-"):
        _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(wrong), timeout=60), 401,
               "invalid_api_key")
    _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Basic et-abc"},
                      timeout=60), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as refused:  # what the openai client makes of it
        openai.OpenAI(base_url=f"{url}/v1", api_key="et-wrong", max_retries=0, timeout=60).chat.completions.create(
            model="keys", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    health = httpx.get(f"{url}/health", timeout=60)  # open: whether and which version is served, nothing else
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["watcher_error"] is None
    assert server.endpoint.keys.refused >= 9


def test_a_key_made_by_the_command_works_on_its_first_request_and_its_traces_name_it(served):
    config, server = served
    made = keys_command(config.paths.store, "create", "--name", "first-request", "--scopes", "infer")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("et-") and len(secret) >= 40 and "\n" not in secret
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="keys", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.model == "keys@v1"
    assert client.models.list().data[0].id == "keys"
    listed = keys_command(config.paths.store, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert secret not in listed.stdout and "first-request" in listed.stdout and "key_sha256" not in listed.stdout
    key_id = server.endpoint.store.query("SELECT key_id FROM api_keys WHERE name = 'first-request'")["key_id"][0]
    assert server.endpoint.writer.flush(60)
    traced = server.endpoint.store.query("SELECT key_id FROM traces WHERE trace_id = ?", [answer.id])
    assert traced["key_id"].tolist() == [key_id]


def test_a_revoked_key_is_refused_within_the_cache_bound_and_both_steps_are_audited(served):
    config, server = served
    made = keys_command(config.paths.store, "create", "--name", "to-revoke", "--scopes", "infer,feedback",
                        "--actor", "alice")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    url = server.url
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(secret), timeout=120).status_code == 200
    revoked = keys_command(config.paths.store, "revoke", "to-revoke", "--actor", "bob")
    done = time.monotonic()
    assert revoked.returncode == 0, revoked.stderr
    while True:
        response = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(secret), timeout=120)
        if response.status_code == 401:
            break
        assert response.status_code == 200
        # the bound: the cache's age limit, plus a request's own time on this loaded machine
        assert time.monotonic() - done < CACHE_SECONDS + 3, "a revoked key still works"
        time.sleep(0.1)
    _error(response, 401, "invalid_api_key")
    print(f"revoked key refused {time.monotonic() - done:.2f} s after `evertrain keys revoke` returned")
    assert keys_command(config.paths.store, "revoke", "to-revoke").returncode == 2  # nothing left to revoke
    events = server.endpoint.store.api_key_events()
    mine = events[events["name"] == "to-revoke"]
    assert mine["action"].tolist() == ["create", "revoke"] and mine["actor"].tolist() == ["alice", "bob"]
    assert mine["happened_at"].notna().all() and mine["host"].notna().all()
    row = server.endpoint.store.query("SELECT revoked_at, revoked_by FROM api_keys WHERE name = 'to-revoke'")
    assert row["revoked_by"].tolist() == ["bob"] and row["revoked_at"].notna().all()


def test_each_route_needs_its_scope(served):
    _config, server = served
    url = server.url
    infer = api_key(server.endpoint.store, "infer")
    feedback = api_key(server.endpoint.store, "feedback")
    both = api_key(server.endpoint.store, "infer,feedback")
    answered = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(both), timeout=120)
    assert answered.status_code == 200
    trace_id = answered.json()["id"]
    verdict = {"trace_id": trace_id, "passed": True}
    body = _error(httpx.post(f"{url}/feedback", json=verdict, headers=bearer(infer), timeout=60), 403,
                  "insufficient_scope")
    assert "'feedback'" in body["message"]
    _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(feedback), timeout=60), 403,
           "insufficient_scope")
    _error(httpx.get(f"{url}/openapi.json", headers=bearer(infer), timeout=60), 403, "insufficient_scope")
    # the feedback scope alone labels only its own traces: another key's is answered as if it did not exist
    _error(httpx.post(f"{url}/feedback", json=verdict, headers=bearer(feedback), timeout=60), 404, "trace_not_found")
    assert httpx.post(f"{url}/feedback", json=verdict, headers=bearer(both), timeout=60).status_code == 200
    admin = api_key(server.endpoint.store, "admin")
    assert httpx.get(f"{url}/openapi.json", headers=bearer(admin), timeout=60).status_code == 200


def test_the_store_keeps_the_hash_never_the_secret(served):
    _config, server = served
    secret = api_key(server.endpoint.store, "infer", name="hashed")
    store = server.endpoint.store
    row = store.query("SELECT * FROM api_keys WHERE name = 'hashed'").iloc[0]
    assert row["key_sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(row["prefix"]) and len(row["prefix"]) <= 10
    for table in ("api_keys", "api_key_events"):  # no column of any row holds it
        for column, value in store.query(f"SELECT * FROM {table}").astype(str).items():
            assert not value.str.contains(secret, regex=False).any(), (table, column)
    assert server.endpoint.writer.flush(60)
    location = store.location  # nor any file of the store (Parquet data and the SQLite catalog)
    files = [p for p in Path(location.data_path).rglob("*") if p.is_file()] + [Path(location.target)]
    assert len(files) > 1
    for path in files:
        assert secret.encode() not in path.read_bytes(), path


def test_auth_none_is_allowed_only_on_loopback(tmp_path, models_dir):
    with pytest.raises(ValueError, match="loopback"):  # pydantic's ValidationError (load_config: ConfigError)
        smoke_config_in(tmp_path, models_dir, serving={"auth": "none", "host": "0.0.0.0"})
    with pytest.raises(ValueError, match="loopback"):
        smoke_config_in(tmp_path, models_dir, serving={"auth": "none", "host": "endpoint.example.org"})
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert smoke_config_in(tmp_path, models_dir, serving={"auth": "none", "host": host}).serving.auth == "none"
    config = smoke_config_in(tmp_path, models_dir, name="open", serving={"auth": "none"})
    # a host given on the command line (`evertrain endpoint --host`) is checked too, before anything is loaded
    with pytest.raises(ConfigError, match="loopback"):
        EndpointServer(config, host="0.0.0.0", port=0)


def test_auth_none_on_loopback_serves_without_a_key(tmp_path, models_dir):
    config = smoke_config_in(tmp_path, models_dir, name="open", serving={"auth": "none", "trace": False})
    with Runtime.open(config) as rt:
        rt.ensure_started()
    with EndpointServer(config, port=0) as server:
        assert server.endpoint.keys is None
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": "open"}, timeout=120)
        assert response.status_code == 200, response.text


def test_config_validation_message_when_loaded_from_a_file(tmp_path):
    from evertrain.config import load_config

    path = tmp_path / "open.toml"
    path.write_text('[serving]\nauth = "none"\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match=r"serving\.auth = 'none'"):
        load_config(path)
    assert CampaignConfig().serving.auth == "keys"
