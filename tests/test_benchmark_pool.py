"""`benchmarks/vs_trl.py --pool`: a replication on other seeds is pooled only with runs made the same way."""

from __future__ import annotations

import json

import pytest

import benchmarks.common
from benchmarks import vs_trl

SETTINGS = {"iterations": 2, "eval_problems": 4, "eval_dtype": "float32", "learning_rate_both": 2e-4,
            "model": "smollm2", "matched_budget": True, "group_size": 8, "max_new_tokens": 24, "temperature": 0.8,
            "seeds": [], "evertrain": {"settings_changed": ["eval.every=2"]}}
BASE = {"pass1": 0.25, "ci": [0.0, 0.75], "passed": "1000"}


def _run(system: str, seed: int, passed: str, cpu_min: float) -> dict:
    gain = passed.count("1") / 4 - 0.25
    return {"system": system, "seed": seed, "output": "x", "passed": passed, "transfer_passed": "0000",
            "gain": gain, "gain_ci": [gain, gain], "transfer_gain": 0.0, "transfer_gain_ci": [0.0, 0.0],
            "cpu_min": cpu_min, "pass1_before": 0.25, "pass1_after": gain + 0.25, "points_per_cpu_hour": 0.0}


def _write(directory, name: str, runs: list[dict], **changes) -> None:
    settings = {**SETTINGS, **changes}
    data = {"command": f"python benchmarks/vs_trl.py --results-name {name}", "date": "2026-12-01",
            "machine": {"cpu": "test"}, "settings": settings, "runs": runs, "failures": [], "base": BASE,
            "base_transfer": {**BASE, "passed": "0000"}}
    (directory / f"{name}.json").write_text(json.dumps(data))


def test_pooled_seeds_recompute_the_means_and_the_bar(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    _write(tmp_path, "a", [_run("evertrain", 0, "1110", 6.0), _run("trl", 0, "1100", 6.0)])
    _write(tmp_path, "b", [_run("evertrain", 1, "1111", 6.0), _run("trl", 1, "1000", 6.0)])
    pooled = vs_trl.pool(["a", "b"])
    assert pooled["settings"]["seeds"] == [0, 1] and len(pooled["runs"]) == 4
    summary = pooled["summary"]
    # evertrain gains +0.50 and +0.75 (mean +0.625), TRL +0.25 and 0 (mean +0.125), all in 6 CPU-minutes
    assert summary["evertrain"]["gain"] == pytest.approx(0.625) and summary["trl"]["gain"] == pytest.approx(0.125)
    assert summary["bar"]["ratio"] == pytest.approx(5.0) and summary["bar"]["met"]
    assert set(pooled["pooled_from"]) == {"a", "b"} and {r["from"] for r in pooled["runs"]} == {"a", "b"}


def test_runs_made_otherwise_are_not_pooled(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    _write(tmp_path, "a", [_run("evertrain", 0, "1110", 6.0)])
    _write(tmp_path, "six", [_run("evertrain", 1, "1110", 12.0)], iterations=6)
    with pytest.raises(SystemExit, match=r"other settings.*iterations"):
        vs_trl.pool(["a", "six"])
    _write(tmp_path, "again", [_run("evertrain", 0, "1111", 6.0)])
    with pytest.raises(SystemExit, match="evertrain seed 0 is in more than one file"):
        vs_trl.pool(["a", "again"])
    _write(tmp_path, "tweaked", [_run("evertrain", 2, "1111", 6.0)],
           evertrain={"settings_changed": ["eval.every=3"]})
    with pytest.raises(SystemExit, match="--set"):
        vs_trl.pool(["a", "tweaked"])
