"""The endpoint on a real port, with the official ``openai`` client, the real store and the real registry.

The tiny model is first taught (in the test) one calculator tool episode, so that it really calls the
``python`` tool and then answers; it is the campaign's champion v1. v2 is the untaught tiny model, so a
promotion visibly changes what is served.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from evertrain.data.lineage import live_pass_rates
from evertrain.envs.base import Problem
from evertrain.envs.tools import PythonTool
from evertrain.processes import free_port
from evertrain.runtime import Runtime
from evertrain.serving.app import MODEL_HEADER, TRACE_HEADER, EndpointServer
from tests.conftest import api_key, bearer, smoke_config_in

QUESTION = "What is 48213 * 7719?"
ANSWER = "372156147"
EPISODE = [{"role": "user", "content": QUESTION},
           {"role": "assistant", "content": "<python>\n48213 * 7719\n</python>"},
           {"role": "tool", "content": ANSWER},
           {"role": "assistant", "content": f"#### {ANSWER}"}]
PYTHON = [{"type": "function", "function": {"name": "python", "description": "Runs Python 3 in a sandbox",
                                            "parameters": {"type": "object",
                                                           "properties": {"input": {"type": "string"}}}}}]
TASK = {"env": "calculator", "problem": {"question": QUESTION, "answer": ANSWER}}


def teach(model_dir: Path, out_dir: Path, messages: list[dict[str, str]], max_steps: int = 400) -> float:
    """Overfit the tiny model on one chat (loss on the assistant turns) until it is reproduced; the final loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from evertrain.models.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids, labels = [], []
    for end in range(len(messages)):
        prefix = tokenizer.apply_chat_template(messages[:end], tokenize=False) if end else ""
        text = tokenizer.apply_chat_template(messages[:end + 1], tokenize=False)
        piece = tokenizer(text[len(prefix):], add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if messages[end]["role"] == "assistant" else [-100] * len(piece)
    x, y = torch.tensor([ids]), torch.tensor([labels])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread is several times faster for a model this small on a busy machine
    try:
        for _ in range(max_steps):
            loss = model(input_ids=x, labels=y).loss
            if loss.item() < 0.005:
                break
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return loss.item()


@pytest.fixture(scope="module")
def live(tmp_path_factory, models_dir):
    """A campaign whose champion v1 is the taught model (v2: the untaught one), served on a free port."""
    root = tmp_path_factory.mktemp("endpoint")
    assert teach(models_dir / "tiny-llama", root / "taught", EPISODE) < 0.005
    config = smoke_config_in(
        root, models_dir, name="live", environments=[{"name": "calculator", "weight": 1}],
        model={"path": str(root / "taught"), "rollout_dtype": "float32"}, torch_threads=1,
        eval={"problems_per_env": 4, "sealed_problems": 4},
        serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2, "max_prompt_tokens": 1024,
                 "redaction": {"patterns": [r"\bACME-\d{4,}\b"]}})
    rt = Runtime.open(config)
    rt.ensure_started()
    from evertrain.data.store import now
    from evertrain.models.checkpoint import write_base_checkpoint

    other = write_base_checkpoint(root / "checkpoints" / "untaught", str(models_dir / "tiny-llama"))
    version = rt.tracker.register(other, run_id=None, iteration=0)
    rt.store.replace("model_versions", {"campaign": "live", "version": version}, [{
        "campaign": "live", "version": version, "iteration": 0, "kind": "full", "path": rt.stored_path(other),
        "parent_version": 1, "created_at": now()}])
    key = api_key(rt.store)  # made before the server starts, as an operator would (`evertrain keys create`)
    with EndpointServer(config, port=0, store=rt.store) as server:  # the context's connection, shared
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
        yield config, rt, server, client


def _stored(server, sql: str, params: list | None = None):
    assert server.endpoint.writer.flush(60)
    return server.endpoint.store.query(sql, params or [])


