"""The endpoint: OpenAI-compatible chat completions from the campaign's champion, hot-swapped on promotion.

``POST /v1/chat/completions`` and ``GET /v1/models`` speak the OpenAI wire format, so the official
``openai`` client (and anything built on it) works unchanged; ``POST /feedback`` takes a client's verdict
on an answer; ``GET /health`` says which version is served. Every route but ``/health`` needs an API key with
its scope (``serving.auth = "keys"``, the default: :mod:`evertrain.serving.auth`, ``evertrain keys``).

The champion
    :class:`Champion` holds one reference to the served model (:class:`Served`: version, sampler,
    tokenizer). A watcher thread reads the campaign's champion from the store's lineage (its promotion
    decisions and rollbacks, the authority; MLflow's ``champion`` alias is their projection) every
    ``serving.poll_seconds``; when it moves (a promotion, a rollback), the new version's weights are loaded
    in that thread, off the request path, and the reference is replaced in one assignment. A request reads
    the reference once, when it starts, and uses that model for everything it does: no request is answered
    by two versions, none waits for a load, none fails because of one. The last two versions stay loaded, so a rollback
    swaps back without loading anything.

Tool calls
    The model writes calls in the project's format (``<python>17 * 23</python>``, see
    :mod:`evertrain.envs.tools`); the endpoint returns them as OpenAI ``tool_calls`` (function ``python``,
    arguments ``{"input": "17 * 23"}``) and turns the client's ``tool_calls`` and ``role: tool`` messages back
    into that format. Tools run at the client: the tool belongs to the deployment the model acts in (its
    interface may change under the model, which is what the loop must learn from), and a server that runs
    no tool runs no untrusted code beside the weights.

Traces
    Every request, the bad ones included, becomes one row of ``traces`` (redacted first, written in
    batches by :class:`~evertrain.serving.traces.TraceWriter`). When the client names the task (the extra
    body field ``evertrain: {"env": ..., "problem": {...}}``), the final answer is graded by that
    environment's verifier in the background and the verdict stored in ``trace_feedback``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request  # FastAPI resolves the handlers' (string) annotations here
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from evertrain.config import CampaignConfig
from evertrain.data.lineage import live_pass_rate_over_time, live_pass_rates
from evertrain.data.store import Store, now, to_json
from evertrain.envs import registry
from evertrain.envs.base import Environment, Problem, ToolResult
from evertrain.envs.registry import UnknownEnvironment
from evertrain.envs.tools import format_tool_result, parse_tool_call, stop_strings
from evertrain.plots import live_pass_rate_figure
from evertrain.portable import resolve_under
from evertrain.serving import auth, guard
from evertrain.serving.batching import Batcher, Job
from evertrain.serving.connections import ConnectionStats, guarded_protocol
from evertrain.serving.quota import InFlight, Quotas
from evertrain.serving.redact import Redactor
from evertrain.serving.traces import TraceWriter, feedback_row, request_cost

log = logging.getLogger("evertrain.serving")
GRACEFUL_STOP_S = 30  # a stop signal's wait for running requests (uvicorn's timeout_graceful_shutdown)

MODEL_HEADER = "x-evertrain-model-version"
TRACE_HEADER = "x-evertrain-trace-id"
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 8
MAX_JSON_DEPTH = 64  # nesting a request body may have (a chat request needs about 8; tool schemas a few more)
RETRY_MAX_SECONDS = 300.0  # the longest a champion whose load failed waits before it is tried again


class ApiError(Exception):
    """A request the endpoint refuses, answered with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, code: str, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Served:
    """One loaded model version: what a request uses from its start to its end."""

    version: int
    name: str  # "<campaign>@v<version>": the response's ``model`` field and header
    sampler: Any
    tokenizer: Any
    on_gpu: bool
    loaded_at: float = field(default_factory=time.time)


