"""`evertrain score`: every line gets a result in input order; bad lines never stop the rest."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb

from evertrain.envs import registry

DOUBLE = {"prompt": "Write double(x).", "tests": ["assert double(2) == 4", "assert double(5) == 10"]}


def test_score_command(tmp_path):
    gsm8k = registry.get("gsm8k")
    problem = gsm8k.problems("eval", 1, 0)[0]
    items = [
        {"id": "ref", "env": "gsm8k", "problem": {"question": problem.prompt, "answer": problem.payload["answer"]},
         "completion": gsm8k.reference(problem)},
        {"id": "hedge", "env": "arithmetic", "problem": {"question": "What is 2 + 2?", "answer": "4"},
         "completion": "#### 4 or 5"},
        "this line is not JSON",
        {"id": "unknown-env", "env": "chess", "problem": {}, "completion": "e4"},
        {"id": "bad-problem", "env": "gsm8k", "problem": {"question": "?"}, "completion": "#### 1"},
        {"id": "code-ok", "env": "code", "problem": DOUBLE,
         "completion": "```python\ndef double(x):\n    return 2*x\n```"},
        {"id": "code-hack", "env": "code", "problem": DOUBLE,
         "completion": "class A:\n    def __eq__(self, other):\n        return True\ndef double(x):\n    return A()\n"},
        {"id": "code-exit", "env": "code", "problem": DOUBLE, "completion": "import os\nos._exit(0)\n"},
    ]
    source = tmp_path / "items.jsonl"
    source.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    output, store = tmp_path / "out" / "results.jsonl", tmp_path / "audit.duckdb"
    run = subprocess.run([sys.executable, "-m", "evertrain.cli", "score", "--input", str(source),
                          "--output", str(output), "--store", str(store)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in results] == ["ref", "hedge", None, "unknown-env", "bad-problem", "code-ok", "code-hack",
                                          "code-exit"]
    by_id = {r["id"]: r for r in results if r["id"]}
    assert by_id["ref"]["reward"] == 1.0 and by_id["code-ok"]["reward"] == 1.0
    assert by_id["hedge"]["reason"] == "not_a_single_number"
    assert results[2]["reason"] == "malformed_input" and results[2]["detail"]["line"] == 3
    assert "unknown environment 'chess'" in by_id["unknown-env"]["detail"]["error"]
    assert "answer must be" in by_id["bad-problem"]["detail"]["error"]
    assert by_id["code-hack"]["reward"] == 0.0 and by_id["code-hack"]["reason"] == "non_plain_value"
    assert by_id["code-exit"]["reward"] == 0.0
    for r in results:
        assert set(r) == {"id", "reward", "passed", "reason", "detail"}
    with duckdb.connect(str(store), read_only=True) as con:
        audited = con.execute("SELECT count(*), count(DISTINCT run_id) FROM sandbox_runs").fetchone()
    assert audited[0] == audited[1] == 6  # two sandboxed processes per graded code item
