"""The drift demo (``make flywheel``): serve the champion, change its tool, notice the drop, learn, approve, swap.

1. A short agent campaign (configs/flywheel.toml, SmolLM2-135M-Instruct) trains a champion on the calculator
   with its ``python`` tool (tool version 1); this first champion is promoted without a person (it is trained
   before anything is deployed).
2. The endpoint serves it; a client simulator (the official ``openai`` client, several threads) sends calculator
   tasks as a deployment would: the environment's own prompt for the current tool, the task named (so the
   endpoint's verifier grades the final answer), the tool run at the client and its result sent back.
3. Midway the deployment's tool changes to version 2 (``calc``, JSON with named arguments, run in the same
   sandbox). The campaign's deployment is re-registered with the v2 environment (the environment follows the
   deployed tool; the model does not) and served beside the drift monitor (evertrain.drift), neither started by
   anyone: nothing trains until the monitor sees the drop.
4. The monitor sees the live pass rate of ``calculator[calc]`` below the threshold and runs the campaign's
   deployment, which trains on the failed traces (the trace source) and the v2 environment; when a challenger
   passes the gate, the promote stage pauses for approval and the demo approves it through the Prefect API
   (``evertrain.approval.answer``, what the UI's form and ``evertrain approve`` do); the endpoint swaps.
5. Traffic goes on; the recovered pass rate is measured on the new champion's answers.

Live pass rates come from the store (the endpoint's verifier outcomes of each episode's final answer), each with
its 95% Wilson interval. CPU is the CPU time of this process and every process it started (the endpoint and
client threads here, the Prefect server, the runner and the campaign runs it starts), read from /proc.
Written to ``benchmarks/results/flywheel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Cancelling

from evertrain import processes
from evertrain.approval import ApprovalError, answer, paused_promotions
from evertrain.config import CampaignConfig, load_config
from evertrain.data.store import Store
from evertrain.drift import DRIFT_TAG
from evertrain.envs import registry
from evertrain.flows.deploy import serve_flywheel, start_server
from evertrain.serving.app import Endpoint, EndpointServer
from evertrain.serving.auth import ENV_VAR, create_key
from evertrain.stats import wilson

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC_SEED = 20_251


def log(message: str) -> None:
    print(f"[flywheel {time.strftime('%H:%M:%S')}] {message}", flush=True)


def with_tool(config: CampaignConfig, version: int, approval: str | None = None) -> CampaignConfig:
    """``config`` with the calculator's tool version set (and the promotion's approval mode, when given)."""
    data = config.model_dump(mode="json")
    for spec in data["environments"]:
        if spec["name"] == "calculator":
            spec["options"] = {**spec.get("options", {}), "tool_version": version}
    if approval is not None:
        data["promotion"]["approval"] = approval
    return CampaignConfig.model_validate(data)


def tree_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds of a process and its live descendants, with the children each has already reaped."""
    root = psutil.Process(pid or os.getpid())
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            t = process.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


# --- the endpoint: both tool versions' calls are parsed ---------------------------------------------------

def endpoint_server(config: CampaignConfig) -> Any:
    """The endpoint (evertrain.serving) on a free port, accepting calls to both calculator tools.

    Tools run at the client, and the deployment's tool is what changed: the endpoint must turn the model's
    ``<calc>`` calls into tool calls as soon as clients declare that tool, before any model was trained on it.
    """
    both = set(registry.get("calculator").tools) | set(registry.get("calculator", tool_version=2).tools)

    class BothTools(Endpoint):
        def known_tools(self, extra: Any = None) -> set[str]:
            return super().known_tools(extra) | both

    return EndpointServer(config, host="127.0.0.1", port=0, endpoint=BothTools(config)).start()


