"""A person approves promotions (promotion.approval = "required"), through the real Prefect server.

One campaign of three iterations with the tiny model, each passing the gate against the base model, and a
reviewer in another thread who answers as a person would: iteration 0 is rejected with `evertrain reject`
(the CLI's entry function), iteration 1 gets no answer (the timeout rejects it), iteration 2 is approved
through the API the Prefect UI's form calls.
"""

from __future__ import annotations

import threading
import time

import pandas as pd
import pytest

from tests.conftest import api_key, smoke_config_in

TIMEOUT_S = 12  # the reviewer answers within a few seconds of a pause; iteration 1 waits all of it


def _pause_key(run: dict) -> str:
    return str(run["state"].state_details.pause_key)


def _reviewer(campaign: str, keys: dict, stop: threading.Event, seen: dict) -> None:
    from prefect.flow_runs import resume_flow_run

    from evertrain.approval import evidence_digest, paused_promotions, waiting
    from evertrain.cli import main

    # before anything waits, an answer is refused with a clear error (exit 2)
    seen["early"] = main(["approve", "--campaign", campaign, "--key-file", str(keys["ann"])])
    while not stop.is_set():
        for run in paused_promotions(campaign):
            iteration, pause = run["iteration"], _pause_key(run)
            if iteration == 0 and "mallory" not in seen:
                # a key without the approve scope: sent, recorded, refused; the stage waits again (a new pause)
                seen["mallory"] = (pause, main(["reject", "--campaign", campaign, "--key-file", str(keys["mallory"]),
                                                "--reason", "no right to"]))
            elif iteration == 0 and 0 not in seen and pause != seen["mallory"][0]:
                seen[0] = main(["reject", "--campaign", campaign, "--key-file", str(keys["bob"]), "--reason",
                                "too risky"])
            elif iteration == 2 and 2 not in seen:
                # the form's description, read back from the Prefect server (what the UI shows), as a page
                seen["html"] = main(["approve", "--campaign", campaign, "--html", str(seen["page"])])
                try:  # the form is typed: an answer without a key is refused by the server
                    resume_flow_run(run["flow_run_id"], run_input={"approve": True, "reason": "trust me"})
                except RuntimeError as error:
                    seen["untyped"] = str(error)
                # what the Prefect UI's form sends: the key pasted in, the evidence hash it was prefilled with
                digest = evidence_digest(waiting(campaign, 2)["evidence"])
                resume_flow_run(run["flow_run_id"], run_input={
                    "approve": True, "api_key": keys["ann"].read_text(), "evidence_sha256": digest,
                    "reason": "sealed looks fine"})
                seen[2] = 0
            # iteration 1: nobody answers
        time.sleep(0.5)


@pytest.fixture(scope="module")
def approved_campaign(tmp_path_factory, models_dir, prefect_server):
    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import Runtime

    config = smoke_config_in(
        tmp_path_factory.mktemp("approval"), models_dir, name="approval",
        environments=[{"name": "digits", "weight": 1}], problems_per_iteration=8, group_size=8,
        eval={"problems_per_env": 16},
        # 6 epochs: the tiny model learns digits within iteration 0 (measured: 2 epochs took until iteration 2),
        # so every gate passes against the base champion that rejections keep
        update={"learning_rate": 1e-2, "finetune": "full", "minibatch_size": 32, "microbatch_size": 32, "epochs": 6},
        promotion={"confidence": 0.5, "bootstrap_samples": 200, "max_regression": 1.0,
                   "approval": "required", "approval_timeout_s": TIMEOUT_S},
    )
    folder = tmp_path_factory.mktemp("keys")
    keys = {}
    with Runtime.open(config) as rt:  # each reviewer's key, as `evertrain keys create` makes it
        for name, scopes in (("ann", "approve"), ("bob", "approve"), ("mallory", "infer,feedback")):
            keys[name] = folder / name
            keys[name].write_text(api_key(rt.store, scopes, name=name))
    stop, seen = threading.Event(), {"page": tmp_path_factory.mktemp("form") / "approval.html"}
    reviewer = threading.Thread(target=_reviewer, args=(config.name, keys, stop, seen), daemon=True)
    reviewer.start()
    try:
        finished = campaign_flow(config, 3)
    finally:
        stop.set()
        reviewer.join(timeout=30)
    with Runtime.open(config) as rt:
        approvals = rt.store.query("SELECT * FROM approvals WHERE campaign = ? ORDER BY iteration", [config.name])
        promotions = rt.store.query("SELECT * FROM promotions WHERE campaign = ? ORDER BY iteration", [config.name])
        yield config, rt, finished, seen, approvals.set_index("iteration"), promotions.set_index("iteration")


def test_every_passed_gate_waited_for_a_person(approved_campaign):
    _, _, finished, seen, approvals, _ = approved_campaign
    assert finished == [0, 1, 2]
    assert approvals.index.tolist() == [0, 1, 2], approvals  # each gate passed and asked
    assert seen["early"] == 2  # `evertrain approve` with nothing waiting: a clear refusal
    for evidence in approvals["evidence"]:
        assert "| digits |" in evidence and "95% interval" in evidence and "Sealed splits" in evidence
        assert "champion v1" in evidence and "Completions side by side" in evidence


