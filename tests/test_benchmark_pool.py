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


def test_reevaluate_measures_the_delivered_checkpoints_on_more_problems(tmp_path, monkeypatch):
    """--reevaluate answers every run's delivered checkpoint again on n problems; a run whose checkpoint is gone
    is listed as a failure, not dropped."""
    from evertrain.config import load_config
    from evertrain.models.checkpoint import resolve_base, write_base_checkpoint

    results, scratch = tmp_path / "results", tmp_path / "scratch"
    results.mkdir()
    monkeypatch.setattr(benchmarks.common, "RESULTS", results)
    config = load_config("configs/long.toml", ["model.path=embedded:tiny", f"model.models_dir={scratch / 'models'}"])
    base = str(write_base_checkpoint(scratch / "base", resolve_base(config.model)))
    for seed, checkpoint in ((0, base), (1, str(scratch / "deleted"))):
        (scratch / f"seed-{seed}").mkdir(parents=True)
        worker = {"status": "ok", "checkpoints": [{"path": checkpoint}], "final_checkpoint": checkpoint,
                  "train_cpu_s": 60.0, "update_steps": 1, "completions": 8}
        (scratch / f"seed-{seed}" / "trl.json").write_text(json.dumps(worker))
    settings = {**SETTINGS, "model": "tiny", "evertrain_config": "configs/long.toml"}
    data = {"command": "python benchmarks/vs_trl.py", "date": "2026-12-01", "machine": {"cpu": "test"},
            "settings": settings, "scratch": str(scratch), "failures": [], "base": BASE,
            "base_transfer": {**BASE, "passed": "0000"},
            "runs": [_run("trl", 0, "1100", 1.0), _run("trl", 1, "1110", 1.0)]}
    (results / "first.json").write_text(json.dumps(data))

    again = vs_trl.reevaluate(["first"], 6, "float32")
    assert again["settings"]["eval_problems"] == 6 and len(again["base"]["passed"]) == 6
    [run] = again["runs"]  # seed 0: its checkpoint is the base model, so it gains exactly nothing
    assert (run["seed"], len(run["passed"]), run["gain"]) == (0, 6, 0.0)
    assert run["passed"] == again["base"]["passed"] and run["gain_on_4"] == pytest.approx(0.25)
    [failure] = again["failures"]
    assert failure["seed"] == 1 and "deleted" in failure["error"] and "is gone" in failure["error"]
