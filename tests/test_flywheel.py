"""The drift demo's serving path on a real port with the official ``openai`` client: a client whose tool changed to
v2 (``calc``) gets the model's ``calc`` call back as a tool call, runs it in the sandbox, and its final answer is
graded by the endpoint's verifier; the demo's client simulator switches tool versions with no failed request."""

from __future__ import annotations

import json
import time

import openai
import pytest

from evertrain.envs import registry
from evertrain.flywheel import Traffic, endpoint_server, outcomes, phase_rate, with_tool
from evertrain.runtime import Runtime
from tests.conftest import api_key, smoke_config_in
from tests.test_endpoint import teach

QUESTION = "What is 48213 * 7719?"
ANSWER = "372156147"
CALL = '{"operation": "multiply", "x": 48213, "y": 7719}'
EPISODE = [{"role": "user", "content": QUESTION},
           {"role": "assistant", "content": f"<calc>\n{CALL}\n</calc>"},
           {"role": "tool", "content": ANSWER},
           {"role": "assistant", "content": f"#### {ANSWER}"}]
CALC = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, models_dir):
    """A tool-v1 campaign whose champion was taught one tool-v2 episode, served as the demo serves it."""
    root = tmp_path_factory.mktemp("flywheel")
    assert teach(models_dir / "tiny-llama", root / "taught", EPISODE) < 0.005
    config = smoke_config_in(
        root, models_dir, name="wheel", environments=[{"name": "calculator", "weight": 1, "max_new_tokens": 80}],
        model={"path": str(root / "taught"), "rollout_dtype": "float32"}, torch_threads=1,
        eval={"problems_per_env": 4, "sealed_problems": 0},
        serving={"poll_seconds": 0.2, "trace_flush_seconds": 0.2, "max_prompt_tokens": 2048})
    config = with_tool(config, 1)
    with Runtime.open(config) as rt:  # closed before the endpoint opens the store
        rt.ensure_started()
    server = endpoint_server(config)
    try:
        yield config, server
    finally:
        server.stop()


def test_with_tool_changes_only_the_tool_and_the_approval(models_dir, tmp_path):
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "calculator", "weight": 1,
                                                                  "options": {"digits": [3, 4]}}])
    v2 = with_tool(config, 2, approval="required")
    assert v2.environments[0].options == {"digits": [3, 4], "tool_version": 2}
    assert v2.promotion.approval == "required" and config.promotion.approval == "auto"
    assert with_tool(config, 1).environments[0].options["tool_version"] == 1


def test_a_v2_tool_call_is_served_run_at_the_client_and_graded(served):
    config, server = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key(server.endpoint.store, "infer"),
                           max_retries=0, timeout=120)
    task = {"env": "calculator", "problem": {"question": QUESTION, "answer": ANSWER}}
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="wheel", messages=messages, tools=CALC, temperature=0,
                                           max_tokens=80, extra_body={"evertrain": task})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "calc" and json.loads(json.loads(call.function.arguments)["input"]) == \
        json.loads(CALL)
    v2 = registry.get("calculator", tool_version=2)
    output = v2.tools["calc"].run(json.loads(call.function.arguments)["input"], v2.problems("eval", 1, 0)[0])
    assert output.output.strip() == ANSWER and not output.error  # the new tool really ran, in the sandbox
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "name": "calc", "content": output.output}]
    second = client.chat.completions.create(model="wheel", messages=messages, tools=CALC, temperature=0,
                                            max_tokens=80, extra_body={"evertrain": task})
    assert second.choices[0].message.content.strip() == f"#### {ANSWER}"
    store = server.endpoint.store
    deadline = time.monotonic() + 30
    graded = {}
    while not graded and time.monotonic() < deadline:
        assert server.endpoint.writer.flush(30)
        graded = outcomes(store, config.name, [second.id, first.id])
        time.sleep(0.2)
    assert graded == {second.id: True}  # the final answer is graded; the call step has no outcome of its own
    tools = store.query("SELECT tools FROM traces WHERE trace_id = ?", [second.id])["tools"].tolist()
    assert tools == ["calc"]


def test_the_client_simulator_changes_tool_with_no_failed_request(served):
    config, server = served
    traffic = Traffic(server.url, config.name, clients=2, max_tokens=80, pool_size=20,
                      api_key=api_key(server.endpoint.store, "infer")).start()
    try:
        deadline = time.monotonic() + 300
        while traffic.count("before") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        traffic.phase, traffic.tool_version = "after", 2
        while traffic.count("after") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        traffic.stop()
    assert traffic.failures == []
    assert server.endpoint.writer.flush(60)
    time.sleep(1)  # the graders' last verdicts
    assert server.endpoint.writer.flush(60)
    episodes = traffic.episodes
    assert {e.tool_version for e in episodes} == {1, 2} and all(e.versions == [1] * e.requests for e in episodes)
    graded = outcomes(server.endpoint.store, config.name, [e.final_trace for e in episodes])
    assert set(graded) == {e.final_trace for e in episodes}  # every episode's final answer has a verdict
    rate = phase_rate([e for e in episodes if e.tool_version == 2], graded)
    assert rate["n"] == sum(e.tool_version == 2 for e in episodes) and rate["ungraded"] == 0
    tools = server.endpoint.store.query(
        "SELECT DISTINCT tools FROM traces WHERE trace_id IN (SELECT unnest(?))",
        [[e.final_trace for e in episodes if e.tool_version == 2]])["tools"].tolist()
    assert tools == ["calc"]
