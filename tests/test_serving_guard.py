"""The endpoint's request hygiene on a real port (issue 45): a foreign Host, a cross-origin POST and a
non-JSON body are refused before any handler runs; /feedback takes only finite rewards in range, for traces
that exist. The real endpoint (uvicorn, the tiny model, the real store)."""

from __future__ import annotations

import httpx
import pytest

from evertrain.config import ServingConfig
from evertrain.data.store import now
from evertrain.runtime import Runtime
from evertrain.serving.app import TRACE_HEADER, EndpointServer
from tests.conftest import api_key, bearer, smoke_config_in

CHAT = {"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
APP_ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def live(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("guard")
    config = smoke_config_in(root, models_dir, name="guarded", environments=[{"name": "calculator", "weight": 1}],
                             model={"rollout_dtype": "float32"}, torch_threads=1,
                             serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2,
                                      "allowed_hosts": ["localhost", "127.0.0.1", "::1", "api.example.test"],
                                      "cors_origins": [APP_ORIGIN]})
    rt = Runtime.open(config)
    rt.ensure_started()
    with EndpointServer(config, port=0, store=rt.store) as server, \
            httpx.Client(headers=bearer(api_key(rt.store, "infer,feedback"))) as http:
        server.http = http  # every request below carries a key (serving.auth = "keys", the default)
        yield server
    rt.close()


def _refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"], error


def _traces(server: EndpointServer) -> int:
    assert server.endpoint.writer.flush(60)
    return int(server.endpoint.store.scalar("SELECT count(*) FROM traces"))


def test_defaults_allow_loopback_and_no_cors():
    serving = ServingConfig()
    assert set(serving.allowed_hosts) == {"localhost", "127.0.0.1", "::1"} and serving.cors_origins == []


def test_a_foreign_host_is_refused(live):
    url = live.url
    before = _traces(live)
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example"):
        _refused(live.http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"host": host}, timeout=60),
                 421, "host_not_allowed")
        _refused(live.http.get(f"{url}/v1/models", headers={"host": host}, timeout=60), 421, "host_not_allowed")
    assert _traces(live) == before  # never reached the model
    port = url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", "api.example.test"):
        assert live.http.get(f"{url}/v1/models", headers={"host": host}, timeout=60).status_code == 200, host


def test_a_cross_origin_post_is_refused(live):
    url = live.url
    before = _traces(live)
    for origin in ("https://evil.example", "null", "http://localhost:3000"):
        _refused(live.http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"origin": origin}, timeout=60),
                 403, "origin_not_allowed")
        preflight = live.http.options(f"{url}/v1/chat/completions", timeout=60, headers={
            "origin": origin, "access-control-request-method": "POST"})
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    assert _traces(live) == before
    # the configured origin gets CORS: its preflight is answered and its POST carries the allow header
    preflight = live.http.options(f"{url}/v1/chat/completions", timeout=60, headers={
        "origin": APP_ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    answer = live.http.post(f"{url}/v1/chat/completions", json=CHAT, headers={"origin": APP_ORIGIN}, timeout=120)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP_ORIGIN


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_non_json_post_is_refused(live, content_type):
    body = b'{"model": "guarded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    for path in ("/v1/chat/completions", "/feedback"):
        _refused(live.http.post(f"{live.url}{path}", content=body, headers={"content-type": content_type}, timeout=60),
                 415, "unsupported_media_type")
    ok = live.http.post(f"{live.url}/v1/chat/completions", content=body, timeout=120,
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def _answered(live: EndpointServer) -> str:
    response = live.http.post(f"{live.url}/v1/chat/completions", json=CHAT, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers[TRACE_HEADER]


def _feedback_rows(live: EndpointServer, trace_id: str) -> int:
    assert live.endpoint.writer.flush(60)
    return int(live.endpoint.store.scalar("SELECT count(*) FROM trace_feedback WHERE trace_id = ?", [trace_id]))


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "-Infinity", "1e999", "1.5", "-0.1", "2"])
def test_feedback_takes_only_finite_rewards_in_range(live, reward):
    trace_id = _answered(live)
    body = f'{{"trace_id": "{trace_id}", "passed": true, "reward": {reward}}}'
    response = live.http.post(f"{live.url}/feedback", content=body, headers={"content-type": "application/json"},
                          timeout=60)
    _refused(response, 400, "invalid_feedback")
    assert response.json()["error"]["param"] == "reward"
    assert _feedback_rows(live, trace_id) == 0
    assert live.http.post(f"{live.url}/feedback", json={"trace_id": trace_id, "passed": True, "reward": 0.5},
                      timeout=60).status_code == 200
    assert _feedback_rows(live, trace_id) == 1


def test_feedback_only_for_traces_that_exist(live):
    for unknown in ("chatcmpl-doesnotexist", "x" * 200):
        response = live.http.post(f"{live.url}/feedback", json={"trace_id": unknown, "passed": False}, timeout=60)
        _refused(response, 404, "trace_not_found")
        assert _feedback_rows(live, unknown) == 0
    # answered just now (its trace maybe not yet committed) and answered before (only in the store)
    fresh = _answered(live)
    response = live.http.post(f"{live.url}/feedback", json={"trace_id": fresh, "passed": True}, timeout=60)
    assert response.status_code == 200, response.text
    assert live.endpoint.writer.flush(60)
    key_id = live.endpoint.store.trace_owner(fresh)[1]
    assert key_id is not None
    stored = "chatcmpl-from-another-endpoint"  # answered for the same key by another endpoint on this store
    live.endpoint.store.append("traces", [{"trace_id": stored, "campaign": "guarded", "status": "ok",
                                           "created_at": now(), "key_id": key_id}])
    assert live.http.post(f"{live.url}/feedback", json={"trace_id": stored, "passed": True}, timeout=60).status_code \
        == 200
    assert _feedback_rows(live, fresh) == 1 and _feedback_rows(live, stored) == 1


def test_feedback_only_for_the_caller_s_own_traces(live):
    mine = _answered(live)
    other_key = api_key(live.endpoint.store, "infer,feedback", name="other-client")
    with httpx.Client(headers=bearer(other_key)) as other:
        theirs = other.post(f"{live.url}/v1/chat/completions", json=CHAT, timeout=120)
        assert theirs.status_code == 200, theirs.text
        their_id = theirs.headers[TRACE_HEADER]
        # neither may give feedback on the other's trace, fresh or stored: answered as if it did not exist
        _refused(other.post(f"{live.url}/feedback", json={"trace_id": mine, "passed": False}, timeout=60), 404,
                 "trace_not_found")
        assert live.endpoint.writer.flush(60)
        _refused(live.http.post(f"{live.url}/feedback", json={"trace_id": their_id, "passed": True}, timeout=60),
                 404, "trace_not_found")
        assert other.post(f"{live.url}/feedback", json={"trace_id": their_id, "passed": True},
                          timeout=60).status_code == 200
    assert _feedback_rows(live, mine) == 0 and _feedback_rows(live, their_id) == 1
    stored = live.endpoint.store.query("SELECT key_id FROM traces WHERE trace_id = ?", [their_id])
    assert stored["key_id"].iloc[0] is not None  # the trace names its key: what the ownership check reads
    admin = api_key(live.endpoint.store, "feedback,admin", name="operator")
    assert live.http.post(f"{live.url}/feedback", json={"trace_id": mine, "passed": True}, timeout=60,
                          headers=bearer(admin)).status_code == 200  # an admin key may label any trace
    assert _feedback_rows(live, mine) == 1
