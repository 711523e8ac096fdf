"""The trace writer and the redaction rule without a server: batches, not a commit per trace; the rule itself."""

from __future__ import annotations

import json

import pytest

from evertrain.config import ConfigError, RedactionConfig, load_config
from evertrain.data.lineage import live_pass_rates
from evertrain.data.store import Store, now
from evertrain.serving.redact import Redactor
from evertrain.serving.traces import TraceWriter, feedback_row
from tests.conftest import store_uri


def test_redactor_removes_secrets_emails_and_user_patterns():
    rule = Redactor(RedactionConfig(patterns=[r"\bEMP-\d{6}\b"]))
    text = ("key sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv, token ghp_0123456789abcdefghijABCDEFGHIJ012345, "
            "AKIAABCDEFGHIJKLMNOP, Authorization: Bearer eyJhbGciOi.JIUzI1NiJ9, password: 'p4ss w0rd', "
            "api_key=abc123XYZ, write to grace.hopper@navy.mil.us, employee EMP-004211; 48213 * 7719 = 372156147")
    out = rule.text(text)
    for secret in ("sk-ant-api03", "ghp_0123", "AKIAABCD", "eyJhbGciOi", "p4ss", "abc123XYZ", "grace.hopper",
                   "EMP-004211"):
        assert secret not in out, secret
    assert "48213 * 7719 = 372156147" in out and "password: '[REDACTED]" in out
    assert rule.value({"a": [text], "n": 3}) == {"a": [out], "n": 3}
    off = Redactor(RedactionConfig(secrets=False, emails=False))
    assert off.text(text) == text


