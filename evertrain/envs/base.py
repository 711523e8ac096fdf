"""The environment interface: where problems come from and how an answer is verified.

An environment is a domain (``arithmetic``, ``gsm8k``, ``mbpp`` ...). It hands out problems with stable
content-hash ids, turns a problem into chat messages for the policy, and verifies a completion. Every
verifier returns a :class:`Verdict`; a verifier must never raise on a bad completion, only on a bad
problem (a malformed data file is the operator's error, not the policy's).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

# train: what curation draws from; eval: the promotion gate's held-out set; test and transfer: the sealed
# splits that neither curation nor the gate ever sees (transfer: phrasings or operators never trained on)
Split = Literal["train", "eval", "test", "transfer"]
SEALED_SPLITS: tuple[str, ...] = ("test", "transfer")


# a pool larger than this is not indexed by prompt for :meth:`Environment.rebuild` (memory, first-request time)
OWN_PROMPTS_LIMIT = 200_000


def prompt_key(prompt: str) -> str:
    """What makes two prompts one question for :meth:`Environment.rebuild`: Unicode compatibility forms folded,
    invisible format characters dropped, case folded, spacing collapsed; punctuation and operators kept."""
    folded = unicodedata.normalize("NFKC", prompt)
    return " ".join("".join(c for c in folded if unicodedata.category(c) != "Cf").casefold().split())


def problem_id(env: str, payload: dict[str, Any]) -> str:
    """Stable content hash of a problem: the same content always gets the same id."""
    blob = json.dumps({"env": env, "payload": payload}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Problem:
    """One instance: the prompt the policy sees plus what the verifier needs."""

    env: str
    id: str
    prompt: str
    payload: dict[str, Any]
    split: Split = "train"

    @classmethod
    def make(cls, env: str, prompt: str, payload: dict[str, Any], split: Split = "train") -> Problem:
        return cls(env=env, id=problem_id(env, {"prompt": prompt, **payload}), prompt=prompt,
                   payload=payload, split=split)


@dataclass
class Verdict:
    """The grade of one completion. ``reason`` is a short machine-readable code."""

    reward: float
    passed: bool
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fail(cls, reason: str, **detail: Any) -> Verdict:
        return cls(reward=0.0, passed=False, reason=reason, detail=detail)

    @classmethod
    def ok(cls, reason: str = "correct", **detail: Any) -> Verdict:
        return cls(reward=1.0, passed=True, reason=reason, detail=detail)


@dataclass
class ToolResult:
    """What a tool returned to the policy: its text, and whether the call failed (an error the policy may fix)."""

    output: str
    error: bool = False


class Tool(ABC):
    """A tool the policy may call between turns. ``run`` must never raise on what the call contains."""

    name: ClassVar[str]
    description: ClassVar[str]

    @abstractmethod
    def run(self, call: str, problem: Problem) -> ToolResult:
        """Execute ``call`` (the text inside the tool tags) for ``problem``."""

    def run_after(self, earlier: list[str], call: str, problem: Problem) -> ToolResult:
        """Execute ``call`` in an episode whose earlier calls of this tool were ``earlier``. A stateless tool
        ignores them; a stateful one (the terminal) replays them first. Both rollout loops call this."""
        return self.run(call, problem)


def earlier_calls(turns: Sequence[Mapping[str, Any]], tool: str) -> list[str]:
    """The inputs of an episode's earlier calls of ``tool``, in order (what :meth:`Tool.run_after` is given)."""
    return [t["input"] for t in turns if t["role"] == "tool" and t["name"] == tool]


REPLIES = "replies"  # the key of a conversational episode's graded text: the policy's replies, in order


def replies_text(turns: Sequence[Mapping[str, Any]]) -> str:
    """The graded text of a conversational episode: the policy's own replies, in order, as JSON. Nothing the
    environment said is in it: grading replays the environment with these replies, so no text of a rollout can
    stand in for what the environment said."""
    return json.dumps({REPLIES: [str(t.get("content", "")) for t in turns if t.get("role") == "assistant"]},
                      ensure_ascii=False)


def replies_of(completion: str) -> list[str]:
    """The policy's replies in :func:`replies_text`'s text; any other text is one reply."""
    if completion.startswith("{"):
        try:
            data = json.loads(completion)
        except ValueError:
            data = None
        if isinstance(data, dict) and set(data) == {REPLIES} and isinstance(data[REPLIES], list) and \
                all(isinstance(r, str) for r in data[REPLIES]):
            return list(data[REPLIES])
    return [completion]


