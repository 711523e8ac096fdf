"""Curricula an environment package declares itself: a literal ``CURRICULUM`` in a verifiers taskset's or an OpenEnv
server's package (read without importing it), each level the package's options over the configured ones; the
configured environment grades every level's problems with that level's rules."""

from __future__ import annotations

import json
import re

import pytest

from evertrain.curriculum import BandLadder, DeclaredLadder, ladder_for
from evertrain.envs import registry
from evertrain.envs.base import Problem, replies_of
from evertrain.envs.declared import declared_levels
from evertrain.envs.openenv_env import EVAL_SEED_BASE
from tests.test_ecosystem import COUNT
from tests.test_verifiers_env import PLANTED


def _no_history(ids: list[str]) -> dict[str, float]:
    return {}


def test_a_verifiers_taskset_brings_its_levels_and_each_level_is_graded_by_its_own_tasks():
    sums = registry.get("verifiers:vf-sums", num_tasks=60, templated=True)
    try:
        ladder = ladder_for(sums)
        assert isinstance(ladder, DeclaredLadder) and ladder.levels == 4
        assert ladder.describe(0) == "digits 1, terms 2" and ladder.describe(3) == "digits 2, terms 3"
        easy, hard = ladder.problems(0, 8, 0, _no_history), ladder.problems(3, 8, 0, _no_history)
        assert len(easy) == len(hard) == 8
        # the level's fields over the configured ones: two one-digit terms, then three two-digit terms
        assert all(re.match(r"What is \d \+ \d\?", p.prompt) for p in easy), [p.prompt for p in easy]
        assert all(re.match(r"What is \d\d \+ \d\d \+ \d\d\?", p.prompt) for p in hard), [p.prompt for p in hard]
        assert all(p.env == sums.name and p.payload["level"] == 3 for p in hard)
        # the configured environment grades a level's problem with that level's task and reward
        problem = hard[0]
        total = sum(int(term) for term in re.findall(r"\d+", problem.prompt.split("?")[0]))
        assert sums.verify(problem, f"So the answer is \\boxed{{{total}}}.").passed
        assert sums.verify(problem, f"So the answer is \\boxed{{{total + 1}}}.").reward == 0.0
        # a level's gate problems are its held-out ones: none is a training problem of that level
        gate = ladder.gate(3, 10, 0)
        assert gate and not {p.id for p in gate} & {p.id for p in sums.level_pool(3, "train")}
        assert {p.id for p in ladder.broad(3, 10, 1)} <= {p.id for p in sums.level_pool(3, "eval")}
        # a level the package does not declare is that rollout's grader error, never another level's grade
        forged = Problem(sums.name, "forged", problem.prompt, {**problem.payload, "level": 9}, "train")
        assert sums.verify(forged, f"\\boxed{{{total}}}").reason == "grader_error"
    finally:
        sums.close()


def test_an_openenv_server_brings_its_levels_as_reset_arguments():
    count = registry.get("openenv:count", **COUNT)
    try:
        ladder = ladder_for(count)
        assert isinstance(ladder, DeclaredLadder) and ladder.levels == 3 and ladder.describe(2) == "steps 3"
        for level, steps in ((0, 1), (2, 3)):
            problem = ladder.problems(level, 1, 0, _no_history)[0]
            assert problem.payload["level"] == level and problem.payload["seed"] < EVAL_SEED_BASE
            reference = count.reference(problem)  # played by the server's own state, reset with the level's steps
            verdict = count.verify(problem, reference)
            assert verdict.passed and len(verdict.detail["steps"]) == steps
        short = json.dumps({"replies": replies_of(reference)[:2]})  # two right answers of the three level 2 asks
        assert count.verify(problem, short).reason == "incomplete"
        assert all(p.payload["seed"] >= EVAL_SEED_BASE for p in ladder.gate(2, 5, 0))
        with pytest.raises(ValueError, match="reset_options"):
            registry.get("openenv:count", **COUNT, reset_options={"seed": 3})  # the adapter's own argument
    finally:
        count.close()


def test_a_declaration_is_read_without_running_the_package_and_must_be_a_literal(tmp_path):
    package = tmp_path / "lvl_pkg"
    package.mkdir()
    init = package / "__init__.py"
    init.write_text("raise SystemExit('imported')\nCURRICULUM = [{'size': 1}, {'size': 2}]\n")
    assert declared_levels(["lvl_pkg"], str(tmp_path)) == [{"size": 1}, {"size": 2}]  # nothing ran
    (package / "server.py").write_text("CURRICULUM: list = [{'steps': 4}]\n")
    assert declared_levels(["lvl_pkg.server", "lvl_pkg"], str(tmp_path)) == [{"steps": 4}]
    init.write_text("CURRICULUM = [dict(size=i) for i in range(3)]\n")
    with pytest.raises(ValueError, match=r"lvl_pkg: CURRICULUM .* must be a literal list"):
        declared_levels(["lvl_pkg"], str(tmp_path), owner="lvl_pkg")
    for bad in ("[]", "[1, 2]", "{'size': 1}"):
        init.write_text(f"CURRICULUM = {bad}\n")
        with pytest.raises(ValueError, match="non-empty list of option tables"):
            declared_levels(["lvl_pkg"], str(tmp_path))
    init.write_text("LEVELS = [{'size': 1}]\n")
    assert declared_levels(["lvl_pkg"], str(tmp_path)) is None
    assert declared_levels(["no_such_package_here"]) is None
    # a taskset without a declaration keeps the curriculum of pass-rate bands, as any fixed pool
    assert isinstance(ladder_for(registry.get("verifiers:vf-planted", path=PLANTED, mode="loose")), BandLadder)
    # a level may set the taskset's fields only, not evertrain's own options
    (tmp_path / "vf_levels").mkdir()
    (tmp_path / "vf_levels" / "__init__.py").write_text("CURRICULUM = [{'timeout_s': 1}]\n")
    with pytest.raises(ValueError, match=r"verifiers:vf-levels: a CURRICULUM level .*\(timeout_s\)"):
        ladder_for(registry.get("verifiers:vf-levels", path=str(tmp_path)))
