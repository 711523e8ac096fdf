"""The endpoint's audit survives bad input (issue 45): an unpaired surrogate is refused with a 400 and its trace
stored with the surrogate escaped, without blocking the traces after it; a row the store refuses is set aside
(counted, kept in the failed-row file) while the rest of its batch is written; every malformed body gets an
OpenAI-style JSON 4xx, never a 500, and is traced. The real endpoint (uvicorn, the tiny model, the real store)."""

from __future__ import annotations

import json
import time

import duckdb
import httpx
import pytest

from evertrain.data.store import Store, now
from evertrain.runtime import Runtime
from evertrain.serving.app import TRACE_HEADER, EndpointServer
from evertrain.serving.traces import TraceWriter
from tests.conftest import api_key, bearer, smoke_config_in, store_uri

CHAT = {"model": "audited", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def live(tmp_path_factory, models_dir):
    root = tmp_path_factory.mktemp("audit")
    config = smoke_config_in(root, models_dir, name="audited", environments=[{"name": "calculator", "weight": 1}],
                             model={"rollout_dtype": "float32"}, torch_threads=1,
                             serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2})
    rt = Runtime.open(config)
    rt.ensure_started()
    with EndpointServer(config, port=0, store=rt.store) as server, \
            httpx.Client(headers=bearer(api_key(rt.store, "infer,feedback"))) as http:
        server.http = http
        yield server
    rt.close()


def _post(live: EndpointServer, body: bytes) -> httpx.Response:
    return live.http.post(f"{live.url}/v1/chat/completions", content=body, timeout=120,
                          headers={"content-type": "application/json"})


def _trace(live: EndpointServer, trace_id: str) -> dict:
    assert live.endpoint.writer.flush(60), "the trace writer is stuck"
    frame = live.endpoint.store.query("SELECT * FROM traces WHERE trace_id = ?", [trace_id])
    assert len(frame) == 1, trace_id
    return frame.iloc[0].to_dict()


def test_an_unpaired_surrogate_is_refused_and_traced_escaped_and_blocks_nothing(live):
    body = b'{"model": "audited", "max_tokens": 2, "messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    bad = _post(live, body)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "invalid_unicode" and "surrogate" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "messages[0].content"
    stored = _trace(live, bad.headers[TRACE_HEADER])
    # the text of the escape, six characters, where the surrogate was
    assert json.loads(stored["request"])["messages"][0]["content"] == "bad \\ud800 text"
    assert stored["http_status"] == 400
    good = [live.http.post(f"{live.url}/v1/chat/completions", json=CHAT, timeout=120) for _ in range(3)]
    assert all(r.status_code == 200 for r in good), [r.text for r in good]
    for response in good:
        assert _trace(live, response.headers[TRACE_HEADER])["status"] == "ok"
    # feedback whose detail has one is refused the same way, and traces still flow
    answered = good[0].headers[TRACE_HEADER]
    refused = live.http.post(f"{live.url}/feedback", timeout=60, headers={"content-type": "application/json"},
                             content=b'{"trace_id": "%s", "passed": true, "detail": "\\udc00"}' % answered.encode())
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_unicode", refused.text
    assert live.endpoint.writer.flush(60) and live.endpoint.writer.failed_rows == 0


def test_a_row_the_store_refuses_is_set_aside_and_the_batch_written(tmp_path):
    store = Store(store_uri(tmp_path))
    failed = tmp_path / "failed.jsonl"
    writer = TraceWriter(store, batch_rows=1000, flush_seconds=30, failed_path=failed)
    try:
        def row(i: int, latency: object) -> dict:
            return {"trace_id": f"t{i}", "campaign": "c", "status": "ok", "http_status": 200, "latency_ms": latency,
                    "created_at": now(), "request": '{"text": "surrogate \ud800 escaped"}'}

        for i in range(9):
            writer.add_trace(row(i, "not a number" if i == 4 else float(i)))  # the store cannot cast this one
        assert writer.flush(30), f"stuck with {writer.backlog()} rows"
        ids = set(store.query("SELECT trace_id FROM traces")["trace_id"])
        assert ids == {f"t{i}" for i in range(9)} - {"t4"}
        assert writer.failed_rows == 1
        kept = [json.loads(line) for line in failed.read_text().splitlines()]
        assert [k["row"]["trace_id"] for k in kept] == ["t4"] and kept[0]["table"] == "traces" and kept[0]["error"]
        assert {json.loads(text)["text"] for text in store.query("SELECT request FROM traces")["request"]} == {
            "surrogate \\ud800 escaped"}
        # a run of bad rows at the head of a batch: they go last until the good ones are written, then aside
        for i in range(10, 26):
            writer.add_trace(row(i, "bad" if i < 15 else float(i)))
        assert writer.flush(30), f"stuck with {writer.backlog()} rows"
        ids = set(store.query("SELECT trace_id FROM traces")["trace_id"])
        assert ids >= {f"t{i}" for i in range(15, 26)} and not ids & {f"t{i}" for i in range(10, 15)}
        assert writer.failed_rows == 6 and len(failed.read_text().splitlines()) == 6
    finally:
        writer.close()
        store.close()



