"""A complete two-iteration campaign through the real Prefect flow, MLflow (SQLite) and a DuckDB file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in


@pytest.fixture(scope="module")
def finished_campaign(tmp_path_factory, models_dir, prefect_server):
    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import Runtime

    config = smoke_config_in(tmp_path_factory.mktemp("campaign"), models_dir)
    finished = campaign_flow(config, 2)
    with Runtime.open(config) as rt:
        yield config, rt, finished


def test_two_iterations_write_every_table(finished_campaign):
    config, rt, finished = finished_campaign
    assert finished == [0, 1]
    store = rt.store
    per_iteration = store.query(
        "SELECT iteration, count(*) AS n FROM problems WHERE campaign = ? GROUP BY iteration ORDER BY iteration",
        [config.name],
    )
    assert per_iteration["n"].tolist() == [config.problems_per_iteration] * 2
    # G rollouts for every curated problem of every iteration, every one scored
    groups = store.query(
        """SELECT p.iteration, p.problem_id, count(r.sample) AS samples, count(r.reward) AS scored
           FROM problems p LEFT JOIN rollouts r USING (campaign, iteration, problem_id)
           WHERE p.campaign = ? GROUP BY ALL""", [config.name])
    assert (groups["samples"] == config.group_size).all()
    assert (groups["scored"] == config.group_size).all()
    statuses = store.query("SELECT status FROM stage_runs WHERE campaign = ?", [config.name])["status"]
    assert len(statuses) == 2 * len(STAGES) and set(statuses) == {"completed"}
    promotions = store.query("SELECT * FROM promotions WHERE campaign = ? ORDER BY iteration", [config.name])
    assert promotions["iteration"].tolist() == [0, 1]
    assert promotions["reason"].str.len().min() > 0
    evals = store.query("SELECT iteration, model_version, count(*) AS n FROM evals GROUP BY ALL")
    n_eval = config.eval.problems_per_env * len(config.environments)
    assert (evals["n"] == n_eval).all()


def test_update_changed_the_weights(finished_campaign):
    config, rt, _ = finished_campaign
    versions = rt.store.query("SELECT * FROM model_versions WHERE campaign = ? ORDER BY version", [config.name])
    assert versions["kind"].tolist() == ["base", "lora", "lora"]
    assert not any(Path(p).is_absolute() for p in versions["path"])  # relative: the state folder can move
    first, second = (rt.checkpoint(int(v)) for v in versions["version"].tolist()[1:])
    a, b = load_file(first / "adapter_model.safetensors"), load_file(second / "adapter_model.safetensors")
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b, "the adapter has no LoRA B matrices"
    # LoRA B starts at zero: a non-zero B means the update moved the policy away from the base model
    assert any(a[k].abs().sum() > 0 for k in lora_b)
    assert any(not torch.equal(a[k], b[k]) for k in a), "iteration 1 did not change the weights"
    deltas = rt.store.query(
        "SELECT json_extract(metrics, '$.weight_delta_norm')::DOUBLE AS d FROM stage_runs WHERE stage = 'update'")
    assert (deltas["d"] > 0).all()


def test_mlflow_holds_runs_and_registry(finished_campaign):
    config, rt, _ = finished_campaign
    client = rt.tracker.client
    experiment = client.get_experiment_by_name(config.experiment)
    every = client.search_runs([experiment.experiment_id])
    runs = [r for r in every if "evertrain.iteration" in r.data.tags]
    (campaign_run,) = [r for r in every if r.data.tags.get("evertrain.campaign_run") == "true"]
    # MLflow draws the curve: every stage metric on the campaign's run with the iteration as its step, and the
    # iterations' runs nested under it
    for metric in ("score/mean_reward", "promote/gain", "update/loss"):
        assert [m.step for m in client.get_metric_history(campaign_run.info.run_id, metric)] == [0, 1], metric
    assert {r.data.tags.get("mlflow.parentRunId") for r in runs} == {campaign_run.info.run_id}
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    assert sorted(r.data.tags["evertrain.iteration"] for r in runs) == ["0", "1"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all("rollout/completions" in r.data.metrics and "promote/gain" in r.data.metrics for r in runs)
    assert all(r.data.tags.get("prefect.flow_run_id") for r in runs)
    versions = client.search_model_versions(f"name = '{config.registered_model}'")
    assert len(versions) == 3
    champion = client.get_model_version_by_alias(config.registered_model, "champion")
    challenger = client.get_model_version_by_alias(config.registered_model, "challenger")
    assert int(challenger.version) == 3
    import mlflow

    path = Path(mlflow.artifacts.download_artifacts(artifact_uri=champion.source))
    assert (path / "evertrain_checkpoint.json").exists()
    for run in runs:  # each iteration's run carries the campaign's progress figure and the decision
        assert "figures/progress.png" in [a.path for a in client.list_artifacts(run.info.run_id, "figures")]
        assert run.data.tags["promotion.reason"]


def test_report_lists_every_iteration(finished_campaign, tmp_path):
    from evertrain.data.lineage import iteration_report
    from evertrain.plots import html_report

    config, rt, _ = finished_campaign
    rows = iteration_report(rt.store, config.name)
    assert [r["iteration"] for r in rows] == [0, 1]
    for row in rows:
        assert row["status"] == "completed" and row["tokens"] > 0 and row["dollars"] > 0
        assert row["pass1_challenger"] is not None and row["promoted"] is not None
        assert set(row["dropped"]) >= {"duplicate", "near_duplicate", "contaminated", "too_easy", "too_hard"}
    from evertrain.report import iteration_line

    line = iteration_line(rows[1])
    assert line.startswith("iteration 1 | reward ") and len(line) <= 100
    # the loop's line reads one iteration by a bounded query: the same row, but the running totals
    (alone,) = iteration_report(rt.store, config.name, only=1)
    running = {"cumulative_dollars", "points_gained_total", "points_per_dollar_total"}
    assert {k: v for k, v in alone.items() if k not in running} == \
        {k: v for k, v in rows[1].items() if k not in running}
    assert iteration_line(alone) == line and iteration_report(rt.store, config.name, only=7) == []
    # promote's progress figure reads its window the same way (tasks/promote.PROGRESS_WINDOW): bounded, not the
    # whole campaign each iteration
    (window,) = iteration_report(rt.store, config.name, since=1)
    assert {k: v for k, v in window.items() if k not in running} == \
        {k: v for k, v in rows[1].items() if k not in running}
    assert [r["iteration"] for r in iteration_report(rt.store, config.name, since=0)] == [0, 1]
    assert f"[{rows[1]['gain_low']:+.3f}, {rows[1]['gain_high']:+.3f}]" in line
    page = html_report(config.name, rows)
    assert page.count("<img") == 1 and "data:image/png;base64," in page and "iteration 1" in page


def test_rerunning_each_stage_keeps_rows_and_decisions(finished_campaign):
    """Every stage of iteration 1 rerun, in the loop's order, in one test (each rerun reads what the previous
    one wrote, so separate parametrised tests would depend on their order): row counts stay, the update
    trains the same weights again and replaces its registration, the gate reaches the same decision."""
    config, rt, _ = finished_campaign
    decision_columns = ["promoted", "challenger_pass1", "champion_pass1"]
    before_decision = rt.store.query("SELECT * FROM promotions WHERE campaign = ? AND iteration = 1",
                                     [config.name])[decision_columns].to_dict("records")
    for stage in STAGES:
        before = rt.store.counts()
        champion = rt.tracker.alias("champion")
        old_challenger = rt.tracker.alias("challenger")
        if stage == "update":
            old_weights = load_file(rt.checkpoint(old_challenger) / "adapter_model.safetensors")
        run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
        after = rt.store.counts()
        # sandbox_runs is an append-only audit log; every other table must be unchanged
        assert {k: v for k, v in after.items() if k != "sandbox_runs"} == \
            {k: v for k, v in before.items() if k != "sandbox_runs"}, stage
        assert rt.store.stage_status(config.name, 1)[stage] == "completed"
        if stage == "update":
            rows = rt.store.query("SELECT version FROM model_versions WHERE campaign = ? AND iteration = 1",
                                  [config.name])["version"].tolist()
            new_challenger = rt.tracker.alias("challenger")
            assert rows == [new_challenger] and new_challenger != old_challenger
            assert rt.trainee_version() == new_challenger
            registered = {int(v.version) for v in rt.tracker.client.search_model_versions(
                f"name = '{config.registered_model}'")}
            assert new_challenger in registered
            assert old_challenger not in registered or old_challenger == champion  # never drop the champion
            new_weights = load_file(rt.checkpoint(new_challenger) / "adapter_model.safetensors")
            assert new_weights.keys() == old_weights.keys()
            for key in new_weights:  # seeded from the campaign and the iteration: the same update again
                torch.testing.assert_close(new_weights[key], old_weights[key], atol=1e-6, rtol=1e-5)
        elif stage == "promote":
            decision = rt.store.query("SELECT * FROM promotions WHERE campaign = ? AND iteration = 1",
                                      [config.name])
            assert decision[decision_columns].to_dict("records") == before_decision
            expected = rt.tracker.alias("challenger") if bool(decision["promoted"].iloc[0]) else champion
            assert rt.tracker.alias("champion") == expected
        else:
            assert rt.tracker.alias("champion") == champion, stage


def test_each_iteration_logs_its_trajectories(finished_campaign, capsys):
    from evertrain.cli import main

    config, rt, _ = finished_campaign
    run_id = rt.tracker.run_id(0)
    table = rt.tracker.client.load_table(rt.tracker.experiment_id, "rollouts/iteration-0.json", run_ids=[run_id])
    assert len(table) > 0 and {"prompt", "turns", "reward", "reason"} <= set(table.columns)
    stored = rt.store.query("SELECT problem_id, sample, reward FROM rollouts WHERE iteration = 0")
    first = table.iloc[0]
    match = stored[(stored["problem_id"] == first["problem_id"]) & (stored["sample"] == first["sample"])]
    assert float(match["reward"].iloc[0]) == float(first["reward"])

    capsys.readouterr()
    assert main(["show", "--campaign", config.name, "--iteration", "0", "--env", "digits", "--limit", "2",
                 "--store", config.paths.store]) == 0
    printed = capsys.readouterr().out
    from evertrain.data.lineage import sample_rollouts

    shown = sample_rollouts(rt.store, config.name, 0, env="digits", per_env=2)
    assert len(shown) == 2 and {r["env"] for r in shown} == {"digits"}
    assert printed.count("[1] assistant") == 2 and "arithmetic" not in printed
    for row in shown:
        stored = rt.store.query("SELECT reason FROM rollouts WHERE iteration = 0 AND problem_id = ? AND sample = ?",
                                [row["problem_id"], row["sample"]])
        assert row["problem_id"] in printed and stored["reason"].iloc[0] in printed
    # no iteration 7: bad input, refused with status 2 (tests/test_cli_refusals.py)
    assert main(["show", "--campaign", config.name, "--iteration", "7", "--store", config.paths.store]) == 2


def test_html_report_draws_in_a_browser(finished_campaign, tmp_path):
    """`evertrain report --html` opened in headless Chromium: the page renders and its plot is drawn."""
    import base64
    import io
    import re
    import shutil
    import subprocess

    from PIL import Image

    from evertrain.cli import main

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    config, _, _ = finished_campaign
    page = tmp_path / "report.html"
    assert main(["report", "--campaign", config.name, "--store", config.paths.store, "--html", str(page)]) == 0
    inline = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page.read_text()).group(1)
    plot = Image.open(io.BytesIO(base64.b64decode(inline)))
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", f"--screenshot={shot}",
                    "--window-size=1300,2400", page.as_uri()], check=True, capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1300, 2400)
    # the plot's lines are the only saturated colours on the page (tables are black on white and grey)
    hsv = image.convert("HSV")
    coloured = [(i % 1300, i // 1300) for i, (_, saturation, value) in enumerate(hsv.getdata())
                if saturation > 100 and value > 60]
    assert len(coloured) > 500, "no plot drawn: the page shows no coloured lines"
    xs, ys = [x for x, _ in coloured], [y for _, y in coloured]
    # drawn at its own size (CSS pixels = PNG pixels), near the top, below the heading
    assert max(xs) - min(xs) > 0.5 * plot.width and max(xs) <= 40 + plot.width
    assert max(ys) - min(ys) > 0.4 * plot.height and max(ys) < 200 + plot.height


def test_an_iteration_line_names_the_next_gate_and_always_ends_with_its_cost():
    """A skipped gate's reason was cut at 100 columns with the cost ("gate skipped: skipped: the gate runs every
    ...", the seconds lost): the next gate is named in a few words, any other reason is shortened, never the cost."""
    from evertrain.report import iteration_line

    row = {"iteration": 12, "mean_reward": 0.117, "zero_variance_share": 0.0, "promoted": None, "wall_s": 1234.4,
           "cpu_s": 2345.6, "promotion_reason": "skipped: the gate runs every 3 updates (next at iteration 14)"}
    assert iteration_line(row) == \
        "iteration 12 | reward 0.117 | signal 100% | no gate (next at iteration 14) | 1234 s, cpu 2346 s"
    long = iteration_line({**row, "promotion_reason": "skipped: " + "a reason that goes on " * 10})
    assert len(long) == 100 and long.endswith("... | 1234 s, cpu 2346 s"), long
    decided = iteration_line({**row, "promoted": False, "gate_challenger_pass1": 0.155, "gate_champion_pass1": 0.11,
                              "gain_low": -0.036, "gain_high": 0.136, "champion_version": 10})
    assert decided == \
        "iteration 12 | reward 0.117 | signal 100% | gate +0.045 [-0.036,+0.136] kept v10 | 1234 s cpu 2346 s"
