"""Grading failures that are not the completion's fault (a missing sandbox, a verifier crash) are counted per
iteration, and the score stage fails above ``score.max_grader_error_share`` instead of training on zeros."""

from __future__ import annotations

import json

import pytest

from evertrain.envs.digits import Digits
from evertrain.runtime import Runtime
from evertrain.sandbox import SandboxUnavailable
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from tests.conftest import smoke_config_in


def _broken_for(problem_ids: set[str] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Digits' grader raises, as a sandboxed one does on a worker without bubblewrap, for ``problem_ids``
    (None: every problem)."""
    real = Digits.verify

    def verify(self, problem, completion):
        if problem_ids is None or problem.id in problem_ids:
            raise SandboxUnavailable("bubblewrap (bwrap) is not on PATH")
        return real(self, problem, completion)

    monkeypatch.setattr(Digits, "verify", verify)


def _scored_campaign(tmp_path, models_dir, **score):
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=8, group_size=4, score=score)
    rt = Runtime.open(config)
    for stage in ("curate", "rollout"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    return rt


def test_a_failing_grader_fails_the_score_stage_naming_the_share_and_the_cause(tmp_path, models_dir, monkeypatch):
    rt = _scored_campaign(tmp_path, models_dir)
    assert rt.config.score.max_grader_error_share == 0.05
    _broken_for(None, monkeypatch)
    with pytest.raises(RuntimeError, match=r"32 of 32 completions \(100\.0%\) could not be graded") as error:
        run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    message = str(error.value)
    assert "score.max_grader_error_share = 0.05" in message and "bubblewrap (bwrap) is not on PATH" in message
    assert "SandboxUnavailable" in message
    row = rt.store.query("SELECT status, error FROM stage_runs WHERE stage = 'score'").iloc[0]
    assert row["status"] == "failed" and "grader_error_share 1.000" in row["error"]
    # no zero was written for the update to train on
    assert rt.store.query("SELECT reward FROM rollouts")["reward"].isna().all()
    run = rt.tracker.client.get_run(rt.tracker.run_id(0))
    assert run.data.metrics["score/grader_error_share"] == 1.0


def test_below_the_limit_grader_errors_score_zero_and_their_share_is_recorded(tmp_path, models_dir, monkeypatch):
    rt = _scored_campaign(tmp_path, models_dir, max_grader_error_share=0.2)
    first = str(rt.store.scalar("SELECT min(problem_id) FROM problems"))
    _broken_for({first}, monkeypatch)
    metrics = run_stage(rt, "score", 0, STAGE_FUNCTIONS["score"])
    assert metrics["grader_error_share"] == pytest.approx(4 / 32)  # one group of four
    stored = json.loads(rt.store.scalar("SELECT metrics FROM stage_runs WHERE stage = 'score'"))
    assert stored["grader_error_share"] == pytest.approx(4 / 32)
    run = rt.tracker.client.get_run(rt.tracker.run_id(0))
    assert run.data.metrics["score/grader_error_share"] == pytest.approx(4 / 32)
    broken = rt.store.query("SELECT reward, reason FROM rollouts WHERE problem_id = ?", [first])
    assert set(broken["reason"]) == {"grader_error"} and set(broken["reward"]) == {0.0}