class Environment(ABC):
    """A domain of verifiable problems. Subclasses set the class attributes and implement three methods.

    Agentic environments also set ``tools`` (name -> Tool) and ``max_turns``: the policy calls a tool by
    writing ``<tool_name>input</tool_name>`` and ending its turn; the rollout runs the tool, appends its
    output as a ``tool`` message, and lets the policy continue, until it answers without a tool call or
    reaches ``max_turns`` assistant turns. ``verify`` then grades the whole transcript's final answer.
    """

    name: ClassVar[str]
    kind: ClassVar[str]  # "math", "code", "tool" ...
    source: ClassVar[str]  # where problems come from: "generated", a vendored file ...
    system_prompt: ClassVar[str] = ""
    # worked examples shown as earlier chat turns: (user, assistant) pairs
    examples: ClassVar[tuple[tuple[str, str], ...]] = ()
    # problems stamped from templates (generators): they differ in a few numbers or words, so word n-gram
    # near-duplicate and contamination checks would flag them all; their exact ids keep the splits apart
    templated: ClassVar[bool] = False
    # agentic environments: the tools the policy may call, and how many assistant turns it gets
    tools: ClassVar[dict[str, Tool]] = {}
    max_turns: ClassVar[int] = 1

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"environment {self.name!r} takes no options, got {sorted(options)}")

    @abstractmethod
    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """``n`` problems of ``split``, deterministic in ``seed``. Train and eval never share a problem."""

    def count(self, split: Split) -> int | None:
        """How many problems ``split`` holds, or None when they are generated without end."""
        return None

    def sealed_problems(self, split: Split, n: int, seed: int, gate: int) -> list[Problem]:
        """``n`` problems of a sealed split ("test" or "transfer"), never among the gate's first ``gate``.

        By default the test split is the far end of the held-out pool, read backwards, so it stays the same
        when the gate's size changes (a pool generated without end: the problems after the gate's). An
        environment without phrasings or operators of its own to hold out has no transfer split.
        """
        if split == "transfer" or n <= 0:
            return []
        if split != "test":
            raise ValueError(f"{self.name}: {split!r} is not a sealed split; sealed splits: {SEALED_SPLITS}")
        total = self.count("eval")
        try:
            pool = self.problems("eval", gate + n if total is None else total, seed)
        except ValueError:  # a fixed pool smaller than asked: whatever lies beyond the gate
            pool = self.problems("eval", gate, seed) if total is None else []
        rest = pool[gate:]
        chosen = rest[:n] if total is None else rest[::-1][:n]
        return [replace(p, split="test") for p in chosen]

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The chat the policy answers: system prompt, worked examples, then the problem."""
        chat: list[dict[str, str]] = []
        if self.system_prompt:
            chat.append({"role": "system", "content": self.system_prompt})
        for user, assistant in self.examples:
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        chat.append({"role": "user", "content": problem.prompt})
        return chat

    def guided_messages(self, problem: Problem) -> list[dict[str, str]]:
        """:meth:`messages`, with the frontier's guidance (the payload's ``guidance``, only ever on curated training
        problems): a hint after the problem in the last user message, and a partial answer the policy continues
        (an assistant message left open)."""
        chat = self.messages(problem)
        guidance = problem.payload.get("guidance")
        if not isinstance(guidance, dict):
            return chat
        if guidance.get("hint"):
            chat = [*chat[:-1], {**chat[-1], "content": f"{chat[-1]['content']}\n\n{guidance['hint']}"}]
        if guidance.get("prefix"):  # the start of the answer, written for the policy: it continues from there
            chat = [*chat, {"role": "assistant", "content": guidance["prefix"]}]
        return chat

    # multi-turn environments whose other side is not a tool but the environment itself (a game, a simulated
    # user: a verifiers package's own environment): after each policy turn it says something (:meth:`reply`), and
    # the policy answers, until it has nothing more to say or ``max_turns`` policy turns were taken
    conversational: ClassVar[bool] = False

    def reply(self, problem: Problem, turns: list[dict[str, Any]]) -> str | None:
        """What a conversational environment says after the policy's last turn in ``turns`` (the episode's turns
        after the prompt, in order); None: the episode is over. Must never raise on what the turns contain."""
        return None

    def close(self) -> None:
        """Stop what this environment started (a worker, a server); the campaign's context calls it as it closes.
        A later use starts it again. Default: nothing started, nothing to stop."""
        return None

    # guidance (evertrain.frontier): how many hint levels this environment can state, the strongest last
    hint_levels: ClassVar[int] = 0

    def problem_kind(self, problem: Problem) -> str:
        """The kind ``problem`` belongs to in the frontier's statistics (:mod:`evertrain.frontier`): problems of
        one kind are expected to be about as hard for the policy. Default: the problem itself (fixed pools, where
        a problem comes back); generators override it with what makes their problems hard."""
        return problem.id

    def hint(self, problem: Problem, level: int) -> str | None:
        """A hint at ``level`` (1 to :attr:`hint_levels`, stronger as it rises), added to the problem's message, that
        makes ``problem`` reachable without stating its final answer; None: no hint at that level."""
        return None

    def answer_prefix(self, problem: Problem, level: int) -> str | None:
        """The start of an answer at ``level`` (a partial solution, never the final answer), written for the policy,
        which continues it; single-turn environments only. None: none at that level."""
        return None

    @abstractmethod
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Grade ``completion``. Never raises because of what the completion contains."""

    # whether :meth:`verify_probes` grades together (cheaper than one by one): the self-test then uses it too
    probes_together: bool = False

    def verify_probes(self, items: list[tuple[Problem, str]]) -> list[Verdict]:
        """:meth:`verify` of each ``(problem, completion)``, for the project's own probe completions (the quality
        check's, :func:`evertrain.envs.quality.probe`), never a policy's: an environment may grade them together
        (reasoning-gym batches its sandboxed scorer runs). May raise where :meth:`verify` would not: the caller
        grades one by one then."""
        return [self.verify(problem, completion) for problem, completion in items]

    def reference(self, problem: Problem) -> str | None:
        """A completion that must earn reward 1 (used to validate the environment), if one exists."""
        return None

    def hack_completions(self, problem: Problem) -> list[str]:
        """Completions specific to this environment that must earn 0 (validation adds generic ones)."""
        return []

    # --- the verifier self-test (evertrain.envs.quality.validate); override to plug an environment in

    def known_good(self, problem: Problem) -> list[str]:
        """Completions that must earn reward 1 (default: the reference, when there is one)."""
        reference = self.reference(problem)
        return [] if reference is None else [reference]

    def known_bad(self, problem: Problem, other: Problem | None) -> list[tuple[str, str]]:
        """(label, completion) pairs that must earn exactly 0, specific to this environment; ``other`` is
        another problem of the same environment. The self-test adds the generic battery (empty, nan,
        0, 1, another problem's answer, the question restated, hedges, over-long numbers) to these."""
        return [("hack", completion) for completion in self.hack_completions(problem)]

    def probe_completions(self, problem: Problem) -> list[tuple[str, str]]:
        """(probe, completion) pairs of this environment's own for the quality check
        (:func:`evertrain.envs.quality.probe`): wrong answers shaped for it (move sprays, symlinked files ...)."""
        return []

    def oracle_answer(self, problem: Problem) -> str | None:
        """The expected final answer as text, when the problem has one (the self-test builds wrong answers)."""
        answer = problem.payload.get("answer")
        return None if answer is None or isinstance(answer, (dict, list)) else str(answer)

    def write_answer(self, answer: str) -> str | None:
        """A completion whose final answer is ``answer``; None when this environment grades no final answer
        (code), so the self-test's answer battery does not apply and ``known_bad`` carries the battery."""
        return "#### " + answer if self.kind in ("math", "reasoning", "tool") else None

    def rebuild(self, problem: Problem) -> Problem | None:
        """``problem`` as this environment itself sets it: everything its verifier checks against (the answer,
        the tests, the workspace) from its own generator or data set, nothing from whoever sent it; None when it
        cannot vouch for the problem. A client names a task with its own answer; the endpoint grades, and curation
        trains, on this instead (:mod:`evertrain.serving`), so a claimed wrong answer steers nothing.

        Default: the environment's own problem (train or held-out) with the same prompt, up to Unicode forms,
        invisible characters, case and spacing (punctuation counts: "12 + 7" is not "12 - 7"), for environments
        whose pools are finite (a data set, an enumerated generator); None for one generated without end.
        Override where the prompt alone determines the answer (``calculator`` computes it)."""
        index = self._own_prompts
        return None if index is None else index.get(prompt_key(problem.prompt))

    @property
    def _own_prompts(self) -> dict[str, Problem] | None:
        """The environment's own problems of finite pools by :func:`prompt_key` (built once per instance)."""
        if "_own_prompts_index" not in self.__dict__:
            index: dict[str, Problem] | None = {}
            for split in ("train", "eval"):
                total = self.count(split)
                if total is None or total > OWN_PROMPTS_LIMIT:
                    index = None
                    break
                for own in self.problems(split, total, 0):
                    index.setdefault(prompt_key(own.prompt), own)
            self.__dict__["_own_prompts_index"] = index
        return self.__dict__["_own_prompts_index"]

    def parse_problem(self, data: dict[str, Any]) -> Problem:
        """A problem from its JSON form (``evertrain score`` input); ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"problem must be a JSON object, not {type(data).__name__}")
        prompt = data.get("prompt", data.get("question", ""))
        if not isinstance(prompt, str):
            raise ValueError("problem.prompt must be a string")
        payload = {k: v for k, v in data.items() if k not in ("prompt", "question")}
        return Problem.make(self.name, prompt, payload)


class FixedSplits:
    """For environments whose problems are a fixed data set, split once (``self._splits``) into train and
    held-out problems: the held-out ones are served in a stable order, the train ones as a seeded sample."""

    _splits: dict[str, list[Problem]]

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        pool = self._splits[split]
        if split == "eval":
            return pool[:n]
        return random.Random(seed).sample(pool, min(n, len(pool)))

    def count(self, split: Split) -> int | None:
        return len(self._splits[split])


def vendored_path(*parts: str) -> Path:
    """A file of the data sets vendored in the project's ``data/`` folder (override: EVERTRAIN_DATA_DIR)."""
    root = Path(os.environ.get("EVERTRAIN_DATA_DIR", Path(__file__).resolve().parents[2] / "data"))
    path = root.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"vendored data file {path} is missing: is this a complete checkout?")
    return path