def test_approval_promotes_the_challenger(approved_campaign):
    _, rt, _, seen, approvals, promotions = approved_campaign
    row = approvals.loc[2]
    assert row["decision"] == "approved" and row["reviewer"] == "ann" and row["reason"] == "sealed looks fine"
    assert row["decided_at"] >= row["requested_at"] and row["waited_s"] > 0
    assert "api_key" in seen["untyped"]  # a name alone is no answer
    assert row["reviewer_key_id"].startswith("key_") and row["answered_from"] == ""  # the form says nothing
    # the key it carried was deleted from Prefect's run input once read: the server holds no secret
    from prefect.input.actions import read_flow_run_input
    from prefect.input.run_input import keyset_from_base_key

    assert read_flow_run_input(keyset_from_base_key("paused-approval-2")["response"], row["flow_run_id"]) is None
    decision = promotions.loc[2]
    assert decision["promoted"] and "approved by ann: sealed looks fine" in decision["reason"]
    assert rt.champion_version() == decision["challenger_version"] != 1
    tags = rt.tracker.client.get_run(rt.tracker.run_id(2)).data.tags
    assert tags["approval.decision"] == "approved" and tags["approval.reviewer"] == "ann"
    assert tags["promotion.promoted"] == "True"


def test_timeout_rejects(approved_campaign):
    _, rt, _, _, approvals, promotions = approved_campaign
    row = approvals.loc[1]
    assert row["decision"] == "timeout" and pd.isna(row["reviewer"]) and f"within {TIMEOUT_S} s" in row["reason"]
    assert row["waited_s"] >= TIMEOUT_S
    decision = promotions.loc[1]
    assert not decision["promoted"] and decision["reason"].startswith("kept champion: timeout")
    assert promotions.loc[2, "champion_version"] == 1  # the champion did not move
    tags = rt.tracker.client.get_run(rt.tracker.run_id(1)).data.tags
    assert tags["approval.decision"] == "timeout" and tags["promotion.promoted"] == "False"


def test_reject_from_the_command_line(approved_campaign):
    _, _, _, seen, approvals, promotions = approved_campaign
    assert seen[0] == 0
    row = approvals.loc[0]
    assert row["decision"] == "rejected" and row["reviewer"] == "bob" and row["reason"] == "too risky"
    assert "(evertrain CLI)" in row["answered_from"] and row["reviewer_key_id"].startswith("key_")
    from evertrain.approval import evidence_digest

    assert row["evidence_sha256"] == evidence_digest(row["evidence"])
    decision = promotions.loc[0]
    assert not decision["promoted"] and "rejected by bob: too risky" in decision["reason"]
    assert promotions.loc[1, "champion_version"] == 1


def test_approval_form_renders_in_chromium(approved_campaign, tmp_path):
    """The form's description, as the Prefect server holds it for the paused run, rendered in headless Chromium.

    The Prefect test server runs without its UI (PREFECT_UI_ENABLED=0), so this renders the same Markdown as
    `evertrain approve --html` writes it (CommonMark with tables), not the Prefect UI's own page."""
    import shutil
    import subprocess

    from PIL import Image

    from evertrain.approval import approval_page

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    _, _, _, seen, approvals, _ = approved_campaign
    page = seen["page"]
    assert seen["html"] == 0 and page.read_text() == approval_page(approvals.loc[2, "evidence"])
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "approval.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    assert Image.open(shot).size == (1200, 1600)
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count("<table>") >= 3  # the gate's numbers, per environment, the completions
    assert "<td>digits</td>" in dom and "<th>95% interval</th>" in dom
    assert "<th>challenger v" in dom and "<th>champion v1</th>" in dom


def test_promote_outside_a_flow_refuses_clearly(approved_campaign):
    """Run last: it leaves iteration 2's promote stage marked failed."""
    from evertrain.approval import ApprovalError
    from evertrain.tasks import STAGE_FUNCTIONS, run_stage

    _, rt, _, _, _, promotions = approved_campaign
    champion = rt.champion_version()  # rerun of iteration 2: the same record, so the same (passed) gate
    with pytest.raises(ApprovalError, match=r"outside a Prefect flow.*evertrain approve"):
        run_stage(rt, "promote", 2, STAGE_FUNCTIONS["promote"])
    assert rt.champion_version() == champion == promotions.loc[2, "challenger_version"]
    assert rt.store.query("SELECT decision FROM approvals WHERE iteration = 2")["decision"].tolist() == ["approved"]


def test_an_answer_without_the_right_key_is_refused_and_recorded(approved_campaign):
    """Issue 45: an approval carries an authenticated identity. mallory's key (infer, feedback) answered iteration
    0 first: refused and recorded, and the decision waited for bob's key."""
    _, rt, _, seen, approvals, _ = approved_campaign
    assert seen["mallory"][1] == 0  # the CLI delivered it: the stage, which holds the store, refused it
    attempts = rt.store.query("SELECT * FROM approval_attempts WHERE iteration = 0 ORDER BY happened_at")
    assert attempts["outcome"].tolist() == ["refused", "accepted"], attempts
    assert attempts["key_name"].tolist() == ["mallory", "bob"]
    assert "lacks the scope 'approve'" in attempts["why"].iloc[0]
    assert approvals.loc[0, "reviewer"] == "bob"
    assert rt.store.scalar("SELECT count(*) FROM approval_attempts WHERE iteration = 2 AND outcome = 'accepted' "
                           "AND key_name = 'ann'") == 1


def test_the_cli_needs_a_key(approved_campaign, monkeypatch, capsys):
    from evertrain.cli import main

    config = approved_campaign[0]
    monkeypatch.delenv("EVERTRAIN_API_KEY", raising=False)
    assert main(["approve", "--campaign", config.name]) == 2
    assert "'approve' scope" in capsys.readouterr().err