class Champion:
    """The served version, swapped by a watcher thread when the store's champion moves."""

    def __init__(self, config: CampaignConfig, store: Store, keep_loaded: int = 2) -> None:
        # late: torch and MLflow (the model, the tracker): the endpoint's HTTP layer and its tests import this module
        # without them
        from evertrain.runtime import Runtime
        from evertrain.tracking import Tracker

        self.config = config
        self.tracker = Tracker(config)
        # no campaign claim: the endpoint only reads the campaign's state, beside the process that trains it
        self.rt = Runtime(config=config, store=store, tracker=self.tracker)
        self.keep_loaded = keep_loaded
        self._loaded: OrderedDict[int, Served] = OrderedDict()
        self.current: Served | None = None
        self.swaps: list[dict[str, Any]] = []
        self.last_error: str | None = None
        # versions whose load failed: {version: {digest, delay, next_try, attempts, error}}
        self.failed: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Served:
        """Load the champion now (so a bad config fails at start-up) and start watching the store's lineage."""
        version = self._champion_version()
        self.current = self._load(version)
        self._thread = threading.Thread(target=self._watch, name="evertrain-champion-watcher", daemon=True)
        self._thread.start()
        return self.current

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.rt.inference.close()  # what it started to serve (vLLM's own servers, for generation.backend = "vllm")

    def _champion_version(self) -> int:
        """The store's champion (a stale or hand-moved MLflow alias does not move what is served)."""
        return self.rt.champion_version()

    def _load(self, version: int) -> Served:
        if version in self._loaded:
            self._loaded.move_to_end(version)
            return self._loaded[version]
        # late: torch (the model files); the endpoint's HTTP layer imports this module without it
        from evertrain.models.precision import resolve_device

        # the campaign's inference serves it: on the backend's own servers where it has them (vLLM's OpenAI server)
        sampler, seconds = self.rt.inference.serve(version, self.rt.checkpoint(version), self.rt.base_model)
        served = Served(version=version, name=f"{self.config.name}@v{version}", sampler=sampler,
                        tokenizer=sampler.tokenizer, on_gpu=resolve_device(self.config.model.device).type == "cuda")
        self._loaded[version] = served
        while len(self._loaded) > self.keep_loaded:
            evicted, _ = self._loaded.popitem(last=False)  # requests still holding it keep it alive until they end
            self.rt.inference.unserve(evicted)
        log.info("endpoint: loaded %s in %.2f s", served.name, seconds)
        return served

    def _watch(self) -> None:
        # the store's snapshot when a poll last found the champion served: while no commit moves it, the champion
        # cannot have moved, and the poll costs one catalog read instead of the champion query (an idle endpoint
        # polls forever). A champion that failed to load is never "served", so its retries are not skipped.
        settled: int | None = None
        while not self._stop.wait(self.config.serving.poll_seconds):
            try:
                snapshot = self.rt.store.snapshot_id()
                if snapshot is not None and snapshot == settled:
                    continue
                version = self._champion_version()
            except Exception as error:  # a registry hiccup: keep serving what is loaded, ask again next poll
                self.last_error = f"{type(error).__name__}: {error}"
                log.warning("endpoint: champion watcher: %s", self.last_error)
                continue
            current = self.current
            if current is not None and version == current.version:
                settled = snapshot
                continue
            digest = self._digest(version)
            if not self._due(version, digest):
                continue
            began = time.perf_counter()
            try:
                served = self._load(version)
            except Exception as error:  # a bad checkpoint: keep serving the current champion
                self._failed_load(version, digest, error)
                continue
            self.current = served  # one reference assignment: atomic, requests already running keep theirs
            self.swaps.append({"from": None if current is None else current.version, "to": version,
                               "load_s": time.perf_counter() - began, "at": time.time()})
            self.failed.pop(version, None)
            self.last_error = None
            settled = snapshot
            log.info("endpoint: now serving %s", served.name)

    def _digest(self, version: int) -> str | None:
        """The content digest of ``version``'s local checkpoint folder (None when it is not local or unknown):
        a failed version is tried again at once when its content changes."""
        # late: torch (the model files); the endpoint's HTTP layer imports this module without it
        from evertrain.models.checkpoint import checkpoint_digest

        try:
            row = self.rt.store.model_version(self.config.name, version)
            stored = row["path"] if isinstance(row["path"], str) else ""
            path = resolve_under(stored, self.rt.checkpoints_root()) if stored else None
            return checkpoint_digest(path) if path is not None and path.is_dir() else None
        except Exception:  # no row yet, or the folder being written: the retry schedule decides
            return None

    def _due(self, version: int, digest: str | None) -> bool:
        """Whether to (try to) load ``version`` now: always the first time and after its content changed,
        else once its back-off has passed (doubling from one poll to ``RETRY_MAX_SECONDS``)."""
        failure = self.failed.get(version)
        if failure is None:
            return True
        if digest is not None and failure["digest"] is not None and digest != failure["digest"]:
            return True
        return time.monotonic() >= failure["next_try"]

    def _failed_load(self, version: int, digest: str | None, error: Exception) -> None:
        previous = self.failed.get(version)
        same = previous is not None and previous["digest"] == digest
        delay = min(previous["delay"] * 2, RETRY_MAX_SECONDS) if same else self.config.serving.poll_seconds * 2
        self.failed[version] = {"digest": digest, "delay": delay, "next_try": time.monotonic() + delay,
                                "attempts": (previous["attempts"] if same else 0) + 1,
                                "error": f"{type(error).__name__}: {error}"}
        self.last_error = f"loading v{version} failed: {type(error).__name__}: {error}"
        served = self.current
        if same:  # said once per version and content; the retries are quiet
            log.debug("endpoint: v%d still fails to load (attempt %d, next in %.0f s): %s", version,
                      self.failed[version]["attempts"], delay, error)
        else:
            log.warning("endpoint: the champion v%d (content %s) failed to load; still serving %s, trying again "
                        "with back-off (at once if its checkpoint changes): %s: %s", version,
                        (digest or "unknown")[:12], served.name if served else "nothing", type(error).__name__,
                        error)


@dataclass
class Draft:
    """A request's trace as it is being built (redacted when it is recorded)."""

    trace_id: str
    started: float
    key_id: str | None = None  # the caller's API key (serving.auth = "keys")
    request: Any = None
    served: Served | None = None
    env: str | None = None
    problem_id: str | None = None
    problem: Any = None
    response: Any = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tools: set[str] = field(default_factory=set)
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0


@dataclass
class ChatRequest:
    """A validated chat request in the project's terms."""

    messages: list[dict[str, str]]
    active_tools: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    env: Environment | None
    problem: Problem | None
    # where the answer the verifier grades against came from: "environment" (Environment.rebuild) or "client"
    answer_from: str | None = None