def test_when_the_store_takes_nothing_the_rows_stay_queued_then_go_to_the_file_at_close(tmp_path):
    """A store that refuses every write (read-only here; down, in life) sets no row aside as bad: the rows wait,
    and those still unwritten when the writer closes are kept in the failed-row file, not lost."""
    Store(store_uri(tmp_path)).close()
    store = Store(store_uri(tmp_path), read_only=True)
    failed = tmp_path / "failed.jsonl"
    writer = TraceWriter(store, batch_rows=1000, flush_seconds=0.05, failed_path=failed)
    try:
        for i in range(5):
            writer.add_trace({"trace_id": f"t{i}", "campaign": "c", "status": "ok", "created_at": now()})
        assert not writer.flush(1.5) and writer.backlog() == 5
        assert writer.errors >= 2 and writer.failed_rows == 0 and not failed.exists()
    finally:
        writer.close(timeout=1)
        store.close()
    kept = [json.loads(line) for line in failed.read_text().splitlines()]
    assert sorted(k["row"]["trace_id"] for k in kept) == [f"t{i}" for i in range(5)]
    assert {k["error"] for k in kept} == {"not written when the writer closed"} and writer.failed_rows == 5

DEEP = b"[" * 100_000 + b"]" * 100_000
MALFORMED = [
    b"", b"null", b"[]", b"42", b'"text"', b"{", b"{'model': 1}", b"\xff\xfe", b"\x00", DEEP,
    b'{"model": "audited", "messages": ' + b"[" * 200 + b"]" * 200 + b"}",
    b'{"model": "audited", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
    b'{"model": "audited", "messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 1e999}',
    b'{"model": "audited", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"model": "audited", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
]
FIELDS = {
    "model": [None, 1, [], {}, "", "other"],
    "messages": [None, 1, "hi", {}, [], [1], ["hi"], [None], [[]], [{}], [{"role": 1}],
                 [{"role": "user", "content": 1}], [{"role": "user", "content": [1]}],
                 [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"role": "user", "content": {"a": 1}}], [{"role": "assistant", "content": "x", "tool_calls": 1}],
                 [{"role": "assistant", "content": "x", "tool_calls": "abc"}],
                 [{"role": "assistant", "content": "x", "tool_calls": [{"function": "python"}]}],
                 [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": 1}}]}],
                 [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "calculator",
                                                                                      "arguments": 5}}]}],
                 [{"role": "tool", "content": "x", "name": 5}], [{"role": "tool", "content": "x", "name": {}}]],
    "max_tokens": [0, -1, 1.5, "5", True, [], 10**30],
    "max_completion_tokens": ["x", {}],
    "temperature": ["hot", -1, 99, [], {}, True],
    "top_p": ["x", 2, []],
    "n": [0, 99, "2", 1.0, []],
    "seed": ["x", 1.5, [], 10**40],
    "stop": [1, [1], ["a"] * 9, [""], {}],
    "stream": [[], {}, "yes"],
    "stream_options": [1, "x", [], {"include_usage": []}],
    "tools": [1, "x", {}, [1], [{"function": "calculator"}], [{"function": {"name": 1}}], [{"function": []}]],
    "tool_choice": [[], {}, 1],
    "evertrain": [1, "x", [], {}, {"env": 1}, {"env": "nope"}, {"env": "calculator", "problem": 1},
                  {"env": "calculator", "problem": "x"}, {"env": "calculator", "problem": []},
                  {"env": "calculator", "problem": {"answer": {}}}, {"env": "calculator", "problem_id": []},
                  {"env": "calculator", "problem_id": "missing"}],
}


def _battery() -> list[bytes]:
    bodies = list(MALFORMED)
    for field, values in FIELDS.items():
        bodies += [json.dumps({**CHAT, field: value}).encode() for value in values]
    return bodies


def test_every_malformed_body_gets_a_json_4xx_and_a_trace(live):
    failures = []
    for body in _battery():
        response = _post(live, body)
        try:
            error = response.json().get("error") if response.status_code >= 400 else None
        except ValueError:
            error = None
        if response.status_code >= 500 or (response.status_code >= 400 and not (error and error.get("code"))):
            failures.append((body[:120], response.status_code, response.text[:200]))
            continue
        trace = _trace(live, response.headers[TRACE_HEADER])
        assert trace["http_status"] == response.status_code, (body[:120], trace)
    assert not failures, "\n".join(map(str, failures))
    assert live.endpoint.internal_errors == 0


