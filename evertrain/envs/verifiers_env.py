"""``verifiers:<taskset>``: a taskset written for Prime Intellect's ``verifiers`` (0.4.0, its ``verifiers.v1`` API) as
an evertrain environment, its reward functions as the verifier.

Name it as verifiers does (``verifiers:vf-sums`` loads the importable module ``vf_sums``, whose ``__all__`` names
one ``vf.Taskset``); every option that is not evertrain's own (below) is a field of the taskset's config
(``TasksetConfig``): ``options = {num_tasks = 400, digits = 2}``.

- **Problems**: the taskset's tasks as ``load()`` yields them, each a problem whose id is its content hash.
  Verifiers 0.4 has no eval dataset of its own, so the held-out split is fixed by content: a task is held out
  when the hash of its data (all but its index) falls in ``eval_share`` of the hash space (the same task is
  always on the same side; train and held-out never share one).
- **Messages**: the task's system prompt and prompt, as the taskset wrote them (no worked examples added).
- **Grading**: the task's own reward functions (``@vf.reward``), in the rubric worker
  (:mod:`evertrain.sandbox.verifiers_worker`: a bubblewrap jail without network, one forked child per grade
  under memory, CPU and time limits), on the transcript system, prompt, completion. ``reward = "strict"`` (the
  default): 1 when every reward of positive weight is at its full 1.0, else 0; ``"score"``: the weighted sum over
  the sum of positive weights, in [0, 1]. ``passed`` is full credit in both. Each reward and metric is kept in
  the verdict's detail (the rollouts' ``detail`` column). A reward function that raises, hangs or runs out of
  memory gives that rollout a ``grader_error``.
- **Audited before it trains**: the verifier self-test (``evertrain envs --validate``, and every campaign before
  its first iteration) writes answers in the taskset's format (``answer_format``) from the task's
  ``answer_field`` and checks that hedges, the question echoed, wrong and empty answers earn 0. A rubric that
  pays one is refused for training, unless the config accepts that probe by name (``accept = ["hedge"]``).
- **Levels**: a package may declare its curriculum, a literal ``CURRICULUM`` list of taskset field tables in its
  module (:mod:`evertrain.envs.declared`); level k is the taskset with the k-th table over the configured fields,
  its own tasks and rubric worker, and each of its problems names its level (``payload["level"]``).

evertrain's own options: ``path`` (a folder put first on the import path, for a package not installed),
``eval_share`` (0.2), ``reward`` ("strict"), ``answer_field`` ("answer"), ``answer_format`` ("boxed", "hashes"
or "plain"), ``accept`` ([]), ``templated`` (False: tasks stamped from templates skip the near-duplicate
checks), ``timeout_s`` (10) and ``memory_mb`` (2048) of each grade.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import threading
from functools import cached_property
from typing import Any, ClassVar, Literal

from evertrain.envs import declared
from evertrain.envs.base import Environment, FixedSplits, Problem, Split, Verdict, replies_of, replies_text
from evertrain.sandbox.verifiers_worker import LISTING_LIMIT, RubricError, RubricWorker

PREFIX = "verifiers:"
OWN_OPTIONS = ("path", "eval_share", "reward", "answer_field", "answer_format", "accept", "templated", "timeout_s",
               "memory_mb", "max_turns")
FORMATS = ("boxed", "hashes", "plain")
_WORKERS: dict[tuple[str, str, str | None], tuple[Any, set[int]]] = {}  # the worker and who uses it
_WORKERS_LOCK = threading.Lock()


@atexit.register
def _close_workers() -> None:
    for worker, _ in list(_WORKERS.values()):
        worker.close()


class VerifiersEnvironment(FixedSplits, Environment):
    """A verifiers taskset (see the module's docstring)."""

    name: ClassVar[str] = "verifiers"  # each instance: verifiers:<taskset>
    kind: ClassVar[str] = "reasoning"
    source: ClassVar[str] = "a verifiers taskset (its package's load())"

    def __init__(self, taskset: str, *, path: str | None = None, eval_share: float = 0.2,
                 reward: Literal["strict", "score"] = "strict", answer_field: str = "answer",
                 answer_format: str = "boxed", accept: list[str] | tuple[str, ...] = (), templated: bool = False,
                 timeout_s: float = 10.0, memory_mb: int = 2048, max_turns: int = 6, **knobs: Any) -> None:
        if not taskset or not isinstance(taskset, str):
            raise ValueError("a verifiers environment is named verifiers:<taskset id>, e.g. verifiers:vf-sums")
        if not 0.0 < float(eval_share) < 1.0:
            raise ValueError(f"verifiers:{taskset}: eval_share must lie between 0 and 1, got {eval_share!r}")
        if reward not in ("strict", "score"):
            raise ValueError(f"verifiers:{taskset}: reward must be 'strict' or 'score', got {reward!r}")
        if answer_format not in FORMATS:
            raise ValueError(f"verifiers:{taskset}: answer_format must be one of {', '.join(FORMATS)}, "
                             f"got {answer_format!r}")
        if not isinstance(accept, (list, tuple)) or not all(isinstance(a, str) for a in accept):
            raise ValueError(f"verifiers:{taskset}: accept must be a list of probe names, got {accept!r}")
        self.name = PREFIX + taskset  # type: ignore[misc]
        self.taskset, self.path, self.knobs = taskset, path, knobs
        self.eval_share, self.reward_mode = float(eval_share), reward
        self.answer_field, self.answer_format = answer_field, answer_format
        self.accepted_probes = frozenset(accept)
        self.templated = bool(templated)  # type: ignore[misc]
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        if not self.timeout_s > 0 or self.memory_mb < 64:
            raise ValueError(f"verifiers:{taskset}: timeout_s must be above 0 and memory_mb at least 64, got "
                             f"{timeout_s!r} and {memory_mb!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"verifiers:{taskset}: max_turns must be a whole number of at least 1, got {max_turns!r}")
        self.turn_limit = max_turns
        # evertrain's own options, as a level's environment (the same taskset, other fields) is built with them
        self._own: dict[str, Any] = {"eval_share": eval_share, "reward": reward, "answer_field": answer_field,
                                     "answer_format": answer_format, "accept": list(accept), "templated": templated,
                                     "timeout_s": timeout_s, "memory_mb": memory_mb, "max_turns": max_turns}
        self._levels: dict[int, VerifiersEnvironment] = {}

    # a package that brings its own vf.Env (its run speaks between the policy's turns) is multi-turn: known once
    # its tasks are listed (the worker loads the package)
    @property
    def multi_turn(self) -> bool:
        return bool(self._listing["multi_turn"])

    @property  # type: ignore[override]
    def conversational(self) -> bool:
        return self.multi_turn

    @property  # type: ignore[override]
    def max_turns(self) -> int:
        return self.turn_limit if self.multi_turn else 1

    @property
    def worker(self) -> Any:
        """The rubric worker of this taskset and config, one per process: environments built twice share it, and
        it stops when the last of them closes."""
        key = (self.taskset, json.dumps(self.knobs, sort_keys=True), self.path)
        with _WORKERS_LOCK:
            if key not in _WORKERS:
                _WORKERS[key] = (RubricWorker(self.taskset, self.knobs, self.path), set())
            worker, users = _WORKERS[key]
            users.add(id(self))
            return worker

    def close(self) -> None:
        """Stop the rubric worker once no other environment of this taskset and config uses it (a later grade
        starts it again), and those of the levels built from this environment."""
        for level in self._levels.values():
            level.close()
        key = (self.taskset, json.dumps(self.knobs, sort_keys=True), self.path)
        with _WORKERS_LOCK:
            if key not in _WORKERS:
                return
            worker, users = _WORKERS[key]
            users.discard(id(self))
            if users:
                return
            del _WORKERS[key]
        worker.close()

    @cached_property
    def _listing(self) -> dict[str, Any]:
        reply = self.worker.request({"op": "tasks"}, timeout_s=120.0, limit=LISTING_LIMIT)
        if not reply.get("ok"):
            raise RubricError(f"{self.name}: the taskset's tasks could not be listed: {reply.get('error')}")
        return reply

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        reply = self._listing
        splits: dict[str, list[Problem]] = {"train": [], "eval": []}
        for task in reply["tasks"]:
            data = task["data"]
            messages = _initial_messages(data)
            users = [m for m in messages if m.get("role") == "user"]
            if not users:
                continue  # a task whose user does not speak first: a multi-turn protocol this adapter lacks
            prompt = str(users[-1].get("content", ""))
            payload: dict[str, Any] = {"key": task["key"], "messages": messages}
            answer = data.get(self.answer_field)
            if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
                payload["answer"] = str(answer)
            # the split follows the task's content (its data but the index load() gave it): the same task, or the
            # same prompt with the same hidden data, is always on one side
            content = json.dumps({k: v for k, v in data.items() if k != "idx"}, sort_keys=True, ensure_ascii=False)
            digest = int(hashlib.sha256(content.encode()).hexdigest(), 16)
            split: Split = "eval" if digest % 10_000 < self.eval_share * 10_000 else "train"
            problem = Problem.make(self.name, prompt, payload)
            splits[split].append(Problem(self.name, problem.id, prompt, payload, split))
        for split, problems in splits.items():
            if not problems:
                raise ValueError(f"{self.name}: the taskset yielded no {split} problems "
                                 f"({len(reply['tasks'])} tasks, eval_share {self.eval_share})")
        splits["eval"].sort(key=lambda p: p.id)  # a stable order, whatever order load() yields in
        return splits

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [dict(m) for m in problem.payload["messages"]]

    # --- the curriculum the package declares

    @cached_property
    def declared_levels(self) -> list[dict[str, Any]] | None:
        """The curriculum the taskset's package declares (``CURRICULUM`` in its module, read without importing it:
        each level's taskset fields over the configured ones; :mod:`evertrain.envs.declared`), or None."""
        return declared.declared_levels([self.taskset.replace("-", "_")], self.path, owner=self.name,
                                        reserved=frozenset(OWN_OPTIONS))

    def at_level(self, level: int) -> VerifiersEnvironment:
        """The taskset at declared ``level``: its fields over the configured ones, its own tasks and rubric worker."""
        options = declared.level_options(self.declared_levels, level, self.name)
        if level not in self._levels:
            self._levels[level] = VerifiersEnvironment(self.taskset, path=self.path, **self._own,
                                                       **{**self.knobs, **options})
        return self._levels[level]

    def level_pool(self, level: int, split: Split) -> list[Problem]:
        """The training (``train``) or held-out (``eval``) problems of declared ``level``, as this environment's:
        each names its level, so this environment grades it with that level's tasks."""
        pool = []
        for problem in self.at_level(level)._splits[split]:
            payload = {**problem.payload, "level": level}
            made = Problem.make(self.name, problem.prompt, payload)
            pool.append(Problem(self.name, made.id, problem.prompt, payload, split))
        return pool

    def _at(self, problem: Problem) -> VerifiersEnvironment:
        level = problem.payload.get("level")
        return self if level is None else self.at_level(level)

    def reply(self, problem: Problem, turns: list[dict[str, Any]]) -> str | None:
        """The package's environment, replayed with the policy's replies so far: what it says next (None: over)."""
        replies = [str(t.get("content", "")) for t in turns if t.get("role") == "assistant"]
        if not self.multi_turn or len(replies) >= self.max_turns:
            return None
        answer = self._request(problem, {"op": "episode", "opening": problem.payload.get("messages", []),
                                         "replies": replies, "score": False})
        if not answer.get("ok") or answer.get("ended"):
            return None  # an environment that fails to answer ends the episode; the grade then says why
        said = answer.get("next")
        return said if isinstance(said, str) else None

    def episode_text(self, turns: list[dict[str, Any]]) -> str:
        """The graded text of an episode: the policy's replies alone (multi-turn: as JSON, the environment's own
        messages are made again by the environment when it is graded, never read from the rollout)."""
        if not self.multi_turn:
            replies = [str(t.get("content", "")) for t in turns if t.get("role") == "assistant"]
            return replies[-1] if replies else ""
        return replies_text(turns)

    def _request(self, problem: Problem, request: dict[str, Any]) -> dict[str, Any]:
        key = problem.payload.get("key")
        if not isinstance(key, str):
            return {"ok": False, "error": "the problem names no task of the taskset"}
        try:
            worker = self._at(problem).worker  # a level's problem: that level's tasks
        except ValueError as error:
            return {"ok": False, "error": str(error)}
        return worker.request({**request, "key": key, "timeout_s": self.timeout_s, "memory_mb": self.memory_mb},
                                   timeout_s=self.timeout_s + 2.0)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        try:
            multi_turn = self.multi_turn
        except Exception as error:  # the taskset cannot be loaded: this rollout's grader error, not the batch's
            return Verdict.fail("grader_error", error=f"{type(error).__name__}: {error}"[:500])
        if multi_turn:  # the episode replayed from the policy's replies, then its transcript scored
            replies = replies_of(completion)[:self.max_turns]
            reply = self._request(problem, {"op": "episode", "opening": problem.payload.get("messages", []),
                                            "replies": replies, "score": True})
        else:
            transcript = [*problem.payload.get("messages", []), {"role": "assistant", "content": completion}]
            reply = self._request(problem, {"op": "score", "messages": transcript})
        if not reply.get("ok"):
            return Verdict.fail("grader_error", error=str(reply.get("error"))[:500])
        rewards = {name: (float(score), float(weight)) for name, (score, weight) in reply["rewards"].items()}
        full = sum(weight for _, weight in rewards.values() if weight > 0)
        passed = full > 0 and all(score >= 1.0 for score, weight in rewards.values() if weight > 0) and \
            all(score <= 0.0 for score, weight in rewards.values() if weight < 0)
        if self.reward_mode == "strict":
            value = 1.0 if passed else 0.0
        else:
            value = min(1.0, max(0.0, float(reply["reward"]) / full)) if full > 0 else 0.0
            value = value if math.isfinite(value) else 0.0
        detail = {"rewards": {name: score for name, (score, _) in rewards.items()},
                  "weights": {name: weight for name, (_, weight) in rewards.items()},
                  "metrics": reply.get("metrics", {}), "verifiers_reward": reply["reward"]}
        if self.multi_turn:
            detail["turns"] = sum(m.get("role") == "assistant" for m in reply.get("messages", []))
        reason = "correct" if passed else ("partial" if value > 0 else "wrong")
        return Verdict(reward=value, passed=passed, reason=reason, detail=detail)

    def write_answer(self, answer: str) -> str | None:
        if self.answer_format == "boxed":
            return f"The answer is \\boxed{{{answer}}}."
        if self.answer_format == "hashes":
            return f"#### {answer}"
        return answer

    def reference(self, problem: Problem) -> str | None:
        answer = problem.payload.get("answer")
        return None if answer is None else self.write_answer(str(answer))

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        """A problem named by its prompt: the taskset's own task with that prompt (its key and messages from the
        taskset, never from the sender)."""
        prompt = data.get("prompt", data.get("question", "")) if isinstance(data, dict) else None
        if not isinstance(prompt, str):
            raise ValueError("problem.prompt must be a string")
        own = self.rebuild(Problem(self.name, "", prompt, {}))
        if own is None:
            raise ValueError(f"{self.name}: no task of the taskset has this prompt")
        return own


def _initial_messages(data: dict[str, Any]) -> list[dict[str, str]]:
    """A task's opening messages: its system prompt, then its prompt (a string: one user message)."""
    messages: list[dict[str, str]] = []
    if data.get("system_prompt"):
        messages.append({"role": "system", "content": str(data["system_prompt"])})
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list):
        for message in prompt:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                messages.append({"role": str(message.get("role", "user")), "content": message["content"]})
    return messages