class Endpoint:
    """The endpoint's state: config, store, champion, trace writer, and the executors that do the work."""

    def __init__(self, config: CampaignConfig, store: Store | None = None) -> None:
        # late: torch (the model files); the endpoint's HTTP layer imports this module without it
        from evertrain.models.precision import set_threads

        self.config = config
        self.serving = config.serving
        set_threads(config.torch_threads)
        # its own connection, closed by stop(); or, in a process that already holds one to the same store (a
        # campaign's context: Runtime.store), that one, borrowed: two connections of one process to a DuckLake
        # SQLite catalog contend for it ("database is locked") where one connection's statements take turns
        self._owns_store = store is None
        self.store = Store(config.paths.store) if store is None else store
        self.champion = Champion(config, self.store)
        self.redactor = Redactor(self.serving.redaction)
        self.quotas = Quotas(self.serving.requests_per_minute, self.serving.tokens_per_minute)
        self.in_flight = InFlight(self.serving.max_queued_tokens)
        self.connections = ConnectionStats()  # what the connection guard refused (evertrain.serving.connections)
        # serving.auth = "keys": the keys' cache over this store, read by the app's AuthMiddleware
        self.keys = auth.KeyCache(self.store, self.serving.auth_cache_seconds) if self.serving.auth == "keys" \
            else None
        self.writer: TraceWriter | None = None
        # a backend that schedules its own batches (vLLM's server) batches concurrent requests itself: let them reach
        # it together; on the in-house sampler the batcher runs one sampling call at a time (it uses every torch
        # thread), for up to serving.max_batch requests that arrived meanwhile, the smallest requests first
        self.batcher: Batcher | None = None
        if not self.champion.rt.inference.capabilities.batch_size:
            workers = self.serving.vllm_concurrency
        else:  # requests queue in the batcher (shortest first): each waiting one holds a thread of this pool, and
            # beyond it requests wait in arrival order
            workers = max(self.serving.max_batch, min(self.serving.max_connections, 64))
            self.batcher = Batcher(self.serving.max_batch, self.serving.fair_wait_seconds)
        self.generator = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="evertrain-generate")
        # a fast tokenizer used from two threads at once can fail ("Already borrowed"): prompts are encoded in turn
        self._encode_lock = threading.Lock()
        self.graders = ThreadPoolExecutor(max_workers=2, thread_name_prefix="evertrain-grade")
        self._envs: dict[str, Environment] = {}
        self._env_lock = threading.Lock()
        self.requests = 0
        self.internal_errors = 0  # requests answered 500 or whose trace could not be built: each logged
        self._metrics_run: str | None = None
        self._metrics_step = 0
        self._stop_metrics = threading.Event()
        self._metrics_thread: threading.Thread | None = None

    # --- life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.serving.trace:
            self.writer = TraceWriter(self.store, batch_rows=self.serving.trace_batch_rows,
                                      flush_seconds=self.serving.trace_flush_seconds,
                                      compact_seconds=self.serving.compact_seconds,
                                      compact_keep_seconds=self.serving.compact_keep_seconds)
        self.champion.start()
        if self.serving.trace:
            self._metrics_thread = threading.Thread(target=self._log_metrics_loop, name="evertrain-live-metrics",
                                                    daemon=True)
            self._metrics_thread.start()

    def log_live_metrics(self) -> dict[str, float]:
        """Log the live pass rate per environment and tool to MLflow (run 'endpoint'): the served version's
        as ``live_pass_rate/<env>/<tool>``, every version's as ``live_pass_rate/v<N>/<env>/<tool>``, and the
        plot over time as the artifact ``live_pass_rate.png``; returns the metrics logged."""
        served = self.champion.current
        if served is None:
            return {}
        every = live_pass_rates(self.store, self.config.name)
        rates = every[every["model_version"] == served.version]
        metrics = {"served_version": float(served.version)}
        for row in rates.itertuples(index=False):
            key = _metric_key(f"{row.env}/{row.tools or 'no_tool'}")
            metrics[f"live_pass_rate/{key}"] = float(row.pass_rate)
            metrics[f"live_requests/{key}"] = float(row.requests)
        for row in every.itertuples(index=False):
            if row.model_version is not None and row.model_version == row.model_version:  # not NaN
                key = _metric_key(f"v{int(row.model_version)}/{row.env}/{row.tools or 'no_tool'}")
                metrics[f"live_pass_rate/{key}"] = float(row.pass_rate)
                metrics[f"live_requests/{key}"] = float(row.requests)
        tracker = self.champion.tracker
        if self._metrics_run is None:
            self._metrics_run = tracker.client.create_run(
                tracker.experiment_id, run_name="endpoint",
                tags={"evertrain.campaign": self.config.name, "evertrain.endpoint": "true"}).info.run_id
        self._metrics_step += 1
        tracker.log_metrics(self._metrics_run, metrics, step=self._metrics_step)
        if not every.empty:
            self._log_live_plot(tracker)
        return metrics

    def _log_live_plot(self, tracker: Any) -> None:
        # late: matplotlib (~0.5 s), after plots' figure chose the Agg backend
        import matplotlib.pyplot as plt

        series = live_pass_rate_over_time(self.store, self.config.name)
        if not series:
            return
        fig = live_pass_rate_figure(series, f"campaign {self.config.name}: live pass rate")
        try:
            tracker.client.log_figure(self._metrics_run, fig, "live_pass_rate.png")
        finally:
            plt.close(fig)

    def _log_metrics_loop(self) -> None:
        while not self._stop_metrics.wait(self.serving.metrics_seconds):
            try:
                self.log_live_metrics()
            except Exception as error:  # MLflow or the store unavailable for a moment: the next round tries again
                log.warning("endpoint: logging live metrics failed: %s", error)

    def stop(self) -> None:
        self._stop_metrics.set()
        if self._metrics_thread is not None:  # it reads the store, which is closed below
            self._metrics_thread.join(timeout=30)
        if self._metrics_run is not None:
            with contextlib.suppress(Exception):
                self.champion.tracker.finish_run(self._metrics_run)
        self.champion.stop()
        self.graders.shutdown(wait=True)
        self.generator.shutdown(wait=True)
        if self.batcher is not None:
            self.batcher.close()
        if self.writer is not None:
            self.writer.close()
        if self._owns_store:
            self.store.close()

    # --- environments and tools --------------------------------------------------------------------
    def env(self, name: str) -> Environment:
        with self._env_lock:
            if name not in self._envs:
                spec = next((s for s in self.config.environments if s.name == name), None)
                self._envs[name] = registry.get(name, **(spec.options if spec else {}))
            return self._envs[name]

    def known_tools(self, extra: Environment | None = None) -> set[str]:
        """The tools the model was trained to call: those of the campaign's environments (and of a named one)."""
        names: set[str] = set()
        for spec in self.config.environments:
            names |= set(self.env(spec.name).tools)
        if extra is not None:
            names |= set(extra.tools)
        return names

    # --- the chat request --------------------------------------------------------------------------
    def parse(self, body: Any, draft: Draft) -> ChatRequest:
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}",
                           code="invalid_body")
        campaign = self.config.name
        model = body.get("model")
        served = draft.served
        accepted = {campaign, f"{campaign}@champion"} | ({served.name} if served else set())
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: name the campaign, e.g. "
                           f"{campaign!r}", code="missing_model", param="model")
        if model not in accepted:
            raise ApiError(404, f"the model {model!r} does not exist here: this endpoint serves campaign "
                           f"{campaign!r}'s champion ({', '.join(sorted(accepted))})",
                           code="model_not_found", kind="not_found_error", param="model")
        env, problem, answer_from = self._task(body.get("evertrain"), draft)
        active = self._tools(body, env, draft)
        messages = self._messages(body.get("messages"), active, draft)
        return ChatRequest(messages=messages, active_tools=active, max_tokens=self._max_tokens(body, env),
                           temperature=_number(body, "temperature", self.config.generation.temperature, 0.0, 2.0),
                           top_p=_number(body, "top_p", 1.0, 0.0, 1.0), n=self._n(body),
                           seed=_optional_int(body, "seed"), stop=_stop(body.get("stop")),
                           stream=bool(body.get("stream", False)),
                           include_usage=_include_usage(body.get("stream_options")),
                           env=env, problem=problem, answer_from=answer_from)

    def _task(self, extra: Any, draft: Draft) -> tuple[Environment | None, Problem | None, str | None]:
        """The task the client named (extra body field ``evertrain``), for the verified outcome: one of the
        campaign's environments only (another's grader would run what the client sent, e.g. its tests), and
        graded against the environment's own answer where it has one (:meth:`Environment.rebuild`), the
        client's only where it has none; with where the answer came from."""
        if extra is None:
            return None, None, None
        if not isinstance(extra, dict):
            raise ApiError(400, "'evertrain' must be an object: {\"env\": ..., \"problem\": {...}} or "
                           "{\"env\": ..., \"problem_id\": ...}", code="invalid_evertrain", param="evertrain")
        name = extra.get("env")
        if not isinstance(name, str):
            raise ApiError(400, "'evertrain.env' must name an environment", code="invalid_evertrain",
                           param="evertrain.env")
        campaign = [spec.name for spec in self.config.environments]
        if name not in campaign:  # another environment's grader would run code the client chose (its tests, ...)
            raise ApiError(400, f"unknown environment {name!r}: campaign {self.config.name!r} has "
                           f"{', '.join(campaign)}; a request may name only these", code="unknown_env",
                           param="evertrain.env")
        try:
            env = self.env(name)
        except UnknownEnvironment as error:
            raise ApiError(400, str(error), code="unknown_env", param="evertrain.env") from None
        draft.env = name
        data = extra.get("problem")
        if data is None and extra.get("problem_id") is not None:
            data = self._stored_problem(name, str(extra["problem_id"]))
        if data is None:
            return env, None, None
        try:
            problem = env.parse_problem(data)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
            raise ApiError(400, f"'evertrain.problem' is not a {name} problem: {error}", code="invalid_problem",
                           param="evertrain.problem") from None
        own = env.rebuild(problem)
        draft.problem, draft.problem_id = data, (own or problem).id
        return (env, own, "environment") if own is not None else (env, problem, "client")

    def _stored_problem(self, env: str, problem_id: str) -> dict[str, Any]:
        row = self.store.stored_problem(self.config.name, env, problem_id)
        if row is None:
            raise ApiError(400, f"no {env} problem with id {problem_id!r} in campaign {self.config.name!r}",
                           code="unknown_problem", param="evertrain.problem_id")
        payload = json.loads(row["payload"])
        return {"prompt": row["prompt"], "question": row["prompt"], **payload}

    def _tools(self, body: dict[str, Any], env: Environment | None, draft: Draft) -> list[str]:
        """The tools whose calls are parsed from this request's answer (declared ones, else the named task's)."""
        known = self.known_tools(env)
        declared = body.get("tools")
        if declared is not None and not isinstance(declared, list):
            raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           code="invalid_tools", param="tools")
        names = []
        for i, tool in enumerate(declared or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise ApiError(400, f"tools[{i}] names no function", code="invalid_tools", param=f"tools[{i}]")
            if name not in known:
                raise ApiError(400, f"unknown tool {name!r}: the model was trained to call "
                               f"{', '.join(sorted(known)) or 'no tools'}", code="unknown_tool", param=f"tools[{i}]")
            names.append(name)
        if body.get("tool_choice") == "none":
            return []
        if not names and env is not None:
            names = list(env.tools)
        draft.tools |= set(names)
        return names

    def _messages(self, raw: Any, active: list[str], draft: Draft) -> list[dict[str, str]]:
        """OpenAI messages in the project's chat format (tool calls as tool blocks, tool output defused)."""
        if not isinstance(raw, list) or not raw:
            raise ApiError(400, "'messages' must be a non-empty list", code="invalid_messages", param="messages")
        known = self.known_tools()
        messages = []
        for i, message in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ApiError(400, f"{where} must be an object with a role among {', '.join(ROLES)}",
                               code="invalid_messages", param=where)
            role = "system" if message["role"] == "developer" else message["role"]
            content = _text(message.get("content"), where)
            if role == "assistant":
                calls = message.get("tool_calls") or []
                if not isinstance(calls, list):
                    raise ApiError(400, f"{where}.tool_calls must be a list", code="invalid_messages",
                                   param=f"{where}.tool_calls")
                for call in calls:
                    name, code = _client_call(call, where)
                    if name not in known:
                        raise ApiError(400, f"{where} calls unknown tool {name!r}: the model was trained to call "
                                       f"{', '.join(sorted(known)) or 'no tools'}", code="unknown_tool", param=where)
                    content = (content + "\n" if content else "") + f"<{name}>\n{code}\n</{name}>"
                    draft.tool_calls.append({"name": name, "input": code, "from": "request"})
                    draft.tools.add(name)
            elif role == "tool":  # as the rollout formats tool output: trimmed, cut at 500 characters, defused
                name = message.get("name") or "tool"
                if not isinstance(name, str):
                    raise ApiError(400, f"{where}.name must be a string", code="invalid_messages",
                                   param=f"{where}.name")
                content = format_tool_result(name, ToolResult(output=content))
                if draft.tool_calls:
                    draft.tool_calls[-1].setdefault("result", content)
            messages.append({"role": role, "content": content})
        return messages

    def _max_tokens(self, body: dict[str, Any], env: Environment | None) -> int:
        default = self.config.max_new_tokens(env.name) if env is not None else self.config.generation.max_new_tokens
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"'max_tokens' must be a positive integer, not {value!r}", code="invalid_value",
                           param="max_tokens")
        if value > self.serving.max_tokens:
            raise ApiError(400, f"'max_tokens' = {value} is above this endpoint's limit of {self.serving.max_tokens}",
                           code="invalid_value", param="max_tokens")
        return value

    def _n(self, body: dict[str, Any]) -> int:
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"'n' must be an integer from 1 to {MAX_CHOICES}, not {n!r}", code="invalid_value",
                           param="n")
        return n

    # --- generation --------------------------------------------------------------------------------
    def generate(self, request: ChatRequest, served: Served, draft: Draft) -> dict[str, Any]:
        """Sample the answer with ``served`` (the one model this request sees) and build the response."""
        # late: torch (the model files); the endpoint's HTTP layer imports this module without it
        from evertrain.models.checkpoint import encode_chat

        with self._encode_lock:
            prompt = encode_chat(served.tokenizer, request.messages)
        if len(prompt) > self.serving.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens, above this endpoint's limit of "
                           f"{self.serving.max_prompt_tokens} (serving.max_prompt_tokens)",
                           code="context_length_exceeded", param="messages")
        stops = (*stop_strings(request.active_tools), *request.stop)
        seed = request.seed if request.seed is not None else uuid.uuid4().int & 0x7FFFFFFF
        temperature, top_p = max(request.temperature, 1e-4), request.top_p if request.top_p > 0 else 1.0
        if self.batcher is not None and served.sampler.capabilities.per_request_seeds:
            group, stats = self.batcher.sample(Job(
                served=served, prompt=prompt, n=request.n, max_new_tokens=request.max_tokens, temperature=temperature,
                top_p=top_p, greedy=request.temperature == 0.0, seed=seed, stop_strings=stops))
            groups = [group]
        else:
            groups, stats = served.sampler.sample(
                [prompt], request.n, max_new_tokens=request.max_tokens, temperature=temperature, top_p=top_p,
                greedy=request.temperature == 0.0, seed=seed, seeds=[seed], stop_strings=stops)
        choices = []
        for index, sample in enumerate(groups[0]):
            text = sample.text
            call = parse_tool_call(text, request.active_tools) if request.active_tools else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = "length" if sample.finish_reason == "length" else "stop"
            if call is not None:
                opening = re.search(rf"<\s*{re.escape(call.name)}\s*>", text, re.IGNORECASE)
                before = text[:opening.start()].strip() if opening else ""
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                message = {"role": "assistant", "content": before or None, "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps({"input": call.input})}}]}
                reason = "tool_calls"
                draft.tool_calls.append({"name": call.name, "input": call.input, "from": "response", "id": call_id})
                draft.tools.add(call.name)
            elif request.stop and sample.finish_reason == "stop_string":
                for stop in request.stop:  # OpenAI leaves the stop sequence out of the text
                    if text.endswith(stop):
                        message["content"] = text[:-len(stop)]
                        break
            choices.append({"index": index, "message": message, "finish_reason": reason, "logprobs": None})
        draft.prompt_tokens = len(prompt)
        draft.cached_tokens = int(stats.cached_prompt_tokens)
        draft.completion_tokens = int(stats.completion_tokens)
        draft.finish_reason = choices[0]["finish_reason"]
        # late: torch; the endpoint's HTTP layer imports this module without it
        import torch

        draft.cost_usd = request_cost(self.config, computed_tokens=len(prompt) - draft.cached_tokens
                                      + draft.completion_tokens, cached_tokens=draft.cached_tokens,
                                      forward_seconds=stats.forward_seconds, on_gpu=served.on_gpu,
                                      threads=torch.get_num_threads())
        return {
            "id": draft.trace_id, "object": "chat.completion", "created": int(time.time()), "model": served.name,
            "system_fingerprint": served.name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": draft.completion_tokens,
                      "total_tokens": len(prompt) + draft.completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": draft.cached_tokens}},
            "evertrain": {"trace_id": draft.trace_id, "model_version": served.version,
                          "backend": served.sampler.backend, "served_by": getattr(stats, "served_by", served.name)},
        }

    # --- outcomes and traces -----------------------------------------------------------------------
    def grade(self, request: ChatRequest, response: dict[str, Any], trace_id: str) -> None:
        """The verified outcome of a final answer to a named task (in the background, off the request)."""
        if request.env is None or request.problem is None or request.n != 1:
            return
        choice = response["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            return  # the episode goes on: the outcome is graded on the request that carries the final answer
        self.graders.submit(self._grade, request, choice["message"].get("content") or "", trace_id)

    def _grade(self, request: ChatRequest, answer: str, trace_id: str) -> None:
        env, problem = request.env, request.problem
        assert env is not None and problem is not None
        try:
            if hasattr(env, "verify_transcript"):
                last_user = max(i for i, m in enumerate(request.messages) if m["role"] == "user") \
                    if any(m["role"] == "user" for m in request.messages) else -1
                turns = [*request.messages[last_user + 1:], {"role": "assistant", "content": answer}]
                verdict = env.verify_transcript(problem, turns)
            else:
                verdict = env.verify(problem, answer)
            # the grader's sandboxed processes: audited in sandbox_runs as the score stage's are (purpose
            # "endpoint:<what ran>", no iteration), the verdict naming their run ids
            runs = list(verdict.detail.pop("sandbox_runs", None) or [])
            detail = {"reason": verdict.reason, **self.redactor.value(verdict.detail),
                      "answer_from": request.answer_from}
            if runs:
                detail["sandbox_run_ids"] = [run.get("run_id") for run in runs]
            row = feedback_row(trace_id, self.config.name, "verifier", verdict.passed, verdict.reward, detail)
            if self.writer is not None:
                for run in runs:
                    self.writer.add_sandbox_run({**run, "campaign": self.config.name, "iteration": None,
                                                 "purpose": f"endpoint:{run.get('purpose')}"})
        except Exception as error:  # a verifier must not raise on an answer; if one does, say so as the outcome
            row = feedback_row(trace_id, self.config.name, "verifier", False, 0.0,
                               {"reason": "verifier_error", "error": self.redactor.text(str(error))[:500]})
        if self.writer is not None:
            self.writer.add_feedback(row)

    def record_failure(self, draft: Draft, error: BaseException) -> None:
        """The trace of a request whose full trace could not be built: what is known, and why (logged too)."""
        self.internal_errors += 1
        log.error("endpoint: the trace of request %s could not be built (%s: %s); a short one is stored",
                  draft.trace_id, type(error).__name__, error)
        if self.writer is None:
            return
        served = draft.served
        self.writer.add_trace({
            "trace_id": draft.trace_id, "campaign": self.config.name,
            "model_version": None if served is None else served.version,
            "model": None if served is None else served.name, "env": draft.env, "status": "error",
            "http_status": draft.http_status, "error": f"trace_failed: {type(error).__name__}; request "
            f"{draft.error or 'answered'}"[:2000], "latency_ms": (time.perf_counter() - draft.started) * 1000,
            "created_at": now(), "key_id": draft.key_id})

    def record(self, draft: Draft) -> None:
        """Queue the trace of one request, redacted (the rule runs here, before anything is queued)."""
        if self.writer is None:
            return
        served = draft.served
        redact = self.redactor.value
        self.writer.add_trace({
            "trace_id": draft.trace_id, "campaign": self.config.name,
            "model_version": None if served is None else served.version, "model": None if served is None else
            served.name, "env": draft.env, "problem_id": draft.problem_id,
            "problem": None if draft.problem is None else to_json(redact(draft.problem)),
            "request": None if draft.request is None else to_json(redact(draft.request)),
            "response": None if draft.response is None else to_json(redact(draft.response)),
            "tool_calls": to_json(redact(draft.tool_calls)), "tools": ",".join(sorted(draft.tools)) or None,
            "status": draft.status, "http_status": draft.http_status,
            "error": None if draft.error is None else self.redactor.text(draft.error),
            "finish_reason": draft.finish_reason, "latency_ms": (time.perf_counter() - draft.started) * 1000,
            "prompt_tokens": draft.prompt_tokens, "cached_tokens": draft.cached_tokens,
            "completion_tokens": draft.completion_tokens, "cost_usd": draft.cost_usd, "created_at": now(),
            "key_id": draft.key_id})


def _metric_key(key: str) -> str:
    """``key`` as an MLflow metric name: traces without a named task have env '(none)', and MLflow takes only
    letters, digits and ``_-. :/``."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key.replace("(none)", "no_env"))


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"'{key}' must be a number from {low:g} to {high:g}, not {value!r}", code="invalid_value",
                       param=key)
    return float(value)


def _optional_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer, not {value!r}", code="invalid_value", param=key)
    return value & 0x7FFFFFFF


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}",
                       code="invalid_value", param="stream_options")
    return bool(options.get("include_usage", False))


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", code="invalid_value",
                       param="stop")
    return tuple(stops)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}.content: only text parts are supported", code="invalid_messages",
                               param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", code="invalid_messages",
                   param=f"{where}.content")


def _client_call(call: Any, where: str) -> tuple[str, str]:
    """(tool name, input) of one of the client's ``tool_calls`` (arguments: {"input": ...} or a plain string)."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, f"{where}.tool_calls: each call needs function.name", code="invalid_messages", param=where)
    arguments = function.get("arguments", "")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: the string itself is the input
            arguments = json.loads(arguments) if arguments.strip().startswith("{") else arguments
    if isinstance(arguments, dict):
        found = next((arguments[k] for k in ("input", "code", "query", "command", "expression") if k in arguments),
                     None)
        if found is None and len(arguments) == 1:
            found = next(iter(arguments.values()))
        arguments = found
    if not isinstance(arguments, str):
        raise ApiError(400, f"{where}.tool_calls: arguments must be {{\"input\": \"...\"}} or a string",
                       code="invalid_messages", param=where)
    return name, arguments


# --- the ASGI application ------------------------------------------------------------------------------

FEEDBACK_BYTES = 64 * 1024  # a feedback body is a trace id, a verdict and a short detail


def _quota_refusal(over: tuple[str, float], serving: Any, headers: dict[str, str]) -> ApiError:
    """The 429 for a request past its client's per-minute quota (``over``: which limit, seconds to wait)."""
    which, wait = over
    limit = serving.requests_per_minute if which == "requests" else serving.tokens_per_minute
    what = "requests" if which == "requests" else "tokens (max_tokens x n + prompt characters / 4)"
    if math.isinf(wait):
        return ApiError(429, f"this request asks for more {what} than this client may use in a minute ({limit}): "
                        "ask for fewer", code="rate_limit_exceeded", kind="tokens")
    headers["retry-after"] = str(max(1, math.ceil(wait)))
    return ApiError(429, f"rate limit: more than {limit} {what} a minute for this client; retry in "
                    f"{max(1, math.ceil(wait))} s", code="rate_limit_exceeded", kind=which)


def _json_body(raw: bytes, draft: Draft | None = None) -> Any:
    """The parsed body, or an :class:`ApiError` (400) for anything that is not JSON the endpoint can keep: not
    JSON, numbers Python will not convert, nesting deeper than ``MAX_JSON_DEPTH``, an unpaired surrogate in a
    string (``"\\ud800"``: no text to tokenize, no UTF-8 to store). The draft keeps the body, or its first 4000
    characters when it cannot keep the body itself (not JSON, too deep)."""
    def malformed(message: str, code: str, param: str | None = None) -> ApiError:
        if draft is not None:
            draft.request = {"malformed_body": raw[:4000].decode("utf-8", "replace")}
        return ApiError(400, message, code=code, param=param)

    try:
        body = json.loads(raw)
    except RecursionError:
        raise malformed(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise malformed(f"the request body is not valid JSON: {error}", "invalid_json") from None
    if draft is not None:  # stored as parsed (an unpaired surrogate as its escape: TraceWriter)
        draft.request = body
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise malformed(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                if _unpaired(key):
                    raise ApiError(400, f"a key in {where or 'the body'} has an unpaired UTF-16 surrogate: text must "
                                   "be valid Unicode", code="invalid_unicode", param=where or None)
                stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str) and _unpaired(value):
            raise ApiError(400, f"{where or 'the body'} has an unpaired UTF-16 surrogate (a \\ud800-\\udfff escape "
                           "that is not half of a pair): text must be valid Unicode", code="invalid_unicode",
                           param=where or None)
    return body


def _unpaired(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (UTF-8 cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


async def _bounded_body(request: Any, limit: int, seconds: float | None = None) -> tuple[bytes | None, int]:
    """The request body, read chunk by chunk and abandoned once it passes ``limit`` bytes (a declared
    Content-Length above it is refused unread; a chunked body cannot exhaust memory): (body, size), or
    (None, the size seen) when it is too large. A body that takes longer than ``seconds`` is a 408 error."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None, int(declared)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return None, size
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s ({size} bytes came)",
                       code="request_timeout") from None
    return b"".join(chunks), size


def create_app(endpoint: Endpoint) -> Any:
    """The FastAPI application over ``endpoint`` (started and stopped with the server's life span)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        if endpoint.champion.current is None:
            await asyncio.get_running_loop().run_in_executor(None, endpoint.start)
        yield
        await asyncio.get_running_loop().run_in_executor(None, endpoint.stop)

    app = FastAPI(title=f"evertrain endpoint: {endpoint.config.name}", lifespan=lifespan)
    if endpoint.keys is not None:  # serving.auth = "keys": every route but /health needs a key with its scope
        app.add_middleware(auth.AuthMiddleware, keys=endpoint.keys)
    # added last, so it runs first: a foreign Host or Origin is refused before any key is looked up
    trace_ids = guard.TraceIds(guard.stored_trace(endpoint.store))  # what /feedback may name
    app.add_middleware(guard.Guard, allowed_hosts=guard.allowed_hosts(endpoint.serving),
                       cors_origins=endpoint.serving.cors_origins, trace_ids=trace_ids)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(ApiError(error.status_code, str(error.detail), code=code).body(), error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        # what escaped a handler: an OpenAI-style 500 (not Starlette's plain text), counted and logged
        endpoint.internal_errors += 1
        log.error("endpoint: %s %s failed: %s: %s", request.method, request.url.path, type(error).__name__, error)
        return JSONResponse(ApiError(500, f"the endpoint failed: {type(error).__name__}", code="internal_error",
                                     kind="server_error").body(), 500)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        served = endpoint.champion.current
        key = auth.caller(request.state)
        # open to anyone; the watcher's error (it can name files) only without keys or to an admin key
        private = endpoint.keys is None or (key is not None and "admin" in key.scopes)
        return {"status": "ok" if served else "loading", "model": served and served.name,
                "version": served and served.version, "requests": endpoint.requests,
                "trace_backlog": endpoint.writer.backlog() if endpoint.writer else 0,
                "trace_failed_rows": endpoint.writer.failed_rows if endpoint.writer else 0,
                "trace_replayed_rows": endpoint.writer.replayed_rows if endpoint.writer else 0,
                "internal_errors": endpoint.internal_errors, "quota_refused": endpoint.quotas.refused,
                "queue_refused": endpoint.in_flight.refused,
                "header_timeouts": endpoint.connections.header_timeouts,
                "connections_refused": endpoint.connections.connections_refused,
                "watcher_error": endpoint.champion.last_error if private else None}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = endpoint.champion.current
        names = [endpoint.config.name] + ([served.name] if served else [])
        created = int(served.loaded_at) if served else 0
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "evertrain"} for name in names]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        key = auth.caller(request.state)
        draft = Draft(trace_id=f"chatcmpl-{uuid.uuid4().hex}", started=time.perf_counter(),
                      key_id=key and key.key_id, served=endpoint.champion.current)  # the one model it will see
        endpoint.requests += 1
        headers = {TRACE_HEADER: draft.trace_id}
        try:
            limit = endpoint.serving.max_request_bytes
            raw, size = await _bounded_body(request, limit, endpoint.serving.body_timeout_seconds)
            if raw is None:
                draft.request = {"body_bytes": size}
                raise ApiError(413, f"the request body is {size} bytes or more, above this endpoint's limit of "
                               f"{limit}", code="request_too_large")
            body = _json_body(raw, draft)
            draft.request = body
            if draft.served is None:
                raise ApiError(503, "the endpoint is still loading its model", code="model_loading",
                               kind="service_unavailable")
            headers[MODEL_HEADER] = draft.served.name
            # off the event loop: a stored problem's look-up and an environment's construction can block, and
            # every other request (and /health) waits while the loop does
            parsed = await run_in_threadpool(endpoint.parse, body, draft)
            client = key.key_id if key is not None else (request.client.host if request.client else "unknown")
            prompt_chars = sum(len(str(m.get("content") or "")) for m in parsed.messages)
            served = draft.served
            queued = parsed.max_tokens * parsed.n
            # the queue first: a request it refuses spends none of the client's per-minute quota
            if not endpoint.in_flight.enter(client, queued):
                headers["retry-after"] = "1"
                raise ApiError(429, f"this client already has {endpoint.in_flight.held(client)} completion tokens "
                               f"waiting or being sampled; {queued} more would pass its limit of "
                               f"{endpoint.serving.max_queued_tokens} (serving.max_queued_tokens): wait for its "
                               "earlier requests", code="queue_full", kind="tokens")
            over = endpoint.quotas.admit(client, queued + prompt_chars // 4)
            if over is not None:
                endpoint.in_flight.leave(client, queued)
                raise _quota_refusal(over, endpoint.serving, headers)
            try:
                response = await asyncio.get_running_loop().run_in_executor(
                    endpoint.generator, endpoint.generate, parsed, served, draft)
            finally:
                endpoint.in_flight.leave(client, queued)
            draft.response = response
            endpoint.grade(parsed, response, draft.trace_id)
            if parsed.stream:
                return StreamingResponse(_sse(response, parsed.include_usage), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(response, headers=headers)
        except ApiError as error:
            draft.status, draft.http_status, draft.error = "error", error.status, f"{error.code}: {error.message}"
            return JSONResponse(error.body(), error.status, headers=headers)
        except Exception as error:  # never a crash: the client gets an error body and the trace says what broke
            log.exception("endpoint: request %s failed", draft.trace_id)
            draft.status, draft.http_status = "error", 500
            draft.error = f"internal_error: {type(error).__name__}: {error}"
            return JSONResponse(ApiError(500, f"the endpoint failed: {type(error).__name__}: {error}",
                                         code="internal_error", kind="server_error").body(), 500, headers=headers)
        finally:
            # redaction runs every rule over the whole request and response: on a large body (or a costly
            # user pattern) that is CPU time no other request should wait for. anyio does not abandon the
            # thread when the request is cancelled (a client hanging up), so the trace is still queued
            try:
                await run_in_threadpool(endpoint.record, draft)
            except Exception as error:  # never a bare 500 and never a request without its trace
                endpoint.record_failure(draft, error)

    @app.post("/feedback")
    async def feedback(request: Request) -> Any:
        try:
            raw, size = await _bounded_body(request, FEEDBACK_BYTES, endpoint.serving.body_timeout_seconds)
            if raw is None:
                raise ApiError(413, f"the feedback body is {size} bytes or more, above {FEEDBACK_BYTES}",
                               code="request_too_large")
            body = _json_body(raw)
            if not isinstance(body, dict) or not isinstance(body.get("trace_id"), str) or not body["trace_id"]:
                raise ApiError(400, "'trace_id' is required (the 'id' of a chat completion)", code="invalid_feedback",
                               param="trace_id")
            if not isinstance(body.get("passed"), bool):
                raise ApiError(400, "'passed' must be true or false", code="invalid_feedback", param="passed")
            reward = body.get("reward", 1.0 if body["passed"] else 0.0)
            if (refusal := guard.feedback_refusal(reward)) is not None:
                raise ApiError(refusal[0], refusal[1], code=refusal[2], param=refusal[3])
            owner = await run_in_threadpool(trace_ids.owner, body["trace_id"])
            key = auth.caller(request.state)
            # a key gives feedback on its own traces only (an admin key on any): another client's trace is
            # answered as if it did not exist, so ids cannot be probed
            if owner is guard.MISSING or (key is not None and "admin" not in key.scopes and owner != key.key_id):
                raise ApiError(404, f"no trace {body['trace_id']!r}: feedback names the 'id' of a chat completion "
                               "this endpoint answered for the same API key", code="trace_not_found",
                               param="trace_id")
        except ApiError as error:
            return JSONResponse(error.body(), error.status)
        if endpoint.writer is not None:
            def queue() -> None:  # redacted off the event loop, as the traces are
                endpoint.writer.add_feedback(feedback_row(
                    body["trace_id"], endpoint.config.name, "client", body["passed"], reward,
                    endpoint.redactor.value(body.get("detail"))))

            await run_in_threadpool(queue)
        return {"ok": True, "trace_id": body["trace_id"]}

    return app


async def _sse(response: dict[str, Any], include_usage: bool) -> Any:
    """The whole answer as OpenAI stream chunks (generated first, then sent: no token-by-token streaming)."""
    base = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    for choice in response["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
        yield f"data: {json.dumps({**base, 'choices': [{'index': choice['index'], 'delta': delta}]})}\n\n"
        done = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield f"data: {json.dumps({**base, 'choices': [done]})}\n\n"
    if include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


# --- running it ----------------------------------------------------------------------------------------

class EndpointServer:
    """uvicorn serving :func:`create_app` in a background thread (tests, benchmarks, the Prefect flow)."""

    def __init__(self, config: CampaignConfig, host: str | None = None, port: int | None = None,
                 store: Store | None = None, endpoint: Endpoint | None = None) -> None:
        auth.check_listen(config.serving.auth, host or config.serving.host)
        self.endpoint = Endpoint(config, store) if endpoint is None else endpoint
        self.app = create_app(self.endpoint)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host=host or config.serving.host, port=config.serving.port if port is None else port,
            log_level="warning", access_log=False, lifespan="on", **uvicorn_options(self.endpoint)))
        self.thread = threading.Thread(target=self.server.run, name="evertrain-endpoint", daemon=True)

    def start(self, timeout: float = 300.0) -> EndpointServer:
        self.endpoint.start()  # load the model here, so a bad config raises in the caller
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the endpoint's server did not start (is the port in use?)")
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def __enter__(self) -> EndpointServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(config: CampaignConfig, host: str | None = None, port: int | None = None) -> None:
    """Serve ``config``'s champion until interrupted (``evertrain endpoint``)."""
    host = host or config.serving.host
    auth.check_listen(config.serving.auth, host)
    endpoint = Endpoint(config)
    endpoint.start()
    served = endpoint.champion.current
    port = config.serving.port if port is None else port
    print(f"evertrain endpoint: serving {served.name if served else '?'} at http://{host}:{port}/v1 "
          f"(traces: {'on' if endpoint.writer else 'off'}; API keys: "
          f"{'required' if endpoint.keys else 'off'}); Ctrl-C stops it", flush=True)
    uvicorn.run(create_app(endpoint), host=host, port=port, log_level="warning", access_log=False,
                **uvicorn_options(endpoint))


def uvicorn_options(endpoint: Endpoint) -> dict[str, Any]:
    """The connection guard (:mod:`evertrain.serving.connections`) as uvicorn settings, and a bounded stop: requests
    still running ``GRACEFUL_STOP_S`` after a stop signal are cancelled (their traces are still written), so a
    request stuck on a store that does not answer cannot keep the endpoint from stopping."""
    serving = endpoint.serving
    return {"http": guarded_protocol(serving.header_timeout_seconds, serving.max_connections, endpoint.connections),
            "timeout_graceful_shutdown": GRACEFUL_STOP_S}
