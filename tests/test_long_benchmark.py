"""benchmarks/long.py's late gain and benchmarks/vs_trl.py's bar against the stronger of the two TRL baselines."""

from __future__ import annotations

import pandas as pd
import pytest

from benchmarks import long as long_curve
from benchmarks import vs_trl


def _scores(rows: list[tuple[int, str, str, int, int | None, str | None]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["model_version", "split", "problem_id", "reward", "level", "source"]).assign(
        env="arithmetic")


def test_late_gain_is_paired_on_the_problems_both_answered():
    # v2 solves a, b of a..d; v5 solves a, c, d and e (which v2 never answered: left out of the pairing)
    rows = [(2, "broad", p, r, 0, "level") for p, r in zip("abcd", (1, 1, 0, 0), strict=True)]
    rows += [(5, "broad", p, r, 0, "level") for p, r in zip("abcde", (1, 0, 1, 1, 1), strict=True)]
    gain = long_curve.late_gain(_scores(rows), 2, 5)
    assert gain["problems"] == 4
    assert gain["before_pass1"] == pytest.approx(0.5) and gain["after_pass1"] == pytest.approx(0.75)
    assert gain["gain"] == pytest.approx(0.25)
    assert (gain["improved"], gain["worsened"]) == (2, 1)
    assert gain["gain_low"] <= 0.25 <= gain["gain_high"]


def test_late_gain_of_the_same_champion_is_exactly_zero():
    rows = [(3, "broad", p, r, 1, "level") for p, r in zip("abc", (1, 0, 1), strict=True)]
    gain = long_curve.late_gain(_scores(rows), 3, 3)
    assert (gain["gain"], gain["gain_low"], gain["gain_high"]) == (0.0, 0.0, 0.0)


def test_late_gain_needs_both_versions_measured():
    rows = [(3, "broad", "a", 1, 1, "level")]
    assert long_curve.late_gain(_scores(rows), 1, 3) is None
    assert long_curve.late_gain(_scores(rows), None, 3) is None


def test_broad_pass1_by_level_and_transfer():
    rows = [(4, "broad", "a", 1, 0, "level"), (4, "broad", "b", 0, 0, "level"), (4, "broad", "c", 0, 2, "level"),
            (4, "broad", "d", 1, None, "transfer")]
    assert long_curve.by_level(_scores(rows), 4) == {"arithmetic:level 0": 0.5, "arithmetic:level 2": 0.0,
                                                    "arithmetic:transfer": 1.0}


def _run(system: str, seed: int, passed: str, cpu_min: float) -> dict:
    return {"system": system, "seed": seed, "passed": passed, "transfer_passed": "0000", "cpu_min": cpu_min,
            "gain": passed.count("1") / 4 - 0.25, "transfer_gain": 0.0}


def test_the_bar_is_against_the_stronger_baseline():
    base = {"passed": "1000"}
    # evertrain +0.50 a seed, trl +0.25, trl_warm +0.50 (as good as evertrain): the bar is trl_warm's
    runs = [_run("evertrain", s, "1110", 6.0) for s in (0, 1)] + [_run("trl", s, "1100", 6.0) for s in (0, 1)]
    runs += [_run("trl_warm", s, "1110", 6.0) for s in (0, 1)]
    bar = vs_trl.aggregate(runs, base, {"passed": "0000"})["bar"]
    assert bar["baseline"] == "trl_warm"
    assert bar["ratio"] == pytest.approx(1.0) and not bar["met"]
    assert bar["per_baseline"]["trl"]["ratio"] == pytest.approx(2.0)
    # without the warm-started baseline the same evertrain runs meet the bar against plain TRL
    plain = vs_trl.aggregate([r for r in runs if r["system"] != "trl_warm"], base, {"passed": "0000"})["bar"]
    assert plain["baseline"] == "trl" and plain["met"]


def _answers(rows: list[tuple[str, str, int, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["set", "problem_id", "model_version", "reward"])


def test_trainee_gain_is_paired_per_problem_and_stratified_by_set():
    from benchmarks import trainee_gain

    # gate: the trainee (v7) solves both problems the base missed; extra: one loss, and one problem only the base
    # answered (left out of the pairing)
    rows = [("gate", p, v, r) for p in "ab" for v, r in ((1, 0.0), (7, 1.0))]
    rows += [("extra", "c", 1, 1.0), ("extra", "c", 7, 0.0), ("extra", "d", 1, 0.0), ("extra", "d", 7, 0.0),
             ("extra", "e", 1, 1.0)]
    gate = trainee_gain.paired(_answers(rows)[lambda f: f["set"] == "gate"], 1, 7)
    assert (gate["problems"], gate["gain"], gate["ci95"]) == (2, 1.0, [1.0, 1.0])
    both = trainee_gain.paired(_answers(rows), 1, 7)
    assert both["problems"] == 4 and both["gain"] == pytest.approx(0.25)
    assert (both["base_pass1"], both["trainee_pass1"]) == (pytest.approx(0.25), pytest.approx(0.5))
    # stratified: the gate's two +1s are in every resample, the extra set's -1 in about half of them
    assert both["ci95"] == [pytest.approx(0.0), pytest.approx(0.5)] and 0.1 < both["p_gain_at_most_0"] < 0.4


def test_trainee_gain_extra_problems_are_never_drawn_held_out_tasks():
    from types import SimpleNamespace

    from benchmarks import trainee_gain
    from evertrain.config import load_config
    from evertrain.envs import registry
    from evertrain.tasks.evaluate import eval_problems, sealed_problems

    config = load_config("configs/terminal.toml")
    env = registry.get("terminal", held_out="generated")
    rt = SimpleNamespace(config=config, env=lambda name: env)
    extra = trainee_gain.extra_problems(rt, 6)
    gate, sealed = eval_problems(rt), sealed_problems(rt)
    assert len(extra) == 6 and {p.split for p in extra} == {"test"}
    assert len({p.id for p in gate + sealed + extra}) == len(gate) + len(sealed) + 6  # all new tasks
    assert trainee_gain.extra_problems(rt, 0) == []


def test_a_budget_run_keeps_its_configs_gate_cadence():
    # the short schedule's two iterations are gated once, at the end; a --budget run gates as its config says
    assert vs_trl.schedule_sets("short", None, []) == ["eval.every=2"]
    assert vs_trl.schedule_sets("short", 64.0, []) == []
    assert vs_trl.schedule_sets("short", 64.0, ["eval.every=2"]) == ["eval.every=2"]  # the earlier runs' setting
    assert vs_trl.schedule_sets("short", None, ["eval.every=4", "update.epochs=1"]) == ["eval.every=4",
                                                                                      "update.epochs=1"]
    assert vs_trl.schedule_sets("demo", None, ["update.epochs=1"]) == ["update.epochs=1"]
