"""The campaign context: what every stage of a campaign shares: config, store, tracker, environments, models.

A :class:`Runtime` is opened explicitly (``with Runtime.open(config) as rt:``) by whoever runs stages: the
campaign flow opens one and passes it to every stage task and to its iteration subflows, the CLI and the
notebooks open their own. It owns what it opened (the store connection and the campaign's writer claim)
and closes it in :meth:`Runtime.close`; nothing is cached per process, so two contexts never share a
connection by accident and a closed campaign leaves no file open behind it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from evertrain.config import CampaignConfig
from evertrain.data.store import Store, StoreError, now, to_json
from evertrain.envs import registry
from evertrain.envs.base import Environment, Problem, Verdict
from evertrain.envs.quality import SELFTEST_VERSION, validate
from evertrain.inference.campaign import Inference
from evertrain.inference.vllm_sampler import Engines
from evertrain.models.checkpoint import resolve_base, write_base_checkpoint
from evertrain.models.precision import set_threads
from evertrain.portable import portable, resolve_under
from evertrain.quiet import quiet_libraries
from evertrain.scoring import verify_many
from evertrain.tracking import Tracker


class EnvironmentInvalid(RuntimeError):
    """An environment whose grader failed validation: training on it would reward the wrong thing."""


def seed_for(*parts: Any) -> int:
    """A deterministic 31-bit seed from any parts (campaign seed, iteration, environment ...)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Runtime:
    """A campaign's context. ``Runtime.open(config)`` opens (and owns) a store connection; constructed
    directly from a store, it only borrows it (the endpoint's, which the endpoint closes). It holds the campaign's
    one :class:`~evertrain.inference.campaign.Inference` (``rt.inference``), which stops what it started when the
    context closes; vLLM engines lent to it (``engines=``) are left running."""

    # A plain class, not a dataclass: Prefect records a subflow's parameters with FastAPI's jsonable_encoder,
    # which deep-copies a dataclass whole; this one's encoding fails at its store connection, and Prefect
    # records the parameter as "<Runtime>", as it does for any parameter it cannot encode.

    def __init__(self, config: CampaignConfig, store: Store, tracker: Tracker,
                 envs: dict[str, Environment] | None = None, *, owns_store: bool = False,
                 engines: Engines | None = None) -> None:
        self.config = config
        self.store = store
        self.tracker = tracker
        self.envs: dict[str, Environment] = {} if envs is None else envs
        self._base_model: str | None = None
        self._owns_store = owns_store
        self._closed = False
        # every way the campaign samples (in this process, on vLLM engines, on Ray workers), started on first use
        self.inference = Inference(config, self.env, engines=engines)
        self._graders: Any = None  # evertrain.cluster.Graders, started on first use (cluster.address not "none")
        self._lock = threading.Lock()  # stages of two iterations may run at once (update.mode = "async")
        # what this context has already written or found (it holds the campaign's claim: no other process writes
        # the campaign meanwhile), so each stage does not pay a store call for it again
        self.recorded_config: str | None = None  # the config JSON last written to ``campaigns``
        self._started = False  # the campaign has its state row (ensure_started's work is done)

    @classmethod
    def open(cls, config: CampaignConfig, *, engines: Engines | None = None) -> Runtime:
        """Open ``config``'s campaign: a writable store connection, claimed as the campaign's one writer.

        Close it (or use it as a context manager) when done: until then no other process may run the
        campaign, and a DuckDB-file store stays locked. ``engines``: vLLM engines to sample on, borrowed (the
        context never stops them; their lender does): an engine is keyed by model and settings and knows weights
        by content, so contexts may share one and each is spared an engine start (minutes on a small CPU).
        """
        quiet_libraries()
        set_threads(config.torch_threads)
        store = Store(config.paths.store)
        try:
            # one writer per campaign: many processes may share a DuckLake store, one run may write a campaign
            store.claim(config.name)
        except BaseException:
            store.close()
            raise
        return cls(config=config, store=store, tracker=Tracker(config), owns_store=True, engines=engines)

    @property
    def graders(self) -> Any:
        """The campaign's grading on its Ray cluster (``evertrain.cluster.Graders``), connected on first use; None
        when ``cluster.address = "none"``."""
        with self._lock:
            if self._graders is None and self.config.cluster.enabled:
                self._check_open()
                # late on purpose: importing Ray costs about 2 CPU-seconds, paid only by a campaign on a cluster
                from evertrain.cluster import open_graders

                self._graders = open_graders(self.config)
            return self._graders

    def grade(self, items: list[tuple[str, Problem, str]], progress: Any = None,
              ) -> tuple[list[Verdict], dict[str, float]]:
        """Verdicts for (environment name, problem, completion) items, in order: in this process, or in Ray tasks
        on the campaign's cluster; and the cluster's grading metrics (empty in this process)."""
        graders = self.graders
        if graders is None:
            return verify_many([(self.env(env), problem, text) for env, problem, text in items], progress=progress), {}
        verdicts = graders.verify_many(items, progress=progress)
        return verdicts, dict(graders.last)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the context of campaign {self.campaign!r} is closed: open another (Runtime.open)")

    def close(self) -> None:
        """Close what this context opened: what its inference started (Ray workers, vLLM engines but lent ones),
        and its store connection (which releases its campaign claim)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.inference.close()
        finally:
            for env in self.envs.values():  # what the environments started: rubric workers, environment servers
                with contextlib.suppress(Exception):
                    env.close()
            self._graders = None
            if self._owns_store:
                self.store.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Runtime(campaign={self.campaign!r}, store={self.store.location.describe()!r}, closed={self._closed})"

    @property
    def campaign(self) -> str:
        return self.config.name

    def env(self, name: str) -> Environment:
        if name not in self.envs:
            spec = next((s for s in self.config.environments if s.name == name), None)
            self.envs[name] = registry.get(name, **(spec.options if spec else {}))
        return self.envs[name]

    @property
    def base_model(self) -> str:
        if self._base_model is None:
            self._base_model = resolve_base(self.config.model)
        return self._base_model

    def checkpoint_dir(self, iteration: int) -> Path:
        return Path(self.config.paths.checkpoints).resolve() / self.campaign / f"iteration-{iteration}"

    def checkpoints_root(self) -> Path:
        return Path(self.config.paths.checkpoints).resolve()

    def stored_path(self, checkpoint: Path) -> str:
        """How ``model_versions.path`` names ``checkpoint``: relative to the checkpoints folder, so the
        state can be moved or copied elsewhere and still resolve."""
        return portable(checkpoint, self.checkpoints_root())

    def checkpoint(self, version: int) -> Path:
        """A local folder holding model version ``version`` (the working copy, else MLflow's artifacts)."""
        row = self.store.model_version(self.campaign, version)
        stored = row["path"] if isinstance(row["path"], str) else ""
        path = resolve_under(stored, self.checkpoints_root()) if stored else None
        if path is not None and path.exists():
            return path
        return self.tracker.download(version)

    def trainee_version(self) -> int:
        state = self.store.campaign_state(self.campaign)
        if state is None or state["trainee_version"] is None:
            raise StoreError(f"campaign {self.campaign!r} has no trainee yet: run its first iteration")
        return int(state["trainee_version"])

    def base_version(self) -> int:
        """The campaign's base model version (registered by its first iteration)."""
        version = self.store.base_version(self.campaign)
        if version is None:
            raise StoreError(f"campaign {self.campaign!r} has no base model version yet: run its first iteration")
        return version

    def champion_version(self) -> int:
        """The campaign's champion, as the store's lineage events say (its last promotion decision or rollback,
        else its base model). MLflow's ``champion`` alias is only their projection (Tracker.project_lineage): a
        stale or missing alias does not change the answer."""
        version, _ = self.store.champion_history(self.campaign)
        if version is None:
            raise StoreError(f"campaign {self.campaign!r} has no champion yet: run its first iteration")
        return version

    def previous_champion_version(self) -> int | None:
        """The last different champion before the current one, from the store's lineage events (None: none yet)."""
        return self.store.champion_history(self.campaign)[1]

    def validate_environments(self) -> None:
        """Validate every environment of the campaign once (the verdict is kept in ``env_validations``).

        An environment earns trust only if references earn 1, empty, trivial and known-hack completions
        earn 0, and verdicts are stable; a campaign refuses to train on one that fails.
        """
        for spec in self.config.environments:
            # the self-test's version is part of the key: a cached verdict of an older battery (or of
            # verifiers since fixed) is not trusted, the environment is tested again
            options = json.dumps({**spec.options, "selftest_version": SELFTEST_VERSION}, sort_keys=True)
            known = self.store.env_validation(spec.name, options)
            if known.empty:
                report = validate(self.env(spec.name), problems=1, seed=self.config.seed)
                self.store.replace("env_validations", {"env": spec.name, "options": options}, [{
                    "env": spec.name, "options": options, "ok": report.ok, "checked": report.checked,
                    "failures": to_json(report.failures), "validated_at": now()}])
                if report.sandbox_runs:
                    self.store.append("sandbox_runs", [{**row, "campaign": self.campaign, "iteration": None}
                                                       for row in report.sandbox_runs])
                ok, failures = report.ok, report.failures
            else:
                ok, failures = bool(known["ok"].iloc[0]), json.loads(known["failures"].iloc[0])
            if not ok:
                raise EnvironmentInvalid(
                    f"environment {spec.name!r} failed validation (its verifier self-test: `evertrain envs "
                    f"--validate --env {spec.name}`), so the campaign will not train on it: " + "; ".join(failures[:5]))

    def ensure_started(self) -> None:
        """Register the base model as version 1 and first champion, and make it the trainee (once)."""
        if self._started:
            return
        if self.store.campaign_state(self.campaign) is not None:
            self._started = True
            return
        self.validate_environments()
        self.tracker.ensure_registered_model()
        existing = self.tracker.alias("champion")
        if existing is None:
            base_dir = write_base_checkpoint(self.checkpoint_dir(-1).with_name("base"), self.base_model)
            version = self.tracker.register(base_dir, run_id=None, iteration=None)
            path = self.stored_path(base_dir)
        else:  # the store was reset but MLflow remembers: keep MLflow's champion (no working copy: an
            # empty path makes checkpoint() fetch it from MLflow, wherever its artifacts are now)
            version, path = existing, ""
        self.store.record_version(self.campaign, version, -1, "base", path, None, replaces_iteration=False)
        self.tracker.project_lineage(self.store, self.campaign)  # the base is the first champion: MLflow's alias