# (what, text around the secret, the secret): each secret must be gone from its redacted text
SECRETS = [
    ("OpenAI key", "key {}", "sk-" + "a1B2" * 6),
    ("OpenAI project key", "OPENAI_API_KEY {}", "sk-proj-" + "Zz9_" * 8),
    ("GitHub classic token", "push with {}", "ghp_" + "A1b2C3d4" * 5),
    ("GitHub fine-grained token", "token is {} ok", "github_pat_11ABCDEFG0" + "x1Y2z3" * 10),
    ("GitLab token", "use {} here", "glpat-" + "Ab1-Cd2_Ef3" * 2),
    ("Hugging Face token", "HF {}", "hf_" + "AbCdEfGh12" * 4),
    ("npm token", "//registry.npmjs.org/:_authToken {}", "npm_" + "a1B2c3D4e5F6" * 3),
    ("Stripe secret key", "stripe {}", "sk_live_" + "51HxYz" * 5),
    ("Stripe restricted key", "stripe {}", "rk_live_" + "51HxYz" * 5),
    ("Stripe publishable key", "stripe {}", "pk_live_" + "51HxYz" * 5),
    ("Stripe test key", "stripe {}", "sk_test_" + "4eC39HqLyjWDarjtT1zdp7dc"),
    ("SendGrid key", "mail {}", "SG." + "ngeVfQFYQlKU0ufo8x5d1A" + "." + "TwL2iGABf9DHoTf-09kqeF8tAmbihYzrnopKc-1s5cr"),
    ("Twilio API key", "twilio {}", "SK" + "0123456789abcdef" * 2),
    ("AWS access key id", "aws {}", "AKIA" + "IOSFODNN7EXAMPLE"),
    ("AWS secret key", "aws_secret_access_key = {}", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    ("Slack bot token", "slack {}", "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOp"),
    ("Slack webhook", "post to {} now", "https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXXXXXXXXXXXXXXXXXX"),
    ("Google API key", "maps {}", "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"),
    ("JWT", "cookie: session={}", "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
                                  "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"),
    ("Bearer header", "Authorization: Bearer {}", "abcdef0123456789.token"),
    ("Basic auth header", "Authorization: Basic {}", "YWxhZGRpbjpvcGVuc2VzYW1l"),
    ("Visa card", "card {} exp 12/29", "4111 1111 1111 1111"),
    ("Mastercard", "pay with {}.", "5555-5555-5555-4444"),
    ("Amex card", "amex {}", "3782 822463 10005"),
    ("card number unspaced", "cc={}", "4012888888881881"),
    ("Azure connection string", "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={};EndpointSuffix=x",
     "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="),
    ("URL with password", "DATABASE_URL=postgres://admin:{}@db.internal:5432/app", "hunter2-Secret"),
    ("private key", "{}", "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\n-----END RSA PRIVATE KEY-----"),
    ("password assignment", "password={}", "correct-horse-battery"),
]
CONTROLS = [
    "The answer is 1234 5678.",
    "17 * 23 = 391, and 2**53 = 9007199254740992",
    "4111111111111112 is not a valid card (Luhn fails), nor is 5555 5555 5555 4445",
    "pi = 3.14159265358979323846, e = 2.718281828459045",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Basic arithmetic: 2 + 2 = 4, and basic questions are welcome",
    "def f(x):\n    return {'token_count': x * 2, 'key': 'value'}\n",
    "See https://example.com/docs/page?x=1 and http://localhost:8080/v1/chat?a=b:c",
    "ISBN 978-3-16-148410-0, phone +1 555 123 4567, order #20240512123456",
    "trace chatcmpl-4111111111111111abc and id a5555555555554444",  # digits inside an identifier
    "The JWT spec (RFC 7519) says a token has three parts: header.payload.signature",
]


def test_redaction_covers_common_secret_formats_and_keeps_ordinary_text():
    from evertrain.config import RedactionConfig
    from evertrain.serving.redact import Redactor

    rule = Redactor(RedactionConfig())
    stored = []
    for what, around, secret in SECRETS:
        redacted = rule.text(around.format(secret))
        stored.append((what, redacted))
        assert "[REDACTED]" in redacted, (what, redacted)
    kept = [(what, redacted) for (what, _, secret), (_, redacted) in zip(SECRETS, stored, strict=True)
            if secret in redacted]
    assert not kept, kept
    assert [rule.text(text) for text in CONTROLS] == CONTROLS
    # a URL keeps its scheme, user and host; a header its scheme: what was there stays readable
    assert rule.text("postgres://admin:pw123@db:5432/app") == "postgres://admin:[REDACTED]@db:5432/app"
    assert rule.text("Authorization: Basic YWxhZGRpbjpvcGVuc2VzYW1l") == "Authorization: Basic [REDACTED]"


def test_the_endpoint_stores_none_of_the_secrets(live):
    text = "\n".join(around.format(secret) for _, around, secret in SECRETS)
    response = live.http.post(f"{live.url}/v1/chat/completions", timeout=120,
                              json={**CHAT, "messages": [{"role": "user", "content": text}]})
    assert response.status_code == 200, response.text
    stored = _trace(live, response.headers[TRACE_HEADER])["request"]
    content = json.loads(stored)["messages"][0]["content"]
    assert [what for what, _, secret in SECRETS if secret in content] == []
    assert content.count("[REDACTED]") >= len(SECRETS)


def test_a_request_may_name_only_the_campaign_s_environments(live):
    """Naming 'code' on a calculator campaign would have the endpoint run the client's own tests in its sandbox."""
    task = {"env": "code", "problem": {"prompt": "double x", "tests": ["assert double(2) == 4"]}}
    response = live.http.post(f"{live.url}/v1/chat/completions", timeout=120, json={**CHAT, "evertrain": task})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unknown_env" and error["param"] == "evertrain.env"
    assert "'code'" in error["message"] and "calculator" in error["message"]
    assert _trace(live, response.headers[TRACE_HEADER])["http_status"] == 400
    assert "code" not in live.endpoint._envs  # never built, so its grader never ran
    # the campaign's own environment is still taken
    ok = live.http.post(f"{live.url}/v1/chat/completions", timeout=120, json={**CHAT, "evertrain": {
        "env": "calculator", "problem": {"question": "What is 2 + 2?", "answer": "4"}}})
    assert ok.status_code == 200, ok.text


def test_code_the_endpoint_grades_is_audited_in_sandbox_runs(tmp_path, models_dir):
    """A named code task: the answer runs in the sandbox (candidate and tests), and each process is a
    sandbox_runs row (purpose endpoint:...), named by the verdict, as the score stage's runs are."""
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"prompt": "Write double(x).", "tests": ["assert double(2) == 4"]}) + "\n")
    config = smoke_config_in(tmp_path, models_dir, name="graded",
                             environments=[{"name": "code", "weight": 1, "options": {"path": str(path)}}],
                             model={"rollout_dtype": "float32"}, torch_threads=1,
                             serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2})
    rt = Runtime.open(config)
    rt.ensure_started()
    try:
        with EndpointServer(config, port=0, store=rt.store) as server, \
                httpx.Client(headers=bearer(api_key(rt.store, "infer,feedback"))) as http:
            task = {"env": "code", "problem": {"prompt": "Write double(x).", "tests": ["assert double(2) == 4"]}}
            response = http.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "graded", "messages": [{"role": "user", "content": "Write double(x)."}], "max_tokens": 4,
                "evertrain": task})
            assert response.status_code == 200, response.text
            trace_id = response.headers[TRACE_HEADER]
            assert response.json()["choices"][0]["message"]["content"].strip()  # something to run
            server.endpoint.graders.submit(lambda: None).result(timeout=120)  # the grade is done (2 workers)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert server.endpoint.writer.flush(60)
                verdicts = rt.store.query("SELECT detail FROM trace_feedback WHERE trace_id = ?", [trace_id])
                if len(verdicts):
                    break
                time.sleep(0.2)
            assert len(verdicts) == 1, "the answer was never graded"
            detail = json.loads(verdicts["detail"].iloc[0])
            assert "sandbox_runs" not in detail and len(detail["sandbox_run_ids"]) == 2, detail
            # (the campaign's start validated the environment: its own runs, iteration 0)
            runs = rt.store.query("SELECT run_id, campaign, iteration, purpose FROM sandbox_runs "
                                  "WHERE purpose LIKE 'endpoint:%'")
            assert sorted(runs["purpose"]) == ["endpoint:candidate", "endpoint:tests"]
            assert set(runs["run_id"]) == set(detail["sandbox_run_ids"])
            assert set(runs["campaign"]) == {"graded"} and runs["iteration"].isna().all()
            # what escapes a handler (here the store gone from under /feedback's look-up) is a JSON 500, counted.
            # The look-up is made to fail as a closed connection does: closing the connection itself raced the
            # trace writer's thread, and DuckDB crashed the whole process (a segfault in a CI run)
            assert server.endpoint.writer.flush(60)

            def gone(trace_id: str) -> None:
                raise duckdb.ConnectionException("Connection already closed!")

            rt.store.trace_owner = gone  # type: ignore[method-assign]
            broken = http.post(f"{server.url}/feedback", timeout=60, json={"trace_id": "chatcmpl-unknown",
                                                                          "passed": True})
            assert broken.status_code == 500, broken.text
            assert broken.json()["error"]["code"] == "internal_error" and server.endpoint.internal_errors == 1
    finally:
        rt.close()
