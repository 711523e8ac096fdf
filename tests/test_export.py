"""`evertrain export`: a trained version leaves evertrain as a plain Hugging Face folder that transformers loads
and generates with, an MLflow transformers model that `mlflow models serve` answers with, and a model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from evertrain.processes import free_port
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, STAGES, run_stage
from tests.conftest import smoke_config_in


@pytest.fixture(scope="module")
def exported(tmp_path_factory, models_dir):
    from evertrain.export import export

    directory = tmp_path_factory.mktemp("export")
    config = smoke_config_in(directory, models_dir, name="export", problems_per_iteration=4, group_size=4,
                             environments=[{"name": "digits", "weight": 1}])
    rt = Runtime.open(config)
    for stage in STAGES:
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    out = directory / "exported"
    result = export(rt, out, version=2)
    yield rt, out, result
    rt.close()


def test_export_loads_with_plain_transformers_and_generates(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evertrain.models.checkpoint import load_policy

    rt, out, result = exported
    assert result["version"] == 2
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "README.md"} <= set(result["files"])
    assert not list(out.glob("adapter_*")), "the LoRA adapter must be merged, not shipped beside the base"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    # the exported weights are version 2's, adapter merged: same logits as evertrain's own loader
    reference, _ = load_policy(rt.checkpoint(2), trainable=False, device="cpu")
    base, _ = load_policy(rt.checkpoint(1), trainable=False, device="cpu")
    with torch.no_grad():
        logits = model(**ids).logits
        torch.testing.assert_close(logits, reference(**ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(logits, base(**ids).logits), "export wrote the base model, not version 2"


def test_model_card_has_lineage(exported):
    _, out, _ = exported
    card = (out / "README.md").read_text()
    lineage = json.loads((out / "evertrain_lineage.json").read_text())
    assert card.startswith("---\nlibrary_name: transformers")
    assert [link["version"] for link in lineage["lineage"]] == [2, 1]
    assert lineage["iterations"] == [0] and lineage["environments"][0]["name"] == "digits"
    assert lineage["data"][0]["rollouts"] == 4 * 4
    assert len(lineage["gates"]) == 1 and lineage["gates"][0]["challenger_version"] == 2
    assert lineage["compute"]["cpu_s"] > 0 and lineage["compute"]["dollars"] > 0
    for heading in ("## Lineage", "## Environments and data", "## Gate decisions", "## Held-out results",
                    "## Compute and cost"):
        assert heading in card
    assert "v2 (iteration 0, lora) <- v1 (iteration -1, base)" in card
    assert lineage["gates"][0]["reason"] in card


def test_model_card_names_the_base_model_by_its_hub_id(exported, tmp_path):
    from evertrain.export import model_card
    from evertrain.models.checkpoint import hub_id

    _, out, _ = exported
    lineage = json.loads((out / "evertrain_lineage.json").read_text())
    assert lineage["base_model_hub_id"] is None  # the tests' tiny model is built, not from the Hub
    assert "base_model:" not in (out / "README.md").read_text().split("---")[1], "a local path is no Hub id"
    local = "/somewhere/models/SmolLM2-135M-Instruct"
    card = model_card({**lineage, "base_model": local, "model_config": "embedded:smollm2-135m-instruct",
                       "base_model_hub_id": hub_id("embedded:smollm2-135m-instruct")})
    assert "\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n" in card.split("---\n# ")[0]
    assert f"loaded from `{local}`" in card
    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    assert hub_id(str(tmp_path / "local")) == "Qwen/Qwen2.5-0.5B"
    assert hub_id(str(tmp_path)) is None and hub_id("embedded:tiny") is None


def test_mlflow_serves_the_exported_model(exported, tmp_path):
    rt, _, result = exported
    uri = result["mlflow_model_uri"]
    assert uri and uri.startswith("runs:/")
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # mlflow starts `uvicorn` from PATH, as an activated venv has it
    env = {**os.environ, "MLFLOW_TRACKING_URI": rt.config.paths.mlflow_uri,
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", uri, "--env-manager", "local",
         "--host", "127.0.0.1", "-p", str(port), "-w", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow models serve did not come up in 240 s"
            time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"inputs": ["What is 2 + 3?"], "params": {"max_new_tokens": 8}}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert response.status == 200
        predictions = answer["predictions"]
        assert len(predictions) == 1 and isinstance(predictions[0], str) and predictions[0]
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_model_card_held_out_rows_are_the_report_s(exported, tmp_path):
    """The card's held-out table is the report's champion-vs-base comparison, one row per environment and split,
    with the same pass@1, gain and interval (it used to list the gate's and the sealed splits' rows unnamed)."""
    from evertrain.data.lineage import champion_vs_base
    from evertrain.export import export

    rt = exported[0]
    rows = champion_vs_base(rt.store, "export")
    assert rows and all(row["split"] for row in rows), rows
    champion = rows[0]["champion_version"]
    export(rt, tmp_path / "champion", version=champion, log_to_mlflow=False)
    card = (tmp_path / "champion" / "README.md").read_text()
    for row in rows:
        line = (f"| {row['env']} | {row['split']} | {row['problems']} | {row['base_pass1']:.3f} | "
                f"{row['champion_pass1']:.3f} | {row['gain']:+.3f} | "
                f"[{row['gain_low']:+.3f}, {row['gain_high']:+.3f}] |")
        assert line in card, (line, card)
