"""The report says why the last gate kept the champion: the refused challenger's gain per environment."""

from __future__ import annotations

import datetime as dt

from evertrain.data.lineage import last_refusal
from evertrain.data.store import Store
from evertrain.report import format_refusal

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _evals(version: int, iteration: int, env: str, rewards: list[int], split: str | None = None) -> list[dict]:
    return [{"campaign": "c", "iteration": iteration, "model_version": version, "role": "x",
             "problem_id": f"{env}-{i}", "sample": 0, "env": env, "reward": float(r), "passed": bool(r),
             "split": split, "created_at": NOW} for i, r in enumerate(rewards)]


def _promotion(iteration: int, promoted: bool, reason: str, minutes: int) -> dict:
    return {"campaign": "c", "iteration": iteration, "challenger_version": iteration + 2, "champion_version": 1,
            "promoted": promoted, "reason": reason, "decided_at": NOW + dt.timedelta(minutes=minutes)}


def test_a_refused_challenger_is_shown_per_environment(tmp_path):
    store = Store(tmp_path / "s.duckdb")
    store.append("evals", _evals(1, 1, "math", [1, 1, 1, 0]) + _evals(3, 1, "math", [1, 0, 0, 0])
                 + _evals(1, 1, "tool", [0, 0, 0, 0]) + _evals(3, 1, "tool", [1, 1, 1, 1])
                 # sealed rows of the same problems are not what the gate weighed
                 + [{**r, "iteration": 2, "problem_id": "sealed-" + r["problem_id"], "split": "test"}
                    for r in _evals(3, 1, "math", [1, 1, 1, 1])])
    store.append("promotions", [_promotion(1, False, "kept champion: math regressed by 0.500 > 0.050", 0)])
    refusal = last_refusal(store, "c")
    assert refusal is not None and refusal["challenger_version"] == 3 and refusal["champion_version"] == 1
    gains = {e["env"]: (e["champion_pass1"], e["challenger_pass1"], e["gain"], e["problems"]) for e in refusal["envs"]}
    assert gains == {"math": (0.75, 0.25, -0.5, 4), "tool": (0.0, 1.0, 1.0, 4)}
    lines = format_refusal(refusal)
    assert "refused (kept champion: math regressed" in lines[0]
    assert any(line.strip().startswith("tool: challenger 1.000 vs champion v1 0.000") for line in lines)

    # a later promotion: nothing was refused last
    store.append("promotions", [_promotion(2, True, "promoted", 5)])
    assert last_refusal(store, "c") is None and format_refusal(None) == []
    store.close()