def demo_key(store: Any) -> str:
    """The API key the demo's clients send: $EVERTRAIN_API_KEY when set, else a new one (scope infer) made in the
    demo's own store, as `evertrain keys create` would (the endpoint requires keys: serving.auth = "keys")."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    secret, _row = create_key(store, f"flywheel-demo-{time.strftime('%Y%m%d-%H%M%S')}", "infer", actor="flywheel")
    return secret


# --- the client simulator ---------------------------------------------------------------------------------

@dataclass
class Episode:
    phase: str
    tool_version: int
    problem_id: str
    versions: list[int] = field(default_factory=list)  # the model version of each response
    final_trace: str | None = None
    requests: int = 0
    started: float = 0.0
    ended: float = 0.0


class Traffic:
    """Client threads sending calculator episodes to the endpoint, with the deployment's current tool."""

    def __init__(self, url: str, campaign: str, clients: int, max_tokens: int, pool_size: int = 400,
                 api_key: str | None = None) -> None:
        self.url, self.campaign, self.max_tokens = url, campaign, max_tokens
        # the endpoint's API key (scopes infer, and feedback for a client that sends it): given, else $EVERTRAIN_API_KEY
        self.api_key = api_key or os.environ.get(ENV_VAR)
        if not self.api_key:
            raise ValueError(f"the traffic needs an API key of the endpoint: pass api_key or set {ENV_VAR}")
        self.envs = {1: registry.get("calculator"), 2: registry.get("calculator", tool_version=2)}
        # users' questions: drawn apart from the held-out pool (the trace source would drop those anyway)
        self.pool = self.envs[1].problems("train", pool_size, TRAFFIC_SEED)
        self.tool_version = 1
        self.phase = "before"
        self.pause_s = 0.0  # between a client's episodes (traffic is slowed while the loop trains)
        self.episodes: list[Episode] = []
        self.failures: list[str] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]

    def start(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=300)

    def count(self, phase: str, version: int | None = None) -> int:
        with self._lock:
            return sum(e.phase == phase and (version is None or set(e.versions) == {version})
                       for e in self.episodes)

    def _client(self, k: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=600)
        rng = random.Random(k)
        while not self._stop.is_set():
            problem = rng.choice(self.pool)
            episode = Episode(phase=self.phase, tool_version=self.tool_version, problem_id=problem.id,
                              started=time.time())
            try:
                self._episode(client, problem, episode)
            except Exception as error:  # a failed request is the demo's failure: counted, never hidden
                with self._lock:
                    self.failures.append(f"{type(error).__name__}: {error}"[:300])
            else:
                episode.ended = time.time()
                with self._lock:
                    self.episodes.append(episode)
            if self.pause_s:
                self._stop.wait(self.pause_s)

    def _episode(self, client: Any, problem: Any, episode: Episode) -> None:
        env = self.envs[episode.tool_version]
        messages: list[dict[str, Any]] = env.messages(problem)
        tools = [{"type": "function", "function": {"name": name, "description": tool.description,
                                                   "parameters": {"type": "object",
                                                                  "properties": {"input": {"type": "string"}}}}}
                 for name, tool in env.tools.items()]
        task = {"env": "calculator", "problem": {"question": problem.prompt, **problem.payload}}
        for _turn in range(env.max_turns):
            with self._lock:
                self.requests += 1
            episode.requests += 1
            response = client.chat.completions.create(
                model=self.campaign, messages=messages, tools=tools, temperature=0, max_tokens=self.max_tokens,
                extra_body={"evertrain": task})
            episode.versions.append(int(response.model.rsplit("@v", 1)[1]))
            episode.final_trace = response.id
            choice = response.choices[0]
            if choice.finish_reason != "tool_calls":
                return
            call = choice.message.tool_calls[0]
            tool = env.tools.get(call.function.name)
            code = json.loads(call.function.arguments).get("input", "")
            # the deployment's tool, run here at the client (in the project's sandbox)
            output = tool.run(code, problem).output if tool else f"unknown tool {call.function.name}"
            messages = [*messages, choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": output}]


# --- Prefect: the deployments' runner, the triggered run, the approval ---------------------------------------

def start_runner(config: CampaignConfig, workdir: Path, monitor_interval: float, log_path: Path) -> subprocess.Popen:
    """Serve the campaign's deployment (no schedule) and the drift monitor (every ``monitor_interval`` s)."""
    path = workdir / "flywheel-v2.json"
    path.write_text(json.dumps(config.resolved().model_dump(mode="json")))
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "2", "EVERTRAIN_PROGRESS": "0"}
    with open(log_path, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "evertrain.flywheel", "serve-deployments", str(path),
                                 "--monitor-interval", str(monitor_interval)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def drift_runs(campaign: str) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[DRIFT_TAG, f"campaign:{campaign}"])))


def cancel_run(run_id: Any) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling(), force=True)


