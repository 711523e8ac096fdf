"""Per-client quotas of the endpoint (issue 45): requests and tokens a minute per API key, 429 with Retry-After,
other clients unaffected. The real endpoint on a port (uvicorn, the tiny model, the real store)."""

from __future__ import annotations

import math

import httpx
import pytest

from evertrain.runtime import Runtime
from evertrain.serving.app import EndpointServer
from evertrain.serving.quota import Quotas
from tests.conftest import api_key, bearer, smoke_config_in

REQUESTS, TOKENS = 3, 200


def _chat(max_tokens: int = 2) -> dict:
    return {"model": "quota", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}


@pytest.fixture(scope="module")
def live(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("quota")
    config = smoke_config_in(root, models_dir, name="quota", environments=[{"name": "calculator", "weight": 1}],
                             model={"rollout_dtype": "float32"}, torch_threads=1,
                             serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2,
                                      "requests_per_minute": REQUESTS, "tokens_per_minute": TOKENS})
    rt = Runtime.open(config)
    rt.ensure_started()
    with EndpointServer(config, port=0, store=rt.store) as server:
        yield server
    rt.close()


def _limited(response: httpx.Response) -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"], error
    return error


def test_a_client_over_its_request_quota_gets_a_429_and_others_do_not(live):
    url = f"{live.url}/v1/chat/completions"
    busy, other = bearer(api_key(live.endpoint.store, "infer")), bearer(api_key(live.endpoint.store, "infer"))
    for _ in range(REQUESTS):
        assert httpx.post(url, json=_chat(), headers=busy, timeout=120).status_code == 200
    refused = httpx.post(url, json=_chat(), headers=busy, timeout=60)
    error = _limited(refused)
    assert error["type"] == "requests" and f"more than {REQUESTS} requests" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert httpx.post(url, json=_chat(), headers=other, timeout=120).status_code == 200  # a client of its own
    assert httpx.get(f"{live.url}/health", timeout=30).json()["quota_refused"] >= 1


def test_a_client_over_its_token_quota_gets_a_429(live):
    url = f"{live.url}/v1/chat/completions"
    heavy = bearer(api_key(live.endpoint.store, "infer"))
    assert httpx.post(url, json=_chat(120), headers=heavy, timeout=300).status_code == 200
    refused = httpx.post(url, json=_chat(120), headers=heavy, timeout=60)  # 2 x 121 > 200 tokens a minute
    assert _limited(refused)["type"] == "tokens" and "retry-after" in refused.headers
    # a request that could never pass says so, with no retry time
    never = httpx.post(url, json=_chat(TOKENS + 1), headers=bearer(api_key(live.endpoint.store, "infer")),
                       timeout=60)
    assert "ask for fewer" in _limited(never)["message"] and "retry-after" not in never.headers


def test_the_window_slides():
    quotas = Quotas(requests_per_minute=2, tokens_per_minute=100)
    assert quotas.admit("a", 10, at=0.0) is None and quotas.admit("a", 10, at=1.0) is None
    which, wait = quotas.admit("a", 10, at=30.0)
    assert which == "requests" and wait == pytest.approx(30.0)
    assert quotas.admit("a", 10, at=60.5) is None  # the first one left the window
    assert quotas.admit("b", 90, at=60.5) is None
    which, wait = quotas.admit("b", 20, at=61.0)
    assert which == "tokens" and wait == pytest.approx(59.5)
    assert quotas.admit("c", 101, at=0.0) == ("tokens", math.inf)
    assert quotas.refused == 3 and Quotas(0, 0).admit("x", 10**9) is None
