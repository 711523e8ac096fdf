"""``openenv:<name>``: an OpenEnv environment (Meta and Hugging Face's ``openenv-core``, 0.3.0: Gymnasium-style
``reset``/``step`` over a server) as an evertrain environment, one episode per rollout.

- **The server**: ``app = "package.module:app"`` (the ASGI app the package builds with ``create_app``) is started
  by this environment as a real uvicorn process when first needed, in the rubric worker's bubblewrap jail
  (read-only file system, no network, its own PID namespace; :func:`evertrain.sandbox.verifiers_worker.jail_argv`)
  serving on a Unix socket in a folder bound into the jail, in a session of its own and tied to the run's life (it
  dies with it, SIGKILL included), and stopped when the campaign's context closes; ``url = "http://host:port"``
  points at a server someone else runs instead.
- **The protocol**: OpenEnv keeps an episode only over its WebSocket (``/ws``: one connection, one session, one
  environment instance; its HTTP ``/reset`` and ``/step`` build a fresh environment per request and keep no
  episode). So every exchange is one connection: ``reset`` with the problem's seed, then one ``step`` per policy
  reply, then ``close``. The client speaks that protocol with ``websockets`` alone (importing ``openenv.core``
  takes about 5 s: it imports gradio).
- **Problems**: a problem is a seed. Train problems are seeds 0 to ``train_seeds`` - 1, held-out ones
  ``EVAL_SEED_BASE`` and up (``eval_seeds`` of them); the prompt is the first observation's ``observation_field``.
  A train seed whose first observation is a held-out one's is dropped: no held-out prompt is trained on.
- **Actions**: the policy writes text; ``action_field`` names the action's field and ``action_type`` how the text
  becomes its value: ``text`` (the reply as it is) or ``int`` (the reply's last whole number; a reply without
  one ends the episode, reward 0, ``invalid_action``).
- **Episodes**: after each policy turn the environment's next observation is the next user turn, until the
  server says ``done`` or ``max_turns`` turns were taken. Each is replayed from the seed and the policy's replies
  (the environment is deterministic in its seed, which OpenEnv's ``reset(seed=...)`` is for): nothing is kept
  between calls, and grading replays the same way, so no text of a rollout stands in for an observation.
- **Reward**: the episode's return (the sum of the steps' rewards). ``reward = "strict"``: 1 when the episode ended
  ``done`` with a return of at least ``success_reward`` (1.0), else 0; ``"score"``: the return over
  ``success_reward``, in [0, 1]. Every step (action, observation, reward, done) is kept in the verdict's detail
  (the rollout's ``detail`` column).
- **Levels**: ``reset_options`` are arguments of ``reset`` sent with every episode (beside the seed); a package may
  declare its curriculum, a literal ``CURRICULUM`` list of such tables in the app's module or package
  (:mod:`evertrain.envs.declared`), and a problem of level k (``payload["level"]``) is reset with the k-th table over
  ``reset_options``.
- **The self-test**: with ``oracle_field`` (a field of the server's ``state`` holding the action the environment
  expects next), the reference episode plays it step by step and must earn 1; every episode of the generic
  battery (one wrong, empty or hedged reply) must earn 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from functools import cached_property
from typing import Any, ClassVar, Literal

from websockets.sync.client import connect, unix_connect

from evertrain import processes
from evertrain.envs import declared
from evertrain.envs.base import Environment, FixedSplits, Problem, Split, Verdict, replies_of, replies_text
from evertrain.sandbox.verifiers_worker import jail_argv

EVAL_SEED_BASE = 1_000_000
INTEGER = re.compile(r"-?[0-9]+")
START_TIMEOUT_S = 90.0
BUSY_TRIES = 8  # a server at its session limit is asked again, 0.05 s, 0.1 s ... apart
ACTION_ERRORS = ("VALIDATION_ERROR", "EXECUTION_ERROR")  # a step refused for its action: the policy's own failure
RESERVED_RESET = frozenset({"seed", "episode_id"})  # reset arguments the adapter sets itself


class OpenEnvError(RuntimeError):
    """The environment's server could not be started or reached, or broke its protocol (the message says how)."""