def _wait_healthy(process, port: int, timeout: float = 300.0) -> None:
    """Until the endpoint process on ``port`` serves its model (it fails the test if the process exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok":
                return
        except httpx.HTTPError:
            time.sleep(0.5)


def _wait_for(server, sql: str, params: list, rows: int = 1, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = _stored(server, sql, params)
        if len(frame) >= rows:
            return frame
        time.sleep(0.2)
    raise AssertionError(f"no rows for {sql} {params}")


def test_chat_completion_with_a_tool_call_then_a_verified_answer(live):
    _config, _rt, server, client = live
    messages = [{"role": "user", "content": QUESTION}]
    raw = client.chat.completions.with_raw_response.create(
        model="live", messages=messages, tools=PYTHON, temperature=0, max_tokens=40, extra_body={"evertrain": TASK})
    first = raw.parse()
    assert raw.headers[MODEL_HEADER] == "live@v1" and first.model == "live@v1"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "python" and json.loads(call.function.arguments) == {"input": "48213 * 7719"}

    # the client runs the tool (here the project's own sandboxed Python tool) and sends its output back
    result = PythonTool().run(json.loads(call.function.arguments)["input"], Problem.make("calculator", QUESTION, {}))
    assert result.output.strip() == ANSWER
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result.output}]
    second = client.chat.completions.create(model="live", messages=messages, tools=PYTHON, temperature=0,
                                            max_tokens=40, extra_body={"evertrain": TASK})
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content.strip() == f"#### {ANSWER}"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens > 0

    traces = _stored(server, "SELECT * FROM traces WHERE trace_id IN (?, ?) ORDER BY created_at",
                     [first.id, second.id])
    assert traces["trace_id"].tolist() == [first.id, second.id]
    assert (traces["model_version"] == 1).all() and (traces["status"] == "ok").all()
    assert (traces["env"] == "calculator").all() and (traces["tools"] == "python").all()
    assert (traces["prompt_tokens"] > 0).all() and (traces["completion_tokens"] > 0).all()
    assert (traces["cost_usd"] > 0).all()
    assert traces["prompt_tokens"].tolist() == [first.usage.prompt_tokens, second.usage.prompt_tokens]
    calls = json.loads(traces["tool_calls"].iloc[1])  # the second request carries the call and its result
    assert calls[0]["name"] == "python" and calls[0]["input"] == "48213 * 7719" and calls[0]["result"] == ANSWER
    assert json.loads(traces["response"].iloc[0])["choices"][0]["message"]["tool_calls"][0]["id"] == call.id

    # the verifier graded the final answer (the tool-call step has no outcome of its own)
    outcome = _wait_for(server, "SELECT * FROM trace_feedback WHERE trace_id = ?", [second.id])
    assert outcome["source"].tolist() == ["verifier"] and bool(outcome["passed"].iloc[0])
    assert _stored(server, "SELECT count(*) AS n FROM trace_feedback WHERE trace_id = ?", [first.id])["n"][0] == 0
    rates = live_pass_rates(server.endpoint.store, "live")
    row = rates[(rates["env"] == "calculator") & (rates["tools"] == "python") & (rates["model_version"] == 1)]
    assert int(row["requests"].iloc[0]) >= 1 and int(row["passed"].iloc[0]) >= 1
    logged = server.endpoint.log_live_metrics()  # what the endpoint logs every serving.metrics_seconds
    run = _rt.tracker.client.get_run(server.endpoint._metrics_run)
    assert run.data.metrics["live_pass_rate/calculator/python"] == logged["live_pass_rate/calculator/python"] > 0


def test_streaming_answer_names_its_version(live):
    _config, _rt, _server, client = live
    chunks = list(client.chat.completions.create(model="live@champion", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert {c.model for c in chunks} == {"live@v1"}
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_redaction_runs_before_anything_is_stored(live):
    _config, _rt, server, client = live
    secrets = ["sk-proj-Zq8xW2vN4mK7pL1rT5yU", "ada.lovelace@example.org", "hunter2hunter2", "ACME-884213"]
    content = (f"my key is {secrets[0]}, mail me at {secrets[1]}, password={secrets[2]}, "
               f"account {secrets[3]}; what is 2 + 2?")
    answer = client.chat.completions.create(model="live", messages=[{"role": "user", "content": content}],
                                            max_tokens=4, extra_body={"evertrain": {"env": "calculator", "problem": {
                                                "question": f"{content}", "answer": "4"}}})
    row = _stored(server, "SELECT * FROM traces WHERE trace_id = ?", [answer.id]).iloc[0]
    stored = " ".join(str(row[c]) for c in ("request", "response", "problem", "tool_calls"))
    assert "[REDACTED]" in stored and "what is 2 + 2?" in stored
    for secret in secrets:
        assert secret not in stored
    # nor anywhere in the store's files (Parquet data and catalog)
    location = server.endpoint.store.location
    files = [p for p in Path(location.data_path).rglob("*") if p.is_file()] + [Path(location.target)]
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, (secret, path)


def test_bad_input_gets_an_openai_error_and_a_stored_trace(live):
    _config, _rt, server, client = live
    url = server.url
    seen = {}
    auth = bearer(client.api_key)
    bad = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "live", "messages": [', timeout=60,
                     headers={"content-type": "application/json", **auth})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    seen["invalid_json"] = bad.headers[TRACE_HEADER]

    huge = httpx.post(f"{url}/v1/chat/completions", json={"model": "live", "messages": [
        {"role": "user", "content": "x" * 1_100_000}]}, timeout=60, headers=auth)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    seen["request_too_large"] = huge.headers[TRACE_HEADER]
    # the same body sent chunked (no Content-Length): abandoned once past the limit, not read whole first

    def chunks():
        yield b'{"model": "live", "messages": [{"role": "user", "content": "'
        for _ in range(1100):
            yield b"x" * 1000
        yield b'"}]}'

    chunked = httpx.post(f"{url}/v1/chat/completions", content=chunks(), timeout=60,
                         headers={"content-type": "application/json", **auth})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    assert "content-length" not in chunked.request.headers
    huge_feedback = httpx.post(f"{url}/feedback", content=b"x" * 100_000, timeout=60, headers=auth)
    assert huge_feedback.status_code == 413

    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.with_raw_response.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.body["code"] == "model_not_found" and "live" in unknown.value.body["message"]
    seen["model_not_found"] = unknown.value.response.headers[TRACE_HEADER]

    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="live", messages=[{"role": "user", "content": "7 " * 2000}])
    assert long.value.body["code"] == "context_length_exceeded" and "1024" in long.value.body["message"]
    seen["context_length_exceeded"] = long.value.response.headers[TRACE_HEADER]

    call = {"id": "call_1", "type": "function", "function": {"name": "rm_rf", "arguments": '{"input": "/"}'}}
    with pytest.raises(openai.BadRequestError) as tool:
        client.chat.completions.create(model="live", messages=[
            {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}])
    assert tool.value.body["code"] == "unknown_tool" and "rm_rf" in tool.value.body["message"]
    seen["unknown_tool"] = tool.value.response.headers[TRACE_HEADER]

    with pytest.raises(openai.BadRequestError) as declared:
        client.chat.completions.create(model="live", messages=[{"role": "user", "content": "x"}], tools=[
            {"type": "function", "function": {"name": "shell", "parameters": {}}}])
    assert declared.value.body["code"] == "unknown_tool"

    with pytest.raises(openai.BadRequestError) as env:
        client.chat.completions.create(model="live", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"evertrain": {"env": "no-such-env"}})
    assert env.value.body["code"] == "unknown_env"

    traces = _stored(server, "SELECT trace_id, status, http_status, error FROM traces WHERE status = 'error'")
    by_id = traces.set_index("trace_id")
    for code, trace_id in seen.items():
        assert trace_id in by_id.index, code
        assert by_id.loc[trace_id, "error"].startswith(code)
        assert by_id.loc[trace_id, "http_status"] in (400, 404, 413)
    # and the endpoint still answers
    assert client.chat.completions.create(model="live", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).choices[0].message.content is not None


def test_client_feedback_is_stored(live):
    _config, _rt, server, client = live
    answer = client.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    ok = httpx.post(f"{server.url}/feedback", json={"trace_id": answer.id, "passed": False, "detail": {
        "note": "wrong, mail ops@example.com"}}, timeout=30, headers=bearer(client.api_key))
    assert ok.status_code == 200
    refused = httpx.post(f"{server.url}/feedback", json={"trace_id": answer.id, "passed": "yes"}, timeout=30,
                         headers=bearer(client.api_key))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "passed"
    rows = _stored(server, "SELECT * FROM trace_feedback WHERE trace_id = ?", [answer.id])
    assert rows["source"].tolist() == ["client"] and not bool(rows["passed"].iloc[0])
    assert "ops@example.com" not in rows["detail"].iloc[0]


def test_failed_verifiable_trace_becomes_a_training_problem_never_a_held_out_one(live):
    """Traces of a fresh problem, of the gate's and of the sealed split's: curation (serving.curate_from_traces)
    turns the failed fresh one into a training problem with its trace id, and drops the held-out ones."""
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    config, rt, server, client = live
    env = rt.env("calculator")
    gate_size = config.eval_size("calculator")
    gate = env.problems("eval", gate_size, config.seed)[0]
    sealed = env.sealed_problems("test", config.sealed_size("calculator"), config.seed, gate_size)[0]
    fresh = {"question": "What is 123 * 456?", "answer": "56088"}
    # issue 45: a request that claims a wrong answer; one the environment cannot answer itself
    claimed = {"question": "What is 321 * 654?", "answer": "1"}
    unverifiable = {"question": "How many legs do 3 spiders have?", "answer": "24"}
    tasks = {"fresh": fresh, "claimed": claimed, "unverifiable": unverifiable,
             "gate": {"question": gate.prompt, "answer": gate.payload["answer"]},
             "gate_payload": {"question": gate.prompt, **gate.payload},
             "sealed": {"question": sealed.prompt, "answer": sealed.payload["answer"]},
             # near-copies of the gate's question (issue 45): each passed the old check and entered training
             "gate_dot": {"question": gate.prompt + ".", "answer": gate.payload["answer"]},
             "gate_zero_width": {"question": gate.prompt[:5] + "\u200b" + gate.prompt[5:],
                                 "answer": gate.payload["answer"]},
             "gate_spacing": {"question": "  " + gate.prompt.replace(" ", "   ") + " ",
                              "answer": gate.payload["answer"]},
             "gate_full_width": {"question": gate.prompt.translate({ord(d): 0xFF10 + int(d) for d in "0123456789"}),
                                 "answer": gate.payload["answer"]}}
    assert all(tasks[n]["question"] != gate.prompt for n in tasks if n.startswith("gate_") and n != "gate_payload")
    traces = {}
    for name, problem in tasks.items():
        # tool_choice none: the taught model still writes its memorized call, now as the final answer: a failure
        answer = client.chat.completions.create(
            model="live", messages=[{"role": "user", "content": problem["question"]}], tools=PYTHON,
            tool_choice="none", temperature=0, max_tokens=40,
            extra_body={"evertrain": {"env": "calculator", "problem": problem}})
        traces[name] = answer.id
    marks = ", ".join("?" * len(traces))
    outcomes = _wait_for(server, f"SELECT trace_id, passed FROM trace_feedback WHERE trace_id IN ({marks})",
                         list(traces.values()), rows=len(traces))
    assert not outcomes["passed"].any()

    data = config.model_dump()
    data["serving"].update(curate_from_traces=True, trace_problems=8)
    # the fixture's open context holds the campaign: this one borrows its store (one writer per campaign)
    curating = Runtime(type(config).model_validate(data), rt.store, rt.tracker)
    run_stage(curating, "curate", 0, STAGE_FUNCTIONS["curate"])
    problems = curating.store.query("SELECT * FROM problems WHERE campaign = 'live' AND iteration = 0")
    from_traces = problems[problems["payload"].str.contains('"provenance"')]
    provenance = {json.loads(p)["provenance"]["trace_id"]: row for p, row in zip(
        from_traces["payload"], from_traces.itertuples(index=False), strict=True)}
    assert traces["fresh"] in provenance
    row = provenance[traces["fresh"]]
    payload = json.loads(row.payload)
    assert row.prompt == fresh["question"] and payload["answer"] == "56088" and row.split == "train"
    assert payload["provenance"]["passed"] is False and payload["provenance"]["outcome_source"] == "verifier"
    # the claimed answer is gone: the problem trains on the environment's own answer (and graded on it)
    row = provenance[traces["claimed"]]
    assert row.prompt == claimed["question"] and json.loads(row.payload)["answer"] == str(321 * 654)
    assert row.problem_id == env.rebuild(Problem.make("calculator", claimed["question"], {})).id
    answer_from = _stored(server, "SELECT trace_id, json_extract_string(detail, '$.answer_from') AS answer_from "
                          f"FROM trace_feedback WHERE trace_id IN ({marks})", list(traces.values()))
    answer_from = dict(zip(answer_from["trace_id"], answer_from["answer_from"], strict=True))
    assert answer_from[traces["claimed"]] == "environment" and answer_from[traces["unverifiable"]] == "client"
    for name in tasks:
        if name not in ("fresh", "claimed"):
            assert traces[name] not in provenance, name
    assert gate.id not in set(problems["problem_id"]) and sealed.id not in set(problems["problem_id"])
    assert not {gate.prompt, sealed.prompt} & set(problems["prompt"])
    metrics = json.loads(curating.store.query("SELECT metrics FROM stage_runs WHERE campaign = 'live' AND "
                                              "iteration = 0 AND stage = 'curate'")["metrics"].iloc[0])
    assert metrics["dropped_trace_contaminated"] >= 7 and metrics["trace_problems"] == len(from_traces)
    assert metrics["dropped_trace_unverifiable"] >= 1  # earlier tests of the module send such tasks too
    assert metrics["trace_failures"] >= 1


def test_hot_swap_under_a_concurrent_client(live):
    """Promote v2 while four client threads send requests, then roll back: no request fails, each names exactly
    one version (body, header and trace agree), and the served version changes both ways within seconds."""
    from evertrain.tasks.promote import rollback

    _config, rt, server, client = live
    stop = threading.Event()
    results, failures = [], []
    lock = threading.Lock()

    def worker() -> None:
        while not stop.is_set():
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="live", messages=[{"role": "user", "content": QUESTION}], max_tokens=9, temperature=0)
                answer = raw.parse()
                with lock:
                    results.append((time.monotonic(), answer.id, answer.model, raw.headers[MODEL_HEADER],
                                    answer.model_extra["evertrain"]["model_version"],
                                    answer.choices[0].message.content))
            except Exception as error:
                with lock:
                    failures.append(repr(error))

    def served_since(moment: float, name: str, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with lock:
                if any(r[0] > moment and r[2] == name for r in results):
                    return time.monotonic() - moment
            time.sleep(0.05)
        raise AssertionError(f"{name} was not served within {timeout} s")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        promoted = time.monotonic()
        # the champion moved in the store (the lineage's authority), projected onto MLflow's aliases, as the
        # promote stage does when the gate passes
        rollback(rt, to_version=2, reason="v2 promoted by hand", allow_unpromoted=True)
        to_v2 = served_since(promoted, "live@v2")
        time.sleep(1.0)
        rolled = time.monotonic()
        rollback(rt, reason="test")
        to_v1 = served_since(rolled, "live@v1")
        time.sleep(0.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failures, failures[:3]
    assert to_v2 < 10 and to_v1 < 10
    for _at, _id, model, header, version, _text in results:
        assert model == header == f"live@v{version}"
    names = [r[2] for r in sorted(results)]
    changes = [b for a, b in itertools.pairwise(names) if a != b]
    assert "live@v2" in changes and "live@v1" in changes
    # the taught v1 calls the tool; the untaught v2 does not: each answer is one model's, never a mix
    v1, v2 = ({r[5] for r in results if r[2] == name} for name in ("live@v1", "live@v2"))
    assert v1 == {"<python>\n"} and len(v2) == 1 and v1 != v2
    stored = _stored(server, "SELECT trace_id, model_version FROM traces").set_index("trace_id")["model_version"]
    assert all(int(stored[r[1]]) == r[4] for r in results)
    assert rt.champion_version() == 1 and rt.tracker.alias("champion") == 1


def test_evertrain_endpoint_command_serves_and_writes_its_traces_on_stop(live, tmp_path):
    """`evertrain endpoint` in its own process (beside the test's endpoint, on the same store and registry):
    it answers on its port, and a clean stop (Ctrl-C) writes the traces still queued."""
    import signal
    import subprocess
    import sys

    config, _rt, server, client = live
    path = tmp_path / "live.json"
    data = config.model_dump(mode="json")
    data["serving"]["trace_flush_seconds"] = 3600  # nothing is written before the stop: the stop must write it
    path.write_text(json.dumps(data))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "evertrain.cli", "endpoint", "--campaign", "live", "--config",
                                str(path), "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "EVERTRAIN_PROGRESS": "0"})
    try:
        _wait_healthy(process, port)
        # the same key: both endpoints read the one store's keys
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=client.api_key, max_retries=0,
                              timeout=120)
        answer = other.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert answer.model == "live@v1"
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "serving live@v1" in output
    rows = _stored(server, "SELECT model_version, status FROM traces WHERE trace_id = ?", [answer.id])
    assert rows["model_version"].tolist() == [1] and rows["status"].tolist() == ["ok"]


def test_sigkill_mid_traffic_loses_no_answered_request_s_trace(live, tmp_path):
    """`evertrain endpoint` SIGKILLed while clients are being answered, before any trace was committed: every
    request it answered is stored exactly once after the next writer on the host starts (its journal replayed)."""
    import signal
    import subprocess
    import sys

    from evertrain.serving.traces import TraceWriter

    config, rt, server, client = live
    path = tmp_path / "live.json"
    data = config.model_dump(mode="json")
    data["serving"]["trace_flush_seconds"] = 3600  # no commit before the kill: only the journal can keep them
    path.write_text(json.dumps(data))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "evertrain.cli", "endpoint", "--campaign", "live", "--config",
                                str(path), "--port", str(port)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "EVERTRAIN_PROGRESS": "0"})
    answered: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=client.api_key, max_retries=0,
                              timeout=60)
        while not stop.is_set():
            try:
                answer = other.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=2)
            except openai.APIConnectionError:  # the kill: a request in flight was never answered
                return
            answered.append(answer.id)

    try:
        _wait_healthy(process, port)
        clients = [threading.Thread(target=traffic) for _ in range(3)]
        for thread in clients:
            thread.start()
        deadline = time.monotonic() + 120
        while len(answered) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)  # with requests in flight
        process.wait(30)
        stop.set()
    for thread in clients:
        thread.join(60)
    assert len(answered) >= 8, process.stdout.read()[-3000:]
    ids = list(answered)
    assert _stored(server, "SELECT trace_id FROM traces WHERE trace_id IN (SELECT unnest(?))", [ids]).empty
    writer = TraceWriter(rt.store, flush_seconds=0.05)  # what the next endpoint on this host starts
    try:
        assert writer.replayed_rows >= len(ids)
        assert writer.flush(60)
    finally:
        writer.close()
    stored = _stored(server, "SELECT trace_id, count(*) AS n, any_value(status) AS status FROM traces "
                     "WHERE trace_id IN (SELECT unnest(?)) GROUP BY 1", [ids])
    assert sorted(stored["trace_id"]) == sorted(ids) and set(stored["n"]) == {1} and set(stored["status"]) == {"ok"}


def test_endpoint_deployment_is_registered(live, prefect_server):
    from prefect.client.orchestration import get_client

    from evertrain.flows.deploy import build_endpoint_deployment

    config = live[0]
    deployment_id = build_endpoint_deployment(config, port=8123).apply()
    with get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment(deployment_id)
    assert deployment.name == "endpoint-live" and "endpoint" in deployment.tags
    assert deployment.parameters["config"]["name"] == "live" and deployment.parameters["port"] == 8123
    assert deployment.entrypoint == "evertrain.serving.flow.endpoint_flow"


def test_a_slow_redaction_does_not_stall_other_requests(live):
    """Redaction (and the request's store look-ups) run off the event loop: while one request's trace takes
    seconds to redact (a costly user pattern), /health still answers at once, and the trace is still stored."""
    from evertrain.config import RedactionConfig
    from evertrain.serving.redact import Redactor

    _config, _rt, server, client = live
    original = server.endpoint.redactor
    rule = RedactionConfig(patterns=[r"(x|xx)+y"], timeout_seconds=60)  # backtracks: seconds on 30 x's
    server.endpoint.redactor = Redactor(rule)
    try:
        answered = {}

        def send() -> None:
            began = time.perf_counter()
            answered["response"] = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
                "model": "no-such-model", "messages": [{"role": "user", "content": "x" * 30}]},
                headers=bearer(client.api_key))
            answered["seconds"] = time.perf_counter() - began

        sender = threading.Thread(target=send)
        sender.start()
        waits = []
        while sender.is_alive():
            began = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=120).status_code == 200
            waits.append(time.perf_counter() - began)
            time.sleep(0.02)
        sender.join()
    finally:
        server.endpoint.redactor = original
    response = answered["response"]
    assert response.status_code == 404
    # measured against the slow request's own duration (on a loaded machine both stretch alike): a stalled
    # event loop would hold one /health for most of it
    assert len(waits) >= 3 and max(waits) < answered["seconds"] / 3, (answered["seconds"], waits)
    row = _stored(server, "SELECT error FROM traces WHERE trace_id = ?", [response.headers[TRACE_HEADER]])
    assert row["error"].iloc[0].startswith("model_not_found")


def test_a_champion_that_fails_to_load_is_tried_with_back_off_and_said_once(live, caplog):
    """The champion moves (in the store) to a version whose checkpoint does not load: the endpoint keeps
    serving v1, warns once (not at every poll), and loads the version at once when its checkpoint's content
    changes. MLflow's alias moved by hand first moves nothing."""
    import logging

    from evertrain.data.store import now
    from evertrain.tasks.promote import rollback

    config, rt, server, client = live
    folder = Path(config.paths.checkpoints) / "broken"
    folder.mkdir(parents=True)
    manifest = folder / "evertrain_checkpoint.json"
    manifest.write_text(json.dumps({"kind": "base", "base_model": str(folder / "no-such-model")}))
    version = rt.tracker.register(folder, run_id=None, iteration=0)
    rt.store.replace("model_versions", {"campaign": "live", "version": version}, [{
        "campaign": "live", "version": version, "iteration": 0, "kind": "full", "path": rt.stored_path(folder),
        "parent_version": 1, "created_at": now()}])
    try:
        # MLflow's alias moved by hand is not a promotion: the store's lineage is the authority, nothing is loaded
        rt.tracker.set_alias("champion", version)
        time.sleep(5 * config.serving.poll_seconds)
        assert server.endpoint.champion.current.version == 1 and version not in server.endpoint.champion.failed
        with caplog.at_level(logging.DEBUG, logger="evertrain.serving"):
            rollback(rt, to_version=version, reason="a broken version made champion by hand", allow_unpromoted=True)
            time.sleep(12 * config.serving.poll_seconds)
            answer = client.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        assert answer.model == "live@v1"
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING and f"v{version}" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        failure = server.endpoint.champion.failed[version]
        assert failure["attempts"] < 6 and failure["delay"] > config.serving.poll_seconds  # backed off
        health = httpx.get(f"{server.url}/health", timeout=30, headers=bearer(client.api_key)).json()  # an admin key
        assert health["watcher_error"].startswith(f"loading v{version}")

        # the checkpoint repaired in place: its new content is tried at once, not after the back-off
        manifest.write_text(json.dumps({"kind": "base", "base_model": str(Path(rt.base_model).resolve())}))
        _until(lambda: server.endpoint.champion.current.version == version,
               lambda: f"the repaired v{version} was not served: {server.endpoint.champion.failed}")
        assert version not in server.endpoint.champion.failed
    finally:
        if rt.champion_version() != 1:
            rollback(rt, to_version=1, reason="test over")
        rt.tracker.set_alias("champion", 1)
    _until(lambda: server.endpoint.champion.current.version == 1, "the champion rolled back was not served")


def test_an_idle_endpoint_asks_for_the_champion_only_after_a_commit(live, monkeypatch):
    """While nothing is committed the watcher reads the store's snapshot id, not the champion (an idle endpoint
    polls forever); a commit from another process makes its next poll ask again, and a move is still served."""
    import subprocess
    import sys

    from evertrain.tasks.promote import rollback

    config, rt, server, _client = live
    champion = server.endpoint.champion
    asked: list[float] = []
    ask = champion._champion_version
    monkeypatch.setattr(champion, "_champion_version", lambda: asked.append(time.monotonic()) or ask())
    assert server.endpoint.writer.flush(60)  # the endpoint's own traces committed: nothing pending
    time.sleep(3 * config.serving.poll_seconds)
    asked.clear()
    time.sleep(10 * config.serving.poll_seconds)
    assert asked == [], f"asked for the champion {len(asked)} times while nothing was committed"
    # a commit by another process (an `evertrain keys create`, which has nothing to do with the champion)
    made = subprocess.run([sys.executable, "-m", "evertrain.cli", "keys", "create", "--name", "idle-poll",
                           "--scopes", "infer", "--store", config.paths.store], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "EVERTRAIN_PROGRESS": "0"})
    assert made.returncode == 0, made.stderr
    _until(lambda: asked, "a commit did not make the watcher ask for the champion")
    # and a move of the champion is served, as before
    try:
        rollback(rt, to_version=2, reason="moved while idle", allow_unpromoted=True)
        _until(lambda: champion.current.version == 2, "the moved champion was not served")
    finally:
        rollback(rt, to_version=1, reason="test over", allow_unpromoted=True)
    _until(lambda: champion.current.version == 1, "the champion rolled back was not served")


def _until(done: Callable[[], object], what: str | Callable[[], str], timeout: float = 30.0) -> None:
    """Wait until ``done()`` holds; fail with ``what`` (or what it returns, read when failing) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def test_live_pass_rate_per_version_and_its_plot_reach_mlflow(live):
    _config, rt, server, client = live
    answer = client.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            extra_body={"evertrain": {"env": "calculator"}})
    assert httpx.post(f"{server.url}/feedback", json={"trace_id": answer.id, "passed": True}, timeout=30,
                      headers=bearer(client.api_key)).status_code == 200
    untasked = client.chat.completions.create(model="live", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # no task named: env '(none)', not a valid MLflow name as is
    assert httpx.post(f"{server.url}/feedback", json={"trace_id": untasked.id, "passed": False},
                      timeout=30, headers=bearer(client.api_key)).status_code == 200
    assert server.endpoint.writer.flush(60)
    logged = server.endpoint.log_live_metrics()
    assert "live_pass_rate/v1/no_env/no_tool" in logged
    run = rt.tracker.client.get_run(server.endpoint._metrics_run)
    assert run.data.metrics["live_pass_rate/v1/calculator/python"] == logged["live_pass_rate/v1/calculator/python"]
    assert logged["live_requests/v1/calculator/python"] >= 1
    artifacts = [a.path for a in rt.tracker.client.list_artifacts(server.endpoint._metrics_run)]
    assert "live_pass_rate.png" in artifacts


def test_concurrent_requests_are_sampled_together_with_their_own_seeds(live):
    """Eight clients at once: the in-house sampler answers them in fewer calls than requests (batches), and each
    answer is the one its seed gives alone (a request's draws do not depend on who shared its call)."""
    _config, _rt, server, client = live
    batcher = server.endpoint.batcher
    assert batcher is not None

    def ask(seed: int) -> Any:
        return client.chat.completions.create(model="live", messages=[{"role": "user", "content": "What is 7 + 5?"}],
                                              max_tokens=12, temperature=1.0, seed=seed)

    alone = {seed: ask(seed).choices[0].message.content for seed in (1, 2)}
    calls, jobs = batcher.calls, batcher.jobs
    answers: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(1 + i % 2))) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(answers) == 8 and batcher.jobs - jobs == 8
    assert batcher.calls - calls < 8 and batcher.largest >= 2, (batcher.calls - calls, batcher.largest)
    for i, answer in answers.items():
        assert answer.choices[0].message.content == alone[1 + i % 2]
    stored = _stored(server, "SELECT trace_id, completion_tokens, prompt_tokens FROM traces WHERE trace_id IN "
                     f"({', '.join('?' * 8)})", [a.id for a in answers.values()]).set_index("trace_id")
    for answer in answers.values():
        assert stored.loc[answer.id, "completion_tokens"] == answer.usage.completion_tokens > 0
        assert stored.loc[answer.id, "prompt_tokens"] == answer.usage.prompt_tokens > 0