def test_a_bad_redaction_pattern_is_refused_with_its_name(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[serving.redaction]\npatterns = ["(unclosed"]\n')
    with pytest.raises(ConfigError, match=r"unclosed.*not a valid regular expression"):
        load_config(path)


def test_writer_commits_in_batches_and_compaction_merges_files(tmp_path):
    store = Store(store_uri(tmp_path))
    writer = TraceWriter(store, batch_rows=256, flush_seconds=0.5, compact_seconds=3600)
    for i in range(1000):
        writer.add_trace({"trace_id": f"t{i}", "campaign": "c", "model_version": 1 + (i >= 500), "env": "calculator",
                          "tools": "python", "status": "ok", "latency_ms": 1.0, "created_at": now()})
        writer.add_feedback(feedback_row(f"t{i}", "c", "verifier", i % 4 != 0, None, {}))
    assert writer.flush(120)
    assert store.scalar("SELECT count(*) FROM traces") == 1000
    assert writer.commits <= 20, writer.commits  # batches: 2000 rows in at most 20 commits, not 2000
    files_before = store.disk_usage()["files"]
    writer.compact(keep_seconds=0)
    writer.close()
    assert store.disk_usage()["files"] < files_before
    rates = live_pass_rates(store, "c").set_index("model_version")
    assert rates.loc[1, "requests"] == 500 and rates.loc[1, "pass_rate"] == pytest.approx(0.75)
    assert rates.loc[1, "low"] < 0.75 < rates.loc[1, "high"]
    from evertrain.data.lineage import live_pass_rate
    from evertrain.report import format_live

    lines = format_live(live_pass_rate(store, "c"))
    assert lines[1].startswith("  calculator [python] v1: 0.750 [") and lines[1].endswith("over 500 requests")
    store.close()


def test_a_pattern_that_runs_out_of_time_replaces_the_whole_string():
    """A user pattern that backtracks catastrophically cannot hold a request: past its time limit the string
    is replaced whole (nothing unchecked is stored)."""
    rule = Redactor(RedactionConfig(patterns=[r"(x|xx)+y"], timeout_seconds=0.2))
    assert rule.text("a short x string") == "a short x string"
    assert rule.text("token " + "x" * 40) == "[REDACTED]"
    assert rule.timeouts == 1


def test_the_html_page_plots_the_live_pass_rate_per_env_tool_and_version_over_time(tmp_path):
    """Traces with outcomes over an hour for two versions and two tools: the page's live plot and its table
    show each (environment, tool, version) at the right pass rate, in time buckets."""
    import base64
    import re
    from datetime import timedelta

    from evertrain.data.lineage import live_pass_rate_over_time
    from evertrain.plots import html_report

    store = Store(store_uri(tmp_path))
    writer = TraceWriter(store, batch_rows=512, flush_seconds=0.2, compact_seconds=3600)
    start = now() - timedelta(hours=1)
    for i in range(240):  # v1 for the first half hour (python: 1 in 4 passes), then v2 (3 in 4)
        version = 1 if i < 120 else 2
        tools = "python" if i % 2 else None
        at = start + timedelta(seconds=15 * i)
        writer.add_trace({"trace_id": f"t{i}", "campaign": "c", "model_version": version, "env": "calculator",
                          "tools": tools, "status": "ok", "latency_ms": 1.0, "created_at": at})
        passed = (i // 2) % 4 != 0 if version == 2 else (i // 2) % 4 == 0
        writer.add_feedback({**feedback_row(f"t{i}", "c", "client", passed, None, {}), "created_at": at})
    assert writer.flush(120)
    writer.close()
    series = live_pass_rate_over_time(store, "c")
    store.close()
    assert {(r["tools"], r["model_version"]) for r in series} == {("", 1), ("", 2), ("python", 1), ("python", 2)}
    assert 20 <= len({r["bucket"] for r in series}) <= 25  # about 24 buckets over the hour
    assert sum(r["requests"] for r in series) == 240
    v1 = [r for r in series if r["model_version"] == 1]
    assert sum(r["passed"] for r in v1) / sum(r["requests"] for r in v1) == pytest.approx(0.25)
    assert max(r["bucket"] for r in v1) <= min(r["bucket"] for r in series if r["model_version"] == 2)

    page = html_report("c", [], live=series)
    found = re.search(r"<h2>Live pass rate[^<]*</h2><img alt='live pass rate' src='data:image/png;base64,([^']+)'>",
                      page)
    assert found, page[:2000]
    assert base64.b64decode(found.group(1)).startswith(b"\x89PNG")
    assert page.count("<td>calculator</td>") == len(series)
    assert html_report("c", [], live=[]).count("live pass rate") == 0  # no outcomes: no empty plot


def test_a_killed_writer_s_rows_are_replayed_once_by_the_next_writer_on_its_host(tmp_path):
    """A writer SIGKILLed before its first commit: the store has none of its rows, its journal has all of them; the
    next writer replays them exactly once, though its journal was copied (as if the dead writer had committed them
    and died before deleting it) and ends in a line cut short; a live writer's journal is left alone."""
    import shutil
    import signal
    import subprocess
    import sys

    uri = store_uri(tmp_path)
    store = Store(uri)
    live = TraceWriter(store, flush_seconds=3600)  # alive throughout: its rows are its own to commit
    live.add_trace({"trace_id": "live-0", "campaign": "c", "status": "ok", "created_at": now()})
    child = subprocess.Popen([sys.executable, "-c", f"""
import time
from evertrain.data.store import Store, now
from evertrain.serving.traces import TraceWriter, feedback_row
writer = TraceWriter(Store({uri!r}), flush_seconds=3600)
for i in range(5):
    writer.add_trace({{"trace_id": f"dead-{{i}}", "campaign": "c", "status": "ok", "created_at": now()}})
writer.add_feedback(feedback_row("dead-0", "c", "client", True, 1.0, {{"why": "ok"}}))
print("queued", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "queued"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert store.scalar("SELECT count(*) FROM traces") == 0  # nothing was committed: only the journal has them
    root = live.journal.root
    dead = [f for f in root.iterdir() if f != live.journal.folder]
    assert len(dead) == 1
    copy = shutil.copytree(dead[0], root / f"{dead[0].name.split('@')[0]}@1-copy")
    with next(copy.glob("*.jsonl")).open("ab") as segment:
        segment.write(b'{"table": "traces", "row": {"trace_id": "cut')  # killed in the middle of a write

    writer = TraceWriter(store, flush_seconds=0.05)
    assert writer.replayed_rows == 12 and writer.journal.bad_lines == 1
    assert writer.flush(30)
    stored = store.query("SELECT trace_id, count(*) AS n FROM traces GROUP BY 1 ORDER BY 1")
    assert stored["trace_id"].tolist() == [f"dead-{i}" for i in range(5)] and set(stored["n"]) == {1}
    feedback = store.query("SELECT trace_id, passed, detail FROM trace_feedback")
    assert feedback["trace_id"].tolist() == ["dead-0"] and feedback["detail"].tolist() == ['{"why": "ok"}']
    assert sorted(root.iterdir()) == sorted([live.journal.folder, writer.journal.folder])  # adopted, then gone
    assert [p.name for p in writer.journal.folder.glob("adopted-*")] == []  # committed: deleted
    writer.close()
    live.close()
    assert store.query("SELECT trace_id FROM traces WHERE trace_id = 'live-0'").shape[0] == 1
    assert list(root.iterdir()) == []  # clean stops leave no journal
    store.close()


def test_one_client_gives_at_most_its_share_of_an_iteration_s_trace_problems(tmp_path, models_dir):
    """Issue 45: with 4 places and trace_client_share 0.5, a client with six fresh failures gives two problems and
    another client's two failures get the other two (without the cap the newest six, all the first client's,
    would fill all four)."""
    import pandas as pd

    from evertrain.envs.quality import NgramIndex
    from evertrain.runtime import Runtime
    from evertrain.serving.trace_source import trace_problems
    from evertrain.serving.traces import FEEDBACK_COLUMNS, TRACE_COLUMNS
    from tests.conftest import smoke_config_in

    config = smoke_config_in(tmp_path, models_dir, name="caps", environments=[{"name": "calculator", "weight": 1}],
                             serving={"curate_from_traces": True, "trace_problems": 4, "trace_client_share": 0.5})
    store = Store(config.paths.store)
    traces, feedback = [], []
    for i, key in enumerate(["k_user"] * 2 + ["k_flood"] * 6):  # the flood is newest: it would come first
        at, trace_id = now(), f"chatcmpl-{i}"
        problem = json.dumps({"question": f"What is {100 + i} * 7?", "answer": str((100 + i) * 7)})
        traces.append({c: None for c in TRACE_COLUMNS} | {
            "trace_id": trace_id, "campaign": "caps", "model_version": 1, "env": "calculator", "problem": problem,
            "status": "ok", "http_status": 200, "created_at": at, "key_id": key})
        feedback.append({c: None for c in FEEDBACK_COLUMNS} | {
            "trace_id": trace_id, "campaign": "caps", "source": "verifier", "passed": False, "reward": 0.0,
            "detail": "{}", "created_at": at})
    store.append("traces", pd.DataFrame(traces))
    store.append("trace_feedback", pd.DataFrame(feedback))
    dropped: dict[str, int] = {}
    chosen = trace_problems(Runtime(config, store, None), set(), (set(), NgramIndex(n=8)), dropped=dropped)
    by_trace = [p.payload["provenance"]["trace_id"] for p in chosen]
    keys = ["k_user"] * 2 + ["k_flood"] * 6
    assert sorted(keys[int(t.split("-")[1])] for t in by_trace) == ["k_flood", "k_flood", "k_user", "k_user"]
    assert dropped["trace_client_cap"] == 4
    store.close()