class _Invalid(Exception):
    """A reply that is no action of this environment (or one its server refused as an action)."""


class _Busy(Exception):
    """The server is at its session limit."""


class OpenEnvEnvironment(FixedSplits, Environment):
    """An OpenEnv environment (see the module's docstring)."""

    name: ClassVar[str] = "openenv"  # each instance: openenv:<name>
    kind: ClassVar[str] = "reasoning"
    source: ClassVar[str] = "an OpenEnv environment server (reset/step over its WebSocket)"
    templated: ClassVar[bool] = True  # prompts come from a generator: seeds keep the splits apart

    def __init__(self, server: str, *, app: str | None = None, url: str | None = None, train_seeds: int = 500,
                 eval_seeds: int = 100, observation_field: str = "message", action_field: str = "message",
                 action_type: Literal["text", "int"] = "text", max_turns: int = 6,
                 reward: Literal["strict", "score"] = "strict", success_reward: float = 1.0,
                 oracle_field: str | None = None, system_prompt: str = "", timeout_s: float = 30.0,
                 reset_options: dict[str, Any] | None = None) -> None:
        where = f"openenv:{server}"
        if (app is None) == (url is None):
            raise ValueError(f"{where}: give exactly one of app (a module:attribute the adapter serves) and url")
        if action_type not in ("text", "int"):
            raise ValueError(f"{where}: action_type must be 'text' or 'int', got {action_type!r}")
        if reward not in ("strict", "score"):
            raise ValueError(f"{where}: reward must be 'strict' or 'score', got {reward!r}")
        for option, value in (("train_seeds", train_seeds), ("eval_seeds", eval_seeds), ("max_turns", max_turns)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {option} must be a whole number of at least 1, got {value!r}")
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: url must start with http:// or https://, got {url!r}")
        if not float(success_reward) > 0 or not float(timeout_s) > 0:
            raise ValueError(f"{where}: success_reward and timeout_s must be above 0, got {success_reward!r} and "
                             f"{timeout_s!r}")
        if train_seeds > EVAL_SEED_BASE:
            raise ValueError(f"{where}: train_seeds must be at most {EVAL_SEED_BASE} (held-out seeds start there)")
        reset_options = {} if reset_options is None else reset_options
        if not isinstance(reset_options, dict) or not all(isinstance(k, str) for k in reset_options) or \
                set(reset_options) & RESERVED_RESET:
            raise ValueError(f"{where}: reset_options must be a table of the server's reset arguments other than "
                             f"{' and '.join(sorted(RESERVED_RESET))}, got {reset_options!r}")
        self.reset_options = dict(reset_options)
        self.name = where  # type: ignore[misc]
        self.app, self._url = app, url.rstrip("/") if url else None
        self.train_seeds, self.eval_seeds = train_seeds, eval_seeds
        self.observation_field, self.action_field, self.action_type = observation_field, action_field, action_type
        self.turn_limit, self.reward_mode, self.success_reward = max_turns, reward, float(success_reward)
        self.oracle_field, self.timeout_s = oracle_field, float(timeout_s)
        self.system_prompt = system_prompt  # type: ignore[misc]
        self._server: subprocess.Popen[bytes] | None = None
        self._server_lock = threading.Lock()
        self._log: str | None = None
        self._socket = ""  # the Unix socket of the server this environment runs
        self._levels: dict[int, dict[str, list[Problem]]] = {}  # each declared level's problems, once listed

    conversational: ClassVar[bool] = True

    @property  # type: ignore[override]
    def max_turns(self) -> int:
        return self.turn_limit

    # --- the server

    def _ensure_server(self) -> str:
        """The Unix socket of the server this environment runs (started now if it is not running)."""
        with self._server_lock:
            if self._server is None or self._server.poll() is not None:
                self._server = self._start()
            return self._socket

    def _start(self) -> subprocess.Popen[bytes]:
        """The package's app under uvicorn, in the rubric worker's jail (read-only file system, no network, its own
        PID namespace), serving on a Unix socket in a folder bound into the jail: the only way in or out."""
        folder = tempfile.mkdtemp(prefix="evertrain-openenv-")
        self._socket = os.path.join(folder, "server.sock")
        parent = os.getpid()
        if self._log:
            with contextlib.suppress(OSError):
                os.unlink(self._log)
        with tempfile.NamedTemporaryFile(prefix="evertrain-openenv-", suffix=".log", delete=False) as log:
            self._log = log.name
            argv = [*jail_argv([], writable=[folder]), sys.executable, "-s", "-m", "uvicorn", str(self.app),
                    "--uds", self._socket, "--log-level", "warning"]
            # from the spawner thread: the parent-death signal fires when the starting THREAD ends
            server = processes.in_spawner(lambda: subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp",
                preexec_fn=lambda: processes.tied_to(parent)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise OpenEnvError(f"{self.name}: the server ({self.app}) exited with status {server.returncode}: "
                                   f"{self._log_tail()}")
            if self._healthy():
                return server
            time.sleep(0.2)
        self._stop(server)
        raise OpenEnvError(f"{self.name}: the server ({self.app}) did not answer within {START_TIMEOUT_S:g} s: "
                           f"{self._log_tail()}")

    def _healthy(self) -> bool:
        """Whether the server answers ``GET /health`` on its socket."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(2)
                probe.connect(self._socket)
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                return probe.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    def _log_tail(self) -> str:
        if not self._log:
            return ""
        with contextlib.suppress(OSError), open(self._log, errors="replace") as log:
            return log.read()[-1500:].strip()
        return ""

    @staticmethod
    def _stop(server: subprocess.Popen[bytes]) -> None:
        processes.stop([server], first=15, timeout=10)

    def close(self) -> None:
        with self._server_lock:
            if self._server is not None:
                self._stop(self._server)
                self._server = None
            if self._log:
                with contextlib.suppress(OSError):
                    os.unlink(self._log)
                self._log = None
            if self._socket:
                shutil.rmtree(os.path.dirname(self._socket), ignore_errors=True)
                self._socket = ""

    # --- the protocol: one WebSocket session per exchange

    def _session(self) -> Any:
        limits = {"open_timeout": self.timeout_s, "close_timeout": 2, "max_size": 16 * 1024 * 1024}
        if self._url is None:  # the server this environment runs, on its socket
            return unix_connect(self._ensure_server(), "ws://localhost/ws", **limits)
        address = self._url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"
        return connect(address, **limits)

    def _ask(self, ws: Any, message: dict[str, Any]) -> dict[str, Any]:
        ws.send(json.dumps(message))
        answer = json.loads(ws.recv(timeout=self.timeout_s))
        if not isinstance(answer, dict) or answer.get("type") == "error":
            data = answer.get("data", {}) if isinstance(answer, dict) else {}
            code = str(data.get("code", "?")) if isinstance(data, dict) else "?"
            text = f"{data.get('message', answer) if isinstance(data, dict) else answer} ({code})"
            if message.get("type") == "step" and code in ACTION_ERRORS:  # the policy's action, refused: its fault
                raise _Invalid(text)
            if code == "CAPACITY_REACHED":
                raise _Busy(text)
            raise OpenEnvError(f"{self.name}: the server refused {message.get('type')}: {text}")
        return answer.get("data", {})

    def _observation_text(self, data: dict[str, Any]) -> str:
        observation = data.get("observation", {})
        value = observation.get(self.observation_field) if isinstance(observation, dict) else None
        if not isinstance(value, str):
            raise OpenEnvError(f"{self.name}: the observation has no text field {self.observation_field!r} "
                               f"(fields: {sorted(observation) if isinstance(observation, dict) else observation})")
        return value

    def _action(self, reply: str) -> dict[str, Any]:
        if self.action_type == "text":
            return {self.action_field: reply}
        numbers = INTEGER.findall(reply)
        if not numbers:
            raise _Invalid("the reply holds no whole number")
        try:
            return {self.action_field: int(numbers[-1])}
        except ValueError:  # more digits than Python converts (4,300): no action of any environment
            raise _Invalid("the reply's number is too long") from None

    def _play(self, reset: dict[str, Any], replies: list[str]) -> tuple[str, list[dict[str, Any]], bool]:
        """:meth:`_play_once`, tried again while the server is at its session limit (``max_concurrent_envs``):
        a busy server is not the policy's failure."""
        for attempt in range(BUSY_TRIES):
            try:
                return self._play_once(reset, replies)
            except _Busy as busy:
                if attempt == BUSY_TRIES - 1:
                    raise OpenEnvError(f"{self.name}: the server stayed at its session limit ({busy}); raise its "
                                       f"max_concurrent_envs") from None
                time.sleep(0.05 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _play_once(self, reset: dict[str, Any], replies: list[str]) -> tuple[str, list[dict[str, Any]], bool]:
        """Reset with ``reset`` (the seed and the level's arguments: :meth:`_reset_data`) and step once per reply
        (stopping at ``done``): (the first observation, the steps, whether a reply was no action)."""
        steps: list[dict[str, Any]] = []
        with self._session() as ws:
            first = self._observation_text(self._ask(ws, {"type": "reset", "data": reset}))
            invalid = False
            for reply in replies:
                try:
                    action = self._action(reply)
                    data = self._ask(ws, {"type": "step", "data": action})
                except _Invalid:
                    invalid = True
                    break
                steps.append({"action": action[self.action_field], "observation": self._observation_text(data),
                              "reward": float(data.get("reward") or 0.0), "done": bool(data.get("done"))})
                if steps[-1]["done"]:
                    break
            with contextlib.suppress(Exception):
                ws.send(json.dumps({"type": "close"}))
        return first, steps, invalid

    # --- problems

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        return self._listing(None)

    # --- the curriculum the package declares

    @cached_property
    def declared_levels(self) -> list[dict[str, Any]] | None:
        """The curriculum the served package declares (``CURRICULUM`` in the app's module or its package, read
        without importing it: each level's ``reset`` arguments over ``reset_options``;
        :mod:`evertrain.envs.declared`), or None (always for a server given as ``url``: its code is not here)."""
        if not self.app:
            return None
        module = self.app.split(":")[0]
        modules = [module] + ([module.split(".")[0]] if "." in module else [])
        return declared.declared_levels(modules, owner=self.name, reserved=RESERVED_RESET)

    def level_pool(self, level: int, split: Split) -> list[Problem]:
        """The training (``train``) or held-out (``eval``) problems of declared ``level`` (each names its level, so
        its episodes are reset with that level's arguments)."""
        declared.level_options(self.declared_levels, level, self.name)
        if level not in self._levels:
            self._levels[level] = self._listing(level)
        return self._levels[level][split]

    def _reset_data(self, payload: dict[str, Any]) -> dict[str, Any]:
        """What a problem's episodes are reset with: its seed, ``reset_options`` and its level's arguments."""
        seed, level = payload.get("seed"), payload.get("level")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError("the problem names no seed")
        extra = {} if level is None else declared.level_options(self.declared_levels, level, self.name)
        return {**self.reset_options, **extra, "seed": seed}

    def _listing(self, level: int | None) -> dict[str, list[Problem]]:
        """Every seed's problem at ``level`` (None: as configured), split into train and held-out seeds."""
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        plan: list[tuple[Split, range]] = [("eval", range(EVAL_SEED_BASE, EVAL_SEED_BASE + self.eval_seeds)),
                                           ("train", range(self.train_seeds))]
        with self._session() as ws:
            for split, seeds in plan:
                for seed in seeds:
                    payload: dict[str, Any] = {"seed": seed} if level is None else {"seed": seed, "level": level}
                    prompt = self._observation_text(self._ask(ws, {"type": "reset",
                                                                   "data": self._reset_data(payload)}))
                    if self.oracle_field:
                        state = self._ask(ws, {"type": "state"})
                        if self.oracle_field not in state:
                            raise OpenEnvError(f"{self.name}: the server's state has no {self.oracle_field!r} "
                                               f"(oracle_field); fields: {sorted(state)}")
                        payload["answer"] = str(state[self.oracle_field])
                    problem = Problem.make(self.name, prompt, payload)
                    splits[split].append(Problem(self.name, problem.id, prompt, payload, split))
            with contextlib.suppress(Exception):
                ws.send(json.dumps({"type": "close"}))
        held_out = {p.prompt for p in splits["eval"]}
        splits["train"] = [p for p in splits["train"] if p.prompt not in held_out]
        if not splits["train"]:
            raise ValueError(f"{self.name}: every train seed's first observation is a held-out one's")
        return splits

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        chat = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*chat, {"role": "user", "content": problem.prompt}]

    # --- episodes and grades

    def reply(self, problem: Problem, turns: list[dict[str, Any]]) -> str | None:
        replies = [str(t.get("content", "")) for t in turns if t.get("role") == "assistant"]
        if len(replies) >= self.max_turns:
            return None
        try:
            _, steps, invalid = self._play(self._reset_data(problem.payload), replies)
        except Exception:  # the server failed: the episode ends here, and its grade says why
            return None
        if invalid or not steps or steps[-1]["done"] or len(steps) < len(replies):
            return None
        return steps[-1]["observation"]

    def episode_text(self, turns: list[dict[str, Any]]) -> str:
        return replies_text(turns)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        try:
            reset = self._reset_data(problem.payload)
        except ValueError as error:
            return Verdict.fail("grader_error", error=str(error))
        replies = replies_of(completion)[:self.max_turns]
        try:
            _, steps, invalid = self._play(reset, replies)
        except Exception as error:  # the server failed: this rollout's grader error
            return Verdict.fail("grader_error", error=f"{type(error).__name__}: {error}"[:500])
        total = sum(step["reward"] for step in steps)
        done = bool(steps) and steps[-1]["done"]
        passed = done and not invalid and total >= self.success_reward
        if self.reward_mode == "strict":
            value = 1.0 if passed else 0.0
        else:
            value = min(1.0, max(0.0, total / self.success_reward)) if self.success_reward > 0 else 0.0
        detail = {"steps": steps, "return": total, "done": done, "replies": len(replies)}
        reason = "correct" if passed else "invalid_action" if invalid else "wrong" if done else "incomplete"
        return Verdict(reward=value, passed=passed, reason=reason, detail=detail)

    def reference(self, problem: Problem) -> str | None:
        """The episode the server's own ``oracle_field`` plays, step by step (None without one)."""
        if not self.oracle_field:
            return None
        replies: list[str] = []
        with self._session() as ws:
            self._ask(ws, {"type": "reset", "data": self._reset_data(problem.payload)})
            for _ in range(self.max_turns):
                expected = self._ask(ws, {"type": "state"}).get(self.oracle_field)
                replies.append(str(expected))
                data = self._ask(ws, {"type": "step", "data": self._action(str(expected))})
                if data.get("done"):
                    break
            with contextlib.suppress(Exception):
                ws.send(json.dumps({"type": "close"}))
        return replies_text([{"role": "assistant", "content": reply} for reply in replies])

    def write_answer(self, answer: str) -> str | None:
        return answer

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        """A problem named by its seed (``{"seed": N}``): the server makes its prompt."""
        seed = data.get("seed") if isinstance(data, dict) else None
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"{self.name}: a problem is {{\"seed\": <whole number>}}")
        for split in ("train", "eval"):
            for problem in self._splits[split]:
                if problem.payload["seed"] == seed:
                    return problem
        raise ValueError(f"{self.name}: seed {seed} is none of this environment's problems")
