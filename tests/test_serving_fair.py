"""Fair serving (issue 45): a small request is not held behind a heavy neighbour's queue, silent and trickling
connections are closed, the number of open connections is bounded, a slow body gets a 408. The real endpoint on a
port (uvicorn, the tiny model, the real store)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from evertrain.runtime import Runtime
from evertrain.serving.app import EndpointServer
from evertrain.serving.auth import create_key
from tests.conftest import api_key, bearer, smoke_config_in

HEADER_S, BODY_S, CONNECTIONS, QUEUED = 1.0, 1.0, 6, 1500


@pytest.fixture(scope="module")
def live(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("fair")
    config = smoke_config_in(root, models_dir, name="fair", environments=[{"name": "calculator", "weight": 1}],
                             model={"rollout_dtype": "float32"}, torch_threads=1,
                             serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2,
                                      "header_timeout_seconds": HEADER_S, "body_timeout_seconds": BODY_S,
                                      "max_connections": CONNECTIONS, "max_queued_tokens": QUEUED})
    rt = Runtime.open(config)
    rt.ensure_started()
    with EndpointServer(config, port=0, store=rt.store) as server:
        yield server, bearer(api_key(rt.store, "infer"))
    rt.close()


def _chat(max_tokens: int) -> dict:
    # greedy: the untaught tiny model never stops early, so a request takes all its max_tokens (1000: about 1 s)
    return {"model": "fair", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0}


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def test_a_small_request_waits_only_for_the_call_already_running(live):
    """Three heavy requests (different sizes, so three calls) queue; a small one sent after them is sampled in the
    very next call, ahead of the heavy ones still waiting (first come, first served would put it last)."""
    server, key = live
    batcher = server.endpoint.batcher
    url = f"{server.url}/v1/chat/completions"
    done: dict[int, float] = {}
    keys = {size: bearer(api_key(server.endpoint.store, "infer")) for size in (1000, 999, 998)}  # a heavy neighbour
    keys[2] = key

    def send(max_tokens: int) -> None:
        response = httpx.post(url, json=_chat(max_tokens), headers=keys[max_tokens], timeout=300)
        assert response.status_code == 200, response.text
        done[max_tokens] = time.monotonic()

    heavy = [threading.Thread(target=send, args=(size,)) for size in (1000, 999, 998)]
    for thread in heavy:
        thread.start()
    deadline = time.monotonic() + 60
    while batcher.pending() < 2:  # one heavy call runs, two wait
        assert time.monotonic() < deadline, batcher.history
        time.sleep(0.01)
    sent = time.monotonic()
    send(2)
    for thread in heavy:
        thread.join(300)
    calls = [(started, sizes, waiting) for started, sizes, waiting in batcher.history if started >= sent - 5]
    small = next(i for i, (_, sizes, _) in enumerate(calls) if sizes == [2])
    waiting = calls[small][2]
    assert any(size >= 998 for size in waiting), calls  # a heavy request was still waiting: the small one jumped it
    assert not [c for c in calls[:small] if c[0] > sent], calls  # no call started between its arrival and its own
    assert sum(t < done[2] for size, t in done.items() if size != 2) <= 1  # answered before two of the three heavy


def test_silent_and_trickling_connections_are_closed_after_the_header_deadline(live):
    server, key = live
    before = _health(server)["header_timeouts"]
    host, port = server.url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    trickle = socket.create_connection((host, int(port)))
    trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    try:
        for _ in range(8):  # a header line every 0.25 s: data keeps coming, the headers never end
            trickle.sendall(b"X-Slow: 1\r\n")
            time.sleep(0.25)
    except OSError:
        pass  # closed by the server under our feet: what is asserted below
    for sock in (silent, trickle):
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):  # a reset is a close too
            assert sock.recv(100) == b""  # closed by the server, no response (a timeout here fails the test)
        sock.close()
    assert _health(server)["header_timeouts"] >= before + 2
    assert httpx.post(f"{server.url}/v1/chat/completions", json=_chat(2), headers=key, timeout=60).status_code == 200


def test_connections_beyond_the_bound_get_a_503_and_are_closed(live):
    server, key = live
    host, port = server.url.removeprefix("http://").split(":")
    connections = server.server.server_state.connections
    deadline = time.monotonic() + 30
    while connections and time.monotonic() < deadline:  # earlier tests' connections gone
        time.sleep(0.05)
    held = [socket.create_connection((host, int(port))) for _ in range(CONNECTIONS)]
    while len(connections) < CONNECTIONS and time.monotonic() < deadline:
        time.sleep(0.01)
    extra = socket.create_connection((host, int(port)))
    extra.settimeout(30)
    answer = b""
    while chunk := extra.recv(4096):
        answer += chunk
    extra.close()
    for sock in held:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer, answer
    assert _health(server)["connections_refused"] >= 1
    assert httpx.post(f"{server.url}/v1/chat/completions", json=_chat(2), headers=key, timeout=60).status_code == 200


def test_a_body_slower_than_its_deadline_gets_a_408(live):
    server, key = live
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)
    auth = next(iter(key.values()))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {auth}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode())
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer


def test_a_client_with_its_queue_full_gets_a_429_and_others_are_served(live):
    """serving.max_queued_tokens: one client's tokens waiting or being sampled are bounded; its next request is
    refused while its earlier one runs, another client's is served, and the first may send again once it ended."""
    server, _key = live
    url = f"{server.url}/v1/chat/completions"
    secret, row = create_key(server.endpoint.store, "busy", "infer", actor="pytest")
    busy, other = bearer(secret), bearer(api_key(server.endpoint.store, "infer"))
    first: list[httpx.Response] = []
    running = threading.Thread(target=lambda: first.append(httpx.post(url, json=_chat(1000), headers=busy,
                                                                      timeout=300)))
    running.start()
    deadline = time.monotonic() + 60
    while not server.endpoint.in_flight.held():
        assert time.monotonic() < deadline
        time.sleep(0.005)
    refused = httpx.post(url, json=_chat(1000), headers=busy, timeout=60)  # 1000 + 1000 > 1500 queued
    counted = server.endpoint.quotas.used(row["key_id"])
    served = httpx.post(url, json=_chat(2), headers=other, timeout=60)
    running.join(300)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
    assert counted[0] == 1, counted  # the refused request spent none of the client's per-minute quota
    assert served.status_code == 200 and first[0].status_code == 200
    assert httpx.post(url, json=_chat(2), headers=busy, timeout=60).status_code == 200  # its queue emptied
    assert _health(server)["queue_refused"] >= 1
