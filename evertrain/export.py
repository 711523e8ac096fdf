"""Take a model version out of evertrain: a plain Hugging Face folder, an MLflow ``transformers`` model, a card.

Registry versions are evertrain checkpoints (a LoRA adapter plus a manifest naming the base model) that
only :func:`evertrain.models.policy.load_policy` understands. ``export`` merges the adapter into the base
weights and writes what any transformers user expects (``model.safetensors``, ``config.json``,
``generation_config.json``, the tokenizer), then logs the same model with MLflow's ``transformers``
flavour (``mlflow models serve -m runs:/<run>/model`` serves it) and writes a model card with the
version's lineage: base model, campaign, iterations, environments and data, gate decisions, held-out
results with intervals, compute and dollars.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import mlflow
from evertrain.data.lineage import champion_vs_base
from evertrain.models import ModelError
from evertrain.models.checkpoint import hub_id, load_policy, read_manifest
from evertrain.report import SPLIT_LABELS
from evertrain.runtime import Runtime

# what the served model needs; listing it skips MLflow's requirement inference, which loads the model in a
# subprocess (a minute here) and still guesses
SERVE_REQUIREMENTS = ("torch", "transformers", "safetensors", "tokenizers", "accelerate")


class ExportError(ModelError):
    """A version that cannot be exported; the message says which and why (the CLI prints it, exit 2)."""


def export(rt: Runtime, out: Path, version: int | None = None, log_to_mlflow: bool = True) -> dict[str, Any]:
    """Export ``version`` (default: the champion) of ``rt``'s campaign to ``out``; returns what was written."""
    if version is None:
        version = rt.store.champion_history(rt.campaign)[0]  # the store's lineage, not MLflow's projection of it
        if version is None:
            raise ExportError(f"campaign {rt.campaign!r} has no champion yet: run an iteration first, "
                              "or pass --version")
    row = rt.store.model_version(rt.campaign, version)
    if str(row["kind"]).endswith("-deleted"):
        raise ExportError(f"v{version} of campaign {rt.campaign!r} was deleted by checkpoint retention "
                          "(retention.keep_challengers): nothing left to export")
    checkpoint = rt.checkpoint(version)
    manifest = read_manifest(checkpoint)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: export into a new folder")
    # float32 whatever the rollout precision: merging an adapter in bfloat16 loses its small updates
    model, tokenizer = load_policy(checkpoint, trainable=False, dtype=torch.float32, device="cpu")
    model.config.use_cache = True
    generation = model.generation_config
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    generation.save_pretrained(out)

    lineage = collect_lineage(rt, version, row, manifest)
    model_uri = None
    if log_to_mlflow:
        model_uri = _log_transformers_model(rt, model, tokenizer, version, lineage)
        lineage["mlflow_model_uri"] = model_uri
    (out / "README.md").write_text(model_card(lineage), encoding="utf-8")
    (out / "evertrain_lineage.json").write_text(json.dumps(lineage, indent=2, default=str), encoding="utf-8")
    return {"version": version, "out": str(out), "mlflow_model_uri": model_uri,
            "files": sorted(p.name for p in out.iterdir())}


def _log_transformers_model(rt: Runtime, model: Any, tokenizer: Any, version: int, lineage: dict[str, Any]) -> str:
    """Log the merged model in its own run of the campaign's experiment; returns ``runs:/<run>/model``."""
    with mlflow.start_run(experiment_id=rt.tracker.experiment_id, run_name=f"export-v{version}",
                          tags={"evertrain.campaign": rt.campaign, "evertrain.export_of": str(version)}) as run:
        mlflow.transformers.log_model(
            transformers_model={"model": model, "tokenizer": tokenizer}, name="model", task="text-generation",
            pip_requirements=list(SERVE_REQUIREMENTS), model_card=None,
            metadata={"evertrain_campaign": rt.campaign, "evertrain_version": version},
        )
        mlflow.log_text(model_card(lineage), "model_card.md")
        return f"runs:/{run.info.run_id}/model"