# --- measuring ----------------------------------------------------------------------------------------------

def outcomes(store: Any, campaign: str, trace_ids: list[str]) -> dict[str, bool]:
    """The verifier's outcome of each final answer, from the store."""
    return store.verifier_outcomes(campaign, trace_ids)


def phase_rate(episodes: list[Episode], graded: dict[str, bool]) -> dict[str, Any]:
    scored = [graded[e.final_trace] for e in episodes if e.final_trace in graded]
    n, k = len(scored), int(sum(scored))
    low, high = wilson(k, n)
    return {"pass_rate": round(k / n, 4) if n else None, "ci95": [round(low, 4), round(high, 4)], "n": n,
            "passed": k, "ungraded": len(episodes) - n,
            "model_versions": sorted({v for e in episodes for v in e.versions})}


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average_at_start": list(os.getloadavg()),
            "python": platform.python_version(), "commit": commit}


# --- the demo -----------------------------------------------------------------------------------------------

def train_first_champion(config: CampaignConfig, iterations: int, workdir: Path, log_path: Path) -> int:
    """A short campaign on tool v1 (approval 'auto': nothing is deployed yet); the champion's version (the
    store's)."""
    v1 = with_tool(config, 1, approval="auto")
    path = workdir / "flywheel-v1.json"
    path.write_text(json.dumps(v1.resolved().model_dump(mode="json")))
    with open(log_path, "a") as out:
        subprocess.run([sys.executable, "-m", "evertrain.cli", "run", "--config", str(path), "--iterations",
                        str(iterations)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "EVERTRAIN_PROGRESS": "0"})
    with Store(v1.paths.store, read_only=True) as store:
        return int(store.champion_history(v1.name)[0] or 0)


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config, args.set).resolved()
    state = Path(config.paths.checkpoints).parent
    if args.fresh and state.exists():
        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)
    log_path = state / "flywheel.log"
    began, cpu0 = time.time(), tree_cpu_seconds()
    events: list[dict[str, Any]] = []

    def mark(what: str, **extra: Any) -> dict[str, Any]:
        event = {"event": what, "t_s": round(time.time() - began, 1),
                 "cpu_s": round(tree_cpu_seconds() - cpu0, 1), **extra}
        events.append(event)
        log(f"{what} {json.dumps(extra) if extra else ''} (t={event['t_s']} s, cpu={event['cpu_s']} s)")
        return event

    # a Prefect database of the demo's own: runs of an earlier demo (same campaign name) must not count as this one's
    os.environ["PREFECT_HOME"] = str(state / "prefect")
    url, prefect = start_server(args.prefect_port, scheduler_seconds=5)
    os.environ["PREFECT_API_URL"] = url  # the subprocesses'; this process's settings are already loaded
    mark("prefect server up", url=url.removesuffix("/api"))
    with temporary_settings(updates={PREFECT_API_URL: url}):
        return _run_demo(args, config, state, log_path, began, cpu0, events, mark, prefect)


