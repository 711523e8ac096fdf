"""The trace writer and the redaction rule without a server: batches, not a commit per trace; the rule itself."""

from __future__ import annotations

import pytest

from evertrain.config import ConfigError, RedactionConfig, load_config
from evertrain.data.store import Store, now
from evertrain.serving.redact import Redactor
from evertrain.serving.traces import TraceWriter, feedback_row, live_pass_rates
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
    from evertrain.report import format_live, live_pass_rate

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