def collect_lineage(rt: Runtime, version: int, row: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """Where ``version`` came from, read from the store: the chain of versions back to the base model, the
    iterations and data that trained them, the gate's decisions, held-out results and what it all cost."""
    store, campaign = rt.store, rt.campaign
    chain = store.lineage(campaign, version)
    iterations = sorted(c["iteration"] for c in chain if c["iteration"] >= 0)
    last = max(iterations) if iterations else -1
    data = store.rollout_summary(campaign, last)
    gates = store.promotions_until(campaign, last)
    cost = store.cost_until(campaign, last)
    held_out = [r for r in champion_vs_base(store, campaign) if r["champion_version"] == version]
    return {
        "campaign": campaign, "version": version, "kind": row["kind"],
        "base_model": manifest.get("base_model"), "base_model_hub_id": hub_id(rt.config.model.path),
        "model_config": rt.config.model.path,
        "registered_model": rt.config.registered_model, "lineage": chain, "iterations": iterations,
        "environments": [{"name": s.name, "weight": s.weight, "options": s.options} for s in rt.config.environments],
        "data": data.to_dict("records"), "gates": gates.to_dict("records"), "held_out": held_out,
        "compute": {k: float(cost[k]) for k in ("wall_s", "cpu_s", "gpu_s", "dollars")},
        "config": rt.config.model_dump(mode="json"),
    }


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def model_card(lineage: dict[str, Any]) -> str:
    """A Hugging Face model card (README.md with YAML front matter) for an exported version."""
    hub = lineage.get("base_model_hub_id")
    # the Hub reads `base_model` as a Hub id: a local path there would be a broken link, so none is written
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- evertrain", "- grpo",
        *([f"base_model: {hub}"] if hub else []), "---", "",
        f"# {lineage['registered_model']} v{lineage['version']}", "",
        f"Exported by evertrain from campaign `{lineage['campaign']}`: model version {lineage['version']} "
        f"({lineage['kind']}), with any LoRA adapter merged into the weights. Load it with "
        "`AutoModelForCausalLM.from_pretrained(<this folder>)`.", "",
        "## Lineage", "",
        f"- base model: `{hub or lineage['base_model']}` (config `model.path = {lineage['model_config']}`"
        + (f", loaded from `{lineage['base_model']}`)" if hub and hub != lineage["base_model"] else ")"),
        "- versions, newest first: " + " <- ".join(f"v{c['version']} (iteration {c['iteration']}, {c['kind']})"
                                                   for c in lineage["lineage"]),
        f"- iterations trained: {', '.join(map(str, lineage['iterations'])) or 'none (the base model)'}",
    ]
    if lineage.get("mlflow_model_uri"):
        lines.append(f"- MLflow model: `{lineage['mlflow_model_uri']}` (`mlflow models serve -m <uri> "
                     "--env-manager local` serves it)")
    lines += ["", "## Environments and data", "", "| environment | weight | options |", "| --- | --- | --- |"]
    lines += [f"| {e['name']} | {e['weight']:g} | `{json.dumps(e['options'])}` |" for e in lineage["environments"]]
    lines += ["", "Rollouts up to the version's last iteration:", "",
              "| environment | problems | rollouts | mean reward |", "| --- | --- | --- | --- |"]
    lines += [f"| {d['env']} | {d['problems']} | {d['rollouts']} | {_fmt(d['mean_reward'])} |" for d in lineage["data"]]
    lines += ["", "## Gate decisions", "",
              "| iteration | challenger | champion | promoted | challenger pass@1 | champion pass@1 "
              "| gain 95% CI | reason |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in lineage["gates"]:
        lines.append(f"| {g['iteration']} | v{g['challenger_version']} | v{g['champion_version']} | "
                     f"{'yes' if g['promoted'] else 'no'} | {_fmt(g['challenger_pass1'])} | "
                     f"{_fmt(g['champion_pass1'])} | "
                     f"[{_fmt(g['gain_low'], '+.3f')}, {_fmt(g['gain_high'], '+.3f')}] | {g['reason']} |")
    lines += ["", "## Held-out results", ""]
    if lineage["held_out"]:
        # one row per environment and split, the numbers `evertrain report` prints for the same comparison
        lines += ["Greedy pass@1 on held-out problems, against the base model on the same problems "
                  "(95% paired bootstrap interval of the gain). Splits: " + "; ".join(
                      f"`{split}`: the {label}" for split, label in SPLIT_LABELS.items()
                      if any(h.get("split", "gate") == split for h in lineage["held_out"])) + ".", "",
                  "| environment | split | problems | base pass@1 | this version | gain | 95% CI |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {h['env']} | {h.get('split', 'gate')} | {h['problems']} | {_fmt(h['base_pass1'])} | "
                  f"{_fmt(h['champion_pass1'])} | {_fmt(h['gain'], '+.3f')} | "
                  f"[{_fmt(h['gain_low'], '+.3f')}, {_fmt(h['gain_high'], '+.3f')}] |"
                  for h in lineage["held_out"]]
    else:
        lines.append("Not measured against the base model: this version is not the campaign's current champion "
                     "(or the campaign has no held-out evaluation yet).")
    c = lineage["compute"]
    lines += ["", "## Compute and cost", "",
              f"Every stage of iterations {', '.join(map(str, lineage['iterations'])) or '-'} and those before "
              f"them: {c['wall_s']:.0f} s wall, {c['cpu_s']:.0f} CPU-s, {c['gpu_s']:.0f} GPU-s, "
              f"${c['dollars']:.4f} at the campaign's prices.", ""]
    return "\n".join(lines)