def _run_demo(args: argparse.Namespace, config: CampaignConfig, state: Path, log_path: Path, began: float,
              cpu0: float, events: list[dict[str, Any]], mark: Any, prefect: subprocess.Popen) -> dict[str, Any]:
    runner = server = traffic = None
    result: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, "-m", "evertrain.flywheel",
                                                     *sys.argv[1:]]), "machine": machine(), "events": events}
    try:
        champion = train_first_champion(config, args.warm_iterations, state, log_path)
        mark("first champion trained", champion=champion)
        served_config = with_tool(config, 1).model_copy(update={"torch_threads": args.serving_threads})
        server = endpoint_server(served_config)
        mark("endpoint serving", url=server.url, version=server.endpoint.champion.current.version)
        store = server.endpoint.store
        traffic = Traffic(server.url, config.name, args.clients, config.max_new_tokens("calculator"),
                          api_key=demo_key(store)).start()

        while traffic.count("before") < args.before:
            time.sleep(1)
        traffic.phase, traffic.tool_version = "after", 2
        change = mark("tool changed to v2", requests_so_far=traffic.requests)
        runner = start_runner(with_tool(config, 2), state, args.monitor_interval, log_path)

        trigger = None
        deadline = time.time() + args.max_minutes * 60
        while trigger is None and time.time() < deadline:
            runs = [r for r in drift_runs(config.name) if r.created and r.created.timestamp() >= began + change["t_s"]]
            trigger = runs[0] if runs else None
            time.sleep(2)
        if trigger is None:
            raise RuntimeError("the drift monitor started no run within --max-minutes")
        traffic.pause_s = args.pause_while_training
        drop = mark("monitor started the loop", run=trigger.name, requests_so_far=traffic.requests,
                    after_episodes=traffic.count("after"))
        traffic.phase = "training"

        # the demo plays the reviewer: an answer needs a key with the approve scope, recorded under its name
        reviewer = create_key(store, f"flywheel-demo-reviewer-{time.strftime('%Y%m%d-%H%M%S')}", "approve",
                              actor="flywheel")[0]
        approved = swap = None
        while swap is None and time.time() < deadline:
            if approved is None and paused_promotions(config.name):
                try:
                    done = answer(config.name, True, reason="flywheel demo: the challenger recovers the new tool",
                                  api_key=reviewer)
                    approved = mark("approved (Prefect API)", iteration=done["iteration"], run=done["name"])
                except ApprovalError as error:
                    log(f"approval not possible yet: {error}")
            if server.endpoint.champion.swaps:
                swap = mark("endpoint swapped", **server.endpoint.champion.swaps[-1],
                            requests_so_far=traffic.requests)
            time.sleep(1)
        state_of = {r.name: r.state.name for r in drift_runs(config.name) if r.state}
        if swap is None:
            result["recovered"] = False
            result["why_not"] = gate_decisions(store, config.name)
            mark("no swap before the deadline", runs=state_of)
        else:
            traffic.phase, traffic.pause_s = "recovered", 0.0
            cancel_run(trigger.id)  # the rest of the triggered run is not needed to measure the recovery
            new = swap["to"]
            while traffic.count("recovered", new) < args.after and time.time() < deadline + 900:
                time.sleep(1)
            mark("recovery measured", episodes=traffic.count("recovered", new))
        traffic.stop()
        assert server.endpoint.writer.flush(120)
        time.sleep(3)  # the graders' last verdicts
        assert server.endpoint.writer.flush(120)
        episodes = traffic.episodes
        graded = outcomes(store, config.name, [e.final_trace for e in episodes if e.final_trace])
        old = champion
        phases = {
            "before": [e for e in episodes if e.phase == "before" and set(e.versions) == {old}],
            "after_change": [e for e in episodes if e.phase in ("after", "training") and e.tool_version == 2
                             and set(e.versions) == {old}],
        }
        if swap is not None:
            phases["recovered"] = [e for e in episodes if e.phase == "recovered" and set(e.versions) == {swap["to"]}]
        result["live_pass_rate"] = {name: phase_rate(eps, graded) for name, eps in phases.items()}
        if swap is not None:
            after, rec = result["live_pass_rate"]["after_change"], result["live_pass_rate"]["recovered"]
            result["recovered"] = rec["ci95"][0] > after["ci95"][1]
            between = [e for e in episodes if change["t_s"] <= e.started - began <= swap["t_s"]]
            result["drop_to_swap"] = {
                "from_tool_change": {"wall_s": round(swap["t_s"] - change["t_s"], 1),
                                     "cpu_minutes": round((swap["cpu_s"] - change["cpu_s"]) / 60, 2),
                                     "requests_served": swap["requests_so_far"] - change["requests_so_far"]},
                "from_monitor_trigger": {"wall_s": round(swap["t_s"] - drop["t_s"], 1),
                                         "cpu_minutes": round((swap["cpu_s"] - drop["cpu_s"]) / 60, 2),
                                         "requests_served": swap["requests_so_far"] - drop["requests_so_far"]},
                "episodes_served": len(between),
            }
        result.update(first_champion=champion, triggered_run=trigger.name, runs=state_of,
                      requests_total=traffic.requests, failed_requests=len(traffic.failures),
                      failures=traffic.failures[:10], episodes_total=len(episodes),
                      gate=gate_decisions(store, config.name), wall_minutes=round((time.time() - began) / 60, 1),
                      cpu_minutes=round((tree_cpu_seconds() - cpu0) / 60, 1), config=args.config,
                      settings={k: v for k, v in vars(args).items() if k not in ("command", "func")})
        return result
    except Exception as error:  # what was measured so far is still written, with what broke
        result["error"] = "".join(traceback.format_exception(error))[-3000:]
        log(f"the demo failed: {type(error).__name__}: {error}")
        return result
    finally:
        if traffic is not None:
            traffic.stop()
        if runner is not None:
            processes.stop([runner], signal.SIGINT, timeout=60)  # as Ctrl-C: it cancels its flow runs
        if server is not None:
            server.stop()
        processes.stop([prefect], timeout=60)  # the Prefect server start_server started, with its workers


