"""MLflow: one experiment per campaign, one run per iteration, one registered model per campaign.

The registry's ``champion`` and ``previous_champion`` aliases are a projection of the store's lineage (the
store records each decision and rollback in one transaction; :meth:`Tracker.project_lineage` moves the aliases
to match, and repairs them when run again); ``challenger`` names the last registered update. Model versions
point at checkpoint folders logged as run artifacts, so ``models:/evertrain-<campaign>@champion`` always
resolves to something :func:`load_policy` can load.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

import mlflow
from evertrain.config import CampaignConfig
from evertrain.data.lineage import aliases
from evertrain.portable import rebase_mlflow_artifacts
from mlflow import MlflowClient

ITERATION_TAG = "evertrain.iteration"
CAMPAIGN_RUN_TAG = "evertrain.campaign_run"
# MLflow 3's UI opens an experiment on its GenAI view unless the experiment says what kind it is
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


class Tracker:
    """The campaign's view of MLflow, through one ``MlflowClient`` (no global active-run state)."""

    def __init__(self, config: CampaignConfig) -> None:
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        uri = config.paths.mlflow_uri
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(uri)
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.config = config
        self.model_name = config.registered_model
        self.artifact_root = Path(config.paths.artifacts).resolve() / config.name
        self.remote = uri.startswith(("http://", "https://"))
        experiment = self.client.get_experiment_by_name(config.experiment)
        if experiment is None:
            self.artifact_root.mkdir(parents=True, exist_ok=True)
            # a tracking server stores artifacts at its own --artifacts-destination (mlflow-artifacts:/)
            self.experiment_id = self.client.create_experiment(
                config.experiment, artifact_location=None if self.remote else self.artifact_root.as_uri(),
                tags={"evertrain.campaign": config.name},
            )
        else:
            self.experiment_id = experiment.experiment_id
            self._follow_moved_artifacts(experiment.artifact_location)
        if experiment is None or EXPERIMENT_KIND[0] not in experiment.tags:
            self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
        self._campaign_run: str | None = None

    def _follow_moved_artifacts(self, recorded: str) -> None:
        """Point MLflow at this campaign's artifacts where they are now, if the state folder was moved or copied.

        MLflow stores artifact locations as absolute URIs whatever it is given; after ``data/``, ``mlflow/``
        and ``state/`` are copied elsewhere they would still name the old folder (and new versions would be
        written there). Only a SQLite backend is rewritten, and only when the artifacts exist at the new root.
        """
        current = self.artifact_root.as_uri()
        uri = self.config.paths.mlflow_uri
        if recorded.rstrip("/") == current or not uri.startswith("sqlite:///") or not self.artifact_root.exists():
            return
        rebase_mlflow_artifacts(Path(uri.removeprefix("sqlite:///")), recorded, current)

    # --- runs ------------------------------------------------------------------------------------
    def campaign_run(self) -> str:
        """The campaign's one MLflow run (created on first use): every stage metric is logged to it with the
        iteration as its step, so MLflow's charts draw each metric over the campaign's iterations. The
        iteration runs are its nested runs (checkpoints, rollout tables, tags)."""
        if self._campaign_run is None:
            runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{CAMPAIGN_RUN_TAG}` = 'true'",
                                           order_by=["attributes.start_time ASC"], max_results=1)
            if runs:
                self._campaign_run = runs[0].info.run_id
            else:
                run = self.client.create_run(self.experiment_id, run_name=f"campaign-{self.config.name}",
                                             tags={CAMPAIGN_RUN_TAG: "true", "evertrain.campaign": self.config.name})
                self._campaign_run = run.info.run_id
                self.client.log_dict(self._campaign_run, self.config.model_dump(mode="json"), "config.json")
                # a campaign never ends: its run is not left RUNNING forever (MLflow takes metrics on a finished run)
                self.client.set_terminated(self._campaign_run, status="FINISHED")
        return self._campaign_run

    def log_iteration_metrics(self, run_id: str, metrics: dict[str, Any], iteration: int) -> None:
        """``metrics`` of ``iteration`` on its own run and on the campaign's run, step = the iteration."""
        self.log_metrics(run_id, metrics, step=iteration)
        self.log_metrics(self.campaign_run(), metrics, step=iteration)

    def iteration_run(self, iteration: int, flow_run_id: str | None = None) -> tuple[str, str | None]:
        """The MLflow run of ``iteration`` (created on first use, continued after) and its previous status."""
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{ITERATION_TAG}` = '{iteration}'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )
        previous = None
        if runs:
            run_id, previous = runs[0].info.run_id, runs[0].info.status
            if previous != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                self.experiment_id, run_name=f"iteration-{iteration}",
                tags={ITERATION_TAG: str(iteration), "evertrain.campaign": self.config.name,
                      "mlflow.parentRunId": self.campaign_run()},
            )
            run_id = run.info.run_id
            self.client.log_dict(run_id, self.config.model_dump(mode="json"), "config.json")
        if flow_run_id:
            self.client.set_tag(run_id, "prefect.flow_run_id", flow_run_id)
        return run_id, previous

    def run_id(self, iteration: int) -> str:
        """The run of ``iteration`` without changing its status (it must exist)."""
        runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{ITERATION_TAG}` = '{iteration}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise LookupError(f"no MLflow run for iteration {iteration}")
        return runs[0].info.run_id

    def finish_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int) -> None:
        stamp = int(time.time() * 1000)
        batch = [Metric(key, float(value), stamp, step) for key, value in metrics.items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool)]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_rollouts(self, run_id: str, iteration: int, rows: list[dict[str, Any]]) -> str:
        """A sample of the iteration's scored rollouts as an MLflow table (the run's Artifacts tab and
        ``mlflow.load_table``): prompt, turns, completion, reward and the grader's reason."""
        frame = pd.DataFrame([{
            "env": r["env"], "problem_id": r["problem_id"], "sample": int(r["sample"]),
            "policy_version": int(r["policy_version"]), "prompt": r["prompt_text"],
            "turns": json.dumps(r["turns"], default=str), "completion": r["completion"], "reward": r["reward"],
            "passed": r["passed"], "reason": r["reason"], "finish_reason": r["finish_reason"]} for r in rows])
        artifact = f"rollouts/iteration-{iteration}.json"
        self.client.log_table(run_id, data=frame, artifact_file=artifact)
        return artifact

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, key, str(value))

    # --- registry ----------------------------------------------------------------------------------
    def ensure_registered_model(self) -> None:
        try:
            self.client.get_registered_model(self.model_name)
        except MlflowException:
            self.client.create_registered_model(
                self.model_name, tags={"evertrain.campaign": self.config.name},
                description=f"Policy versions of evertrain campaign {self.config.name!r}.",
            )

    def register(self, checkpoint: Path, run_id: str | None, iteration: int | None,
                 exclude: tuple[str, ...] = ()) -> int:
        """Log ``checkpoint`` as artifacts and register it as a new model version; returns the version.

        The optimizer state (``optimizer.pt``) travels with the weights, so a version downloaded from
        MLflow on another machine continues training with its AdamW moments instead of fresh ones.
        """
        self.ensure_registered_model()
        name = f"iteration-{iteration}" if iteration is not None else "base"
        if run_id is None and self.remote:
            # a tracking server accepts no local path as a version's source: the base model's files go
            # through the server too, as the artifacts of a run of their own
            run_id = self.client.create_run(self.experiment_id, run_name="base-model",
                                            tags={"evertrain.base": "true"}).info.run_id
            self.client.set_terminated(run_id, "FINISHED")
        if run_id is not None:
            staging = checkpoint.with_name(checkpoint.name + ".mlflow")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(checkpoint, staging, ignore=shutil.ignore_patterns(*exclude))
            self.client.log_artifacts(run_id, str(staging), "checkpoint")
            shutil.rmtree(staging)
            source = f"{self.client.get_run(run_id).info.artifact_uri}/checkpoint"
        else:
            target = self.artifact_root / "registry" / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(checkpoint, target, ignore=shutil.ignore_patterns(*exclude))
            source = target.as_uri()
        tags = {"evertrain.iteration": str(iteration)} if iteration is not None else {"evertrain.base": "true"}
        version = self.client.create_model_version(self.model_name, source=source, run_id=run_id, tags=tags)
        return int(version.version)

    def alias(self, alias: str) -> int | None:
        try:
            return int(self.client.get_model_version_by_alias(self.model_name, alias).version)
        except MlflowException:
            return None

    def set_alias(self, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(self.model_name, alias, str(version))

    def project_lineage(self, store: Any, campaign: str) -> dict[str, int | None]:
        """Point the ``champion``, ``previous_champion`` and ``challenger`` aliases where the store's lineage says
        (the store is the authority: versions registered, promotion decisions and rollbacks, each one transaction;
        these aliases are its projection for MLflow's users, ``models:/...@champion``). Idempotent: run again, it
        repairs an alias a crash between the store's commit and this call left behind. Returns the aliases as the
        store has them."""
        wanted = aliases(store, campaign)
        for alias, version in wanted.items():
            if version is not None and self.alias(alias) != version:
                self.set_alias(alias, version)
        return wanted

    def versions_of(self, iteration: int) -> list[int]:
        """Model versions registered by the update of ``iteration`` (a rerun or a crash may leave several)."""
        self.ensure_registered_model()
        found = self.client.search_model_versions(
            f"name = '{self.model_name}' and tags.`evertrain.iteration` = '{iteration}'")
        return sorted(int(v.version) for v in found)

    def delete_version(self, version: int) -> None:
        self.client.delete_model_version(self.model_name, str(version))

    def download(self, version: int) -> Path:
        source = self.client.get_model_version(self.model_name, str(version)).source
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=source))