def gate_decisions(store: Any, campaign: str) -> list[dict[str, Any]]:
    """Each gate's decision (from the store's promotions table), for the report."""
    try:
        frame = store.promotions(campaign).sort_values("iteration")
    except Exception as error:  # an older store without the table: say so rather than fail the report
        return [{"error": str(error)[:200]}]
    keep = [c for c in ("iteration", "challenger_version", "champion_version", "promoted", "challenger_pass1",
                        "champion_pass1", "p_better", "gain_low", "gain_high", "reason") if c in frame.columns]
    return json.loads(frame[keep].to_json(orient="records"))


def serve_deployments(args: argparse.Namespace) -> None:
    serve_flywheel(load_config(args.config), monitor_interval=args.monitor_interval)


def print_summary(result: dict[str, Any]) -> None:
    print("\n== flywheel ==")
    for name, rate in result.get("live_pass_rate", {}).items():
        if rate["n"]:
            print(f"  live pass rate {name:13s} {rate['pass_rate']:.2f}  95% CI [{rate['ci95'][0]:.2f}, "
                  f"{rate['ci95'][1]:.2f}]  n={rate['n']}  (model v{','.join(map(str, rate['model_versions']))})")
    for name, span in (result.get("drop_to_swap") or {}).items():
        if isinstance(span, dict):
            print(f"  {name.replace('_', ' ')} to swap: {span['wall_s'] / 60:.1f} min wall, "
                  f"{span['cpu_minutes']:.1f} CPU-min, {span['requests_served']} requests served")
    print(f"  failed requests: {result.get('failed_requests')}   recovered above the post-change interval: "
          f"{result.get('recovered')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evertrain.flywheel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run the drift demo (the default)")
    demo.add_argument("--config", default="configs/flywheel.toml")
    demo.add_argument("--out", default="benchmarks/results/flywheel.json")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override one config value (repeatable), e.g. --set model.path=embedded:tiny")
    # one warm iteration: in the stop-30 run its champion already passed 40 of 40 with tool v1, and the second
    # iteration's challenger was refused (-0.025)
    demo.add_argument("--warm-iterations", type=int, default=1, help="iterations that train the first champion")
    demo.add_argument("--clients", type=int, default=3, help="concurrent client threads")
    demo.add_argument("--before", type=int, default=48, help="episodes on tool v1 before the change")
    demo.add_argument("--after", type=int, default=48, help="episodes of the new champion after the swap")
    # the clients keep sampling the live pass rate while the loop trains, but slowly: on 2 cores their episodes
    # compete with training for the same CPU (with 4 s, 619 episodes ran during one drift iteration, stop 30)
    demo.add_argument("--pause-while-training", type=float, default=60.0,
                      help="seconds each client waits between episodes while the loop trains")
    demo.add_argument("--monitor-interval", type=float, default=30.0, help="seconds between drift checks")
    demo.add_argument("--serving-threads", type=int, default=1, help="torch threads of the endpoint")
    demo.add_argument("--max-minutes", type=float, default=100.0, help="give up waiting for the swap after this")
    demo.add_argument("--prefect-port", type=int, default=4260)
    demo.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=True,
                      help="start from an empty state/flywheel (default)")
    served = sub.add_parser("serve-deployments", help="(internal) the runner the demo starts")
    served.add_argument("config")
    served.add_argument("--monitor-interval", type=float, default=30.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "serve-deployments"):
        argv = ["demo", *argv]  # the demo is the default command
    args = parser.parse_args(argv)
    if args.command == "serve-deployments":
        serve_deployments(args)
        return 0
    result = run_demo(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_summary(result)
    print(f"written to {args.out}")
    return 0 if result.get("recovered") and result.get("failed_requests") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
