"""Curricula: each environment's difficulty level moves with the model.

A generator with one fixed difficulty runs out of problems the model can learn from: once it solves them
all (the agent campaign reaches 1.00 on ``calculator`` in its second iteration) every group rewards 1 and
GRPO learns nothing, and what lies just beyond the trained range stays out of reach. So every environment
that can be made harder or easier has a ladder of levels (:func:`ladder_for`), and curate draws its
training problems at the environment's current level. An environment declares its ladder by registering it for
its class (:func:`register_ladder`), so a package outside the project can ship an environment with its own
curriculum; one without a registered ladder that counts its training problems gets bands of pass-rate history.

The levels
----------

- ``arithmetic``: 0 is the configured generator; then operands up to twice the configured top, negative
  results (subtraction, unless it is held out as a transfer operator), up to ten times, up to a hundred
  times the top (operators held out for the transfer split are never trained on at any level).
- ``calculator``: 0 is the configured generator; then two more digits, three operands, three operands with
  more digits, four operands with more digits (one tool call still does it all).
- ``terminal``: 0 is one generated command that creates, moves, copies, deletes, searches or prints files
  (:mod:`evertrain.envs.terminal_levels`); 1 the vendored one-command tasks; 2 all vendored training tasks,
  the multi-step code fixes included (what the environment trained on before).
- ``rg:<generator>``: level k sets every attribute of reasoning-gym's own curriculum for the generator
  (``reasoning_gym.factory.create_curriculum``) to min(k, its last level), in its inclusive ranges (level 0
  is the curriculum's easiest, often easier than the generator's defaults). A generator without a
  curriculum, or whose ``config`` option sets a field the curriculum moves, keeps its configured difficulty.
- fixed pools (GSM8K, MBPP, SQL, any environment that counts its training problems): bands of measured
  pass-rate history. The level orders the candidates: 0 prefers problems solved at least half the time
  before, 1 (the start) takes them as drawn, 2 prefers problems solved less than half the time; unmeasured
  problems come after the band's own.

When it moves
-------------

A level advances when the pass rate of its most recent ``curriculum.window`` groups (scored since the level
was entered) is above ``band_high`` and retreats when it is below ``band_low``; in between it holds, and it
never moves on fewer groups than the window. The defaults, 0.2 and 0.8 over 16 groups, follow from what GRPO
trains on: a group teaches only when its rewards disagree, and for G samples at pass rate p that happens with
probability 1 - p^G - (1-p)^G, which is highest at p = 0.5 and falls off steeply only near 0 and 1 (with
G = 8 it is still 0.83 at p = 0.2 or 0.8, but 0.57 at 0.9 and 0.17 at 0.98). A band of 0.2-0.8 keeps the
level where most groups carry signal, and is wide enough that the window's noise (the standard error of a
pass rate over 16 groups is about 0.1 at p = 0.5) does not make the level jump back and forth.

A level whose answers the turn limit cuts off is never climbed: when curate first runs in a process, 16 reference
episodes of every level (seeded: the same every time) are tokenized with the campaign's tokenizer, and the ladder
stops below the first level where more than half need more tokens a turn (a tool call, the final answer line) than
the environment's ``max_new_tokens`` (:func:`reachable_top`). The cap is logged, stored with the level's reason
and sent to MLflow as ``curriculum_capped_<env>``. (The agent campaign, at 24 tokens a turn, could not close a
level-3 call.)

The level of every iteration and environment is a row in the store's ``curriculum`` table, written by curate
(replacing a rerun's rows) from earlier iterations only: a rerun of curate, or a campaign resumed after a
SIGKILL, computes the same level. Curate's metrics carry ``curriculum_level_<env>`` to MLflow.

With the adaptive mix
---------------------

The two act on different things and do not fight: the curriculum chooses WHICH problems an environment
gives (its level, so its pass rate sits in the band), the mix (:mod:`evertrain.mix`) chooses HOW MANY each
environment gets, by its learnability at its current level. An environment whose curriculum keeps it in the
band stays learnable and keeps its share; one at its top level that the model has mastered (pass rate above
the band, nowhere to go) loses share to the others, and one at level 0 still too hard loses share too,
but never below the mix's floor, so it is still measured and its level can move.

The broad sealed set
--------------------

Today's sealed splits sample the configured difficulty, so what is learned at higher levels would go
unmeasured. With ``curriculum.broad_per_level = n``, the campaign's first curate draws n problems of every
level of every environment (and n of its transfer split: phrasings never trained on), minus the gate's, and
stores them in ``broad_sealed``. They never change, curation refuses them (rule ``contaminated``), the gate
never sees them, and promote measures the base model and every new champion on them beside the test and
transfer splits (``evals.split = 'broad'``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from evertrain.data.store import now, to_json
from evertrain.envs.base import Environment, Problem, replies_of
from evertrain.envs.declared import describe as describe_options
from evertrain.envs.quality import NgramIndex
from evertrain.envs.reasoning_gym import ReasoningGym
from evertrain.envs.terminal_levels import task_names

if TYPE_CHECKING:
    from evertrain.config import CampaignConfig

History = Callable[[list[str]], dict[str, float]]  # problem ids -> measured pass rate (only those measured)


class Ladder(ABC):
    """An environment's difficulty levels, 0 (easiest) to ``levels - 1``."""

    start: int = 0

    def __init__(self, env: Environment) -> None:
        self.env = env

    @property
    @abstractmethod
    def levels(self) -> int:
        """How many levels there are."""

    @abstractmethod
    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        """About ``n`` training candidates at ``level``, deterministic in ``seed`` (curation filters them)."""

    @abstractmethod
    def describe(self, level: int) -> str:
        """What ``level`` asks, in a few words."""

    def broad(self, level: int, n: int, seed: int) -> list[Problem]:
        """``n`` problems of ``level`` for the broad sealed set (default: training candidates of that level)."""
        return self.problems(level, n, seed, lambda ids: {})[:n]

    def gate(self, level: int, n: int, seed: int) -> list[Problem] | None:
        """``n`` of the gate's problems at ``level``, drawn with ``seed`` (``eval.levels = 'curriculum'``), or None
        where the environment's own held-out pool stands for the level (default: level 0, the configured one)."""
        return None if level == 0 else self.broad(level, n, seed)

    def check(self, level: int) -> None:
        if not 0 <= level < self.levels:
            raise ValueError(f"{self.env.name}: curriculum level {level} is outside 0..{self.levels - 1}")


class SpecLadder(Ladder):
    """A ladder of generator settings: level 0 (spec None) is the environment as configured, every higher level
    a spec its subclass generates problems from."""

    specs: list[Any]

    @property
    def levels(self) -> int:
        return len(self.specs)

    def describe(self, level: int) -> str:
        spec = self.specs[level]
        return self.describe_configured() if spec is None else self.describe_spec(spec)

    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        self.check(level)
        spec = self.specs[level]
        if spec is None:
            return self.env.problems("train", n, seed)
        return self.generate(level, spec, n, seed)

    @abstractmethod
    def describe_configured(self) -> str: ...

    @abstractmethod
    def describe_spec(self, spec: Any) -> str: ...

    @abstractmethod
    def generate(self, level: int, spec: Any, n: int, seed: int) -> list[Problem]: ...


class ArithmeticLadder(SpecLadder):
    def __init__(self, env: Any) -> None:
        super().__init__(env)
        extra = [op for op in ("-",) if op not in env.ops and op not in env.transfer_ops]
        wider = list(env.ops) + extra
        top = env.high
        specs: list[tuple[int, int, tuple[str, ...]] | None] = [
            None, (env.low, 2 * top, tuple(env.ops)), (env.low, 2 * top, tuple(wider)),
            (env.low, 10 * top, tuple(wider)), (max(env.low, top), 100 * top, tuple(wider))]
        self.specs = [s for i, s in enumerate(specs) if i == 0 or s != specs[i - 1]]

    def describe_configured(self) -> str:
        return f"configured: {self.env.low}..{self.env.high}, ops {''.join(self.env.ops)}"

    def describe_spec(self, spec: Any) -> str:
        return f"{spec[0]}..{spec[1]}, ops {''.join(spec[2])}"

    def generate(self, level: int, spec: Any, n: int, seed: int) -> list[Problem]:
        low, high, ops = spec
        rng = random.Random(f"arithmetic-level:{level}:{seed}")
        triples = dict.fromkeys((rng.randint(low, high), rng.choice(ops), rng.randint(low, high)) for _ in range(n))
        # the configured environment phrases them, so an id equals the one its own pools would give
        return [self.env._problem(t, "train") for t in triples]


class CalculatorLadder(SpecLadder):
    def __init__(self, env: Any) -> None:
        super().__init__(env)
        low, high = env.digits
        more = (min(low + 1, 30), min(high + 2, 30))
        self.specs: list[tuple[int, tuple[int, int]] | None] = [
            None, (2, more), (3, (low, high)), (3, more), (4, (min(low + 2, 30), min(high + 3, 30)))]
        if getattr(env, "tool_version", 1) == 2:  # the second tool takes two operands: only the two-operand levels
            self.specs = self.specs[:2]

    def describe_configured(self) -> str:
        return f"configured: 2 operands of {self.env.digits[0]}-{self.env.digits[1]} digits"

    def describe_spec(self, spec: Any) -> str:
        return f"{spec[0]} operands of {spec[1][0]}-{spec[1][1]} digits"

    def generate(self, level: int, spec: Any, n: int, seed: int) -> list[Problem]:
        operands, (low, high) = spec
        rng = random.Random(f"calculator-level:{level}:{seed}")
        out: dict[str, Problem] = {}
        for _ in range(n):
            numbers = [rng.randint(10 ** (size - 1), 10 ** size - 1) for size in
                       (rng.randint(low, high) for _ in range(operands))]
            expr = str(numbers[0])
            for number in numbers[1:]:
                expr += f" {rng.choice(self.env.ops)} {number}"
            # evaluates a string built here from integers and + - * only
            answer = str(eval(expr, {"__builtins__": {}}))
            problem = Problem.make(self.env.name, f"What is {expr}?", {"expr": expr, "answer": answer}, "train")
            out.setdefault(problem.id, problem)
        return list(out.values())


class TerminalLadder(Ladder):
    @cached_property
    def _pools(self) -> list[list[Problem]]:
        train = self.env.problems("train", self.env.count("train"), 0)
        by_name = {p.payload["task"]: p for p in train}
        simple = [by_name[t.name] for t in self.env.tasks if t.name in by_name
                  and len(t.solution) == 1 and not t.name.startswith("fix-")]
        return [simple, sorted(train, key=lambda p: p.payload["task"])]

    @property
    def levels(self) -> int:
        return 3

    def describe(self, level: int) -> str:
        return ("one generated command (create, move, copy, delete, search, print)",
                "vendored one-command tasks", "all vendored tasks, code fixes included")[level]

    def generated(self, names: list[str]) -> list[Problem]:
        return self.env.generated_problems(names, "train")

    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        self.check(level)
        if level == 0:
            return self.generated(task_names(n, seed))
        pool = self._pools[level - 1]
        rng = random.Random(f"terminal-level:{level}:{seed}")
        return rng.sample(pool, min(n, len(pool))) + [rng.choice(pool) for _ in range(max(0, n - len(pool)))]

    def broad(self, level: int, n: int, seed: int) -> list[Problem]:
        # the vendored levels' held-out tasks are the environment's gate and test split already
        return self.problems(0, n, seed, lambda ids: {}) if level == 0 else []

    def gate(self, level: int, n: int, seed: int) -> list[Problem] | None:
        # level 0's generated commands have no held-out pool of their own; the vendored levels' is the environment's
        return self.problems(0, n, seed, lambda ids: {}) if level == 0 else None


class ReasoningGymLadder(Ladder):
    def __init__(self, env: Any) -> None:
        super().__init__(env)
        # late: reasoning_gym (~1 s), only a reasoning-gym ladder asks it
        from reasoning_gym.factory import create_curriculum, has_curriculum

        self.curriculum = create_curriculum(env.generator) if has_curriculum(env.generator) else None
        self._envs: dict[int, Environment] = {}
        # a config that sets a field the curriculum moves is a difficulty the operator chose: kept fixed
        if self.curriculum is not None and set(self.fields()) & set(env.config):
            self.curriculum = None

    def fields(self) -> list[str]:
        """The generator config fields the curriculum sets."""
        assert self.curriculum is not None
        return [f for attr in self.curriculum.attributes.values()
                for f in (getattr(attr, "lower_field_name", None), getattr(attr, "upper_field_name", None),
                          getattr(attr, "field_name", None)) if f]

    @cached_property
    def levels(self) -> int:  # type: ignore[override]
        """The curriculum's levels up to the first whose config the generator refuses (caesar_cipher's last
        level asks a rotation of 26, which its own config validation rejects)."""
        if self.curriculum is None:
            return 1
        for level in range(max(len(attr.levels) for attr in self.curriculum.attributes.values())):
            try:
                config = self.curriculum._config_cls(**{**self.config(level), "seed": 0, "size": 1})
                if hasattr(config, "validate"):
                    config.validate()
            except (AssertionError, ValueError, TypeError):
                return max(level, 1)
        return max(len(attr.levels) for attr in self.curriculum.attributes.values())

    def config(self, level: int) -> dict[str, Any]:
        """The generator config of ``level``: the configured one with the curriculum's attributes at
        min(level, their last level) (reasoning-gym's inclusive ranges: easier values stay in)."""
        assert self.curriculum is not None
        for name, attr in self.curriculum.attributes.items():
            self.curriculum.set_attr_level(name, min(level, len(attr.levels) - 1))
        values = dataclasses.asdict(self.curriculum.generate_configuration())
        return {**self.env.config, **{f: _plain(values[f]) for f in self.fields() if f in values}}

    def describe(self, level: int) -> str:
        return json.dumps({k: v for k, v in self.config(level).items() if k in self.fields()}, sort_keys=True)[:120]

    def level_env(self, level: int) -> Environment:
        if level not in self._envs:
            self._envs[level] = ReasoningGym(self.env.generator, reward=self.env.reward_mode,
                                             config=self.config(level), eval_size=self.env.eval_size)
        return self._envs[level]

    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        self.check(level)
        return [replace(p, env=self.env.name) for p in self.level_env(level).problems("train", n, seed)]

    def gate(self, level: int, n: int, seed: int) -> list[Problem] | None:
        return self.broad(level, n, seed)  # level 0 is the curriculum's easiest, not the configured generator


class BandLadder(Ladder):
    """A fixed data set: the level prefers candidates by their measured pass rate (module docstring)."""

    start = 1

    @property
    def levels(self) -> int:
        return 3

    def describe(self, level: int) -> str:
        return ("solved at least half the time first", "as drawn", "solved less than half the time first")[level]

    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        self.check(level)
        if level == 1:  # exactly the environment's own draw: the start changes nothing
            return self.env.problems("train", n, seed)
        pool = self.env.problems("train", 2 * n, seed)
        rates = history([p.id for p in pool])

        def rank(problem: Problem) -> int:
            rate = rates.get(problem.id)
            if rate is None:
                return 1
            return 0 if (rate >= 0.5) == (level == 0) else 2

        return sorted(pool, key=rank)  # stable: the draw's order within a band

    def broad(self, level: int, n: int, seed: int) -> list[Problem]:
        return []  # a fixed data set's held-out problems are its gate and test split: nothing else is sealed

    def gate(self, level: int, n: int, seed: int) -> list[Problem] | None:
        return None  # the bands order training candidates; the held-out pool is the data set's own


class DeclaredLadder(Ladder):
    """The levels an environment package declares itself (``CURRICULUM``: :mod:`evertrain.envs.declared`), for the
    adapters of other systems' formats: level ``k`` is the package's ``k``-th table of options over the configured
    ones, its training problems from that level's training pool, its gate and broad problems from its held-out
    pool (each problem names its level, so the configured environment grades it with that level's rules)."""

    def __init__(self, env: Any, declared: list[dict[str, Any]]) -> None:
        super().__init__(env)
        self.declared = declared

    @property
    def levels(self) -> int:
        return len(self.declared)

    def describe(self, level: int) -> str:
        return describe_options(self.declared[level])

    def problems(self, level: int, n: int, seed: int, history: History) -> list[Problem]:
        self.check(level)
        pool = self.env.level_pool(level, "train")
        return random.Random(f"declared-level:{level}:{seed}").sample(pool, min(n, len(pool)))

    def gate(self, level: int, n: int, seed: int) -> list[Problem] | None:
        self.check(level)
        return self.env.level_pool(level, "eval")[:n]  # a stable order, as a fixed pool's held-out problems

    def broad(self, level: int, n: int, seed: int) -> list[Problem]:
        self.check(level)
        pool = self.env.level_pool(level, "eval")  # the gate's share of it is left out where the set is drawn
        return random.Random(f"declared-broad:{level}:{seed}").sample(pool, min(n, len(pool)))


def _declared_or_bands(env: Environment) -> Ladder:
    """An adapted environment's ladder: the levels its package declares, else pass-rate bands (a fixed pool)."""
    levels = env.declared_levels  # type: ignore[attr-defined]
    return DeclaredLadder(env, levels) if levels else BandLadder(env)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# environment class ("module:Class") -> what builds its ladder (None: no notion of difficulty here)
LadderFactory = Callable[[Environment], "Ladder | None"]
LADDERS: dict[str, LadderFactory] = {}


def register_ladder(env_class: type[Environment] | str, factory: LadderFactory) -> None:
    """Give ``env_class`` (a class, or its ``"module:Class"`` name: nothing is imported) and its subclasses the
    ladder ``factory(env)`` builds: how an environment package outside the project ships its own curriculum
    (``register_ladder(MyEnv, MyLadder)``, ``MyLadder`` a :class:`Ladder`). Registering a class again replaces it."""
    key = env_class if isinstance(env_class, str) else f"{env_class.__module__}:{env_class.__qualname__}"
    LADDERS[key] = factory


def ladder_for(env: Environment) -> Ladder | None:
    """The environment's ladder of levels: the one registered for its class or the nearest base class that has
    one (:func:`register_ladder`); else bands of pass-rate history where it counts its training problems; else
    None (no notion of difficulty here)."""
    for cls in type(env).__mro__:
        factory = LADDERS.get(f"{cls.__module__}:{cls.__qualname__}")
        if factory is not None:
            return factory(env)
    try:
        fixed = env.count("train") is not None
    except ValueError:  # an environment that cannot count without its options: no bands
        fixed = False
    return BandLadder(env) if fixed else None


def _reasoning_gym_ladder(env: Environment) -> Ladder | None:
    ladder = ReasoningGymLadder(env)
    return ladder if ladder.levels > 1 else None  # a generator without a curriculum keeps its difficulty


# the project's own environments, by name (their modules import only when an environment of theirs is used)
register_ladder("evertrain.envs.arithmetic:Arithmetic", ArithmeticLadder)
register_ladder("evertrain.envs.calculator:Calculator", CalculatorLadder)
register_ladder("evertrain.envs.terminal:Terminal", TerminalLadder)
register_ladder("evertrain.envs.reasoning_gym:ReasoningGym", _reasoning_gym_ladder)
register_ladder("evertrain.envs.verifiers_env:VerifiersEnvironment", _declared_or_bands)
register_ladder("evertrain.envs.openenv_env:OpenEnvEnvironment", _declared_or_bands)


def cached_ladder(env: Environment) -> Ladder | None:
    """:func:`ladder_for`, once per environment instance (a runtime keeps its environments)."""
    if "_curriculum_ladder" not in vars(env):
        vars(env)["_curriculum_ladder"] = ladder_for(env)
    return vars(env)["_curriculum_ladder"]


# --- the level -------------------------------------------------------------------------------------


@dataclass
class LevelDecision:
    env: str
    level: int
    max_level: int
    previous_level: int | None
    groups: int
    pass_rate: float | None
    action: str  # start, advance, retreat, hold
    reason: str


def reference_turn_tokens(env: Environment, problem: Problem, count: Callable[[str], int]) -> int | None:
    """Tokens of the longest turn that ``problem``'s reference episode cannot do without, plus one for the end of
    the turn: each reference tool call as the policy writes it, and the last line of the final answer (what the
    strict answer rule reads; a worked line before it is optional); in a conversation with the environment, each
    of the reference's replies. None without a reference."""
    final = env.reference(problem)
    if final is None:
        return None
    if env.conversational:  # the reference is every reply of the episode, each one turn
        return max((count(reply) + 1 for reply in replies_of(final)), default=None)
    calls = env.reference_calls(problem) if hasattr(env, "reference_calls") else []
    turns = [f"<{c.name}>\n{c.input}\n</{c.name}>" for c in calls] + [final.strip().splitlines()[-1] if final.strip()
                                                                        else final]
    return max(count(turn) + 1 for turn in turns)


REACH_SAMPLE = 16  # reference episodes measured per level


def reachable_top(ladder: Ladder, limit: int, count: Callable[[str], int], seed: int) -> tuple[int, str | None]:
    """The highest level whose reference turns fit a turn limit of ``limit`` tokens for at least half of
    ``REACH_SAMPLE`` problems, and why the ladder stops below its top (None when every level fits). A level whose
    answers the limit cuts off cannot be learned, whatever the model: its groups would all fail, and the level would
    only retreat. Levels without reference answers count as reachable."""
    for level in range(ladder.levels):
        needs = [n for p in ladder.problems(level, REACH_SAMPLE, seed, lambda ids: {})[:REACH_SAMPLE]
                 if (n := reference_turn_tokens(ladder.env, p, count)) is not None]
        if needs and sum(n > limit for n in needs) * 2 > len(needs) and level > 0:
            needs.sort()
            return level - 1, (f"level {level} needs {needs[len(needs) // 2]} tokens a turn (median of its reference "
                               f"answers; up to {needs[-1]}), over the turn limit of {limit}: capped at level "
                               f"{level - 1}; raise the environment's max_new_tokens to use it")
    return ladder.levels - 1, None


def decide(store: Any, campaign: str, iteration: int, env: str, ladder: Ladder, band_low: float,
           band_high: float, window: int, top: int | None = None) -> LevelDecision:
    """The level of ``env`` at ``iteration``, from earlier iterations' levels and scored groups only, at most
    ``top`` (default: the ladder's last level)."""
    top = ladder.levels - 1 if top is None else min(top, ladder.levels - 1)
    earlier = store.curriculum_history(campaign, env, iteration)
    if earlier.empty:
        return LevelDecision(env, min(ladder.start, top), top, None, 0, None, "start",
                             f"starts at level {min(ladder.start, top)}: {ladder.describe(min(ladder.start, top))}")
    levels = [int(x) for x in earlier["level"]]
    level, entered = min(levels[0], top), int(earlier["iteration"].iloc[0])
    for it, lv in zip(earlier["iteration"], levels, strict=True):  # back to where the level was entered
        if lv != levels[0]:
            break
        entered = int(it)
    groups = store.recent_group_pass_rates(campaign, env, entered, iteration, window)
    count = len(groups)
    rate = float(groups["pass_rate"].mean()) if count else None
    if count < window:
        return LevelDecision(env, level, top, level, count, rate, "hold",
                             f"{count} of {window} groups scored at level {level}: too few to move")
    assert rate is not None
    seen = f"pass rate {rate:.2f} over the last {count} groups at level {level}"
    if rate > band_high and level < top:
        return LevelDecision(env, level + 1, top, level, count, rate, "advance",
                             f"{seen} > {band_high}: level {level + 1} ({ladder.describe(level + 1)})")
    if rate < band_low and level > 0:
        return LevelDecision(env, level - 1, top, level, count, rate, "retreat",
                             f"{seen} < {band_low}: level {level - 1} ({ladder.describe(level - 1)})")
    where = " (top level)" if rate > band_high else " (lowest level)" if rate < band_low else ""
    return LevelDecision(env, level, top, level, count, rate, "hold", f"{seen}: in the band{where}" if not where
                         else f"{seen}: stays{where}")


def record(rt: Any, iteration: int) -> tuple[dict[str, int], dict[str, Any]]:
    """Decide every laddered environment's level for ``iteration``, store the ``curriculum`` rows (replacing
    a rerun's), and return {env: level} and the metrics for MLflow."""
    cfg = rt.config.curriculum
    rows, levels, metrics = [], {}, {}
    stamp = now()
    for spec in rt.config.environments:
        ladder = cached_ladder(rt.env(spec.name))
        if ladder is None:
            continue
        top, capped = _reach(rt, spec.name)
        decision = decide(rt.store, rt.campaign, iteration, spec.name, ladder, cfg.band_low, cfg.band_high,
                          cfg.window, top)
        if capped:
            metrics[f"curriculum_capped_{spec.name}"] = top
            if decision.level == top and decision.action != "retreat":
                decision.reason += f" ({capped})"
        levels[spec.name] = decision.level
        rows.append({"campaign": rt.campaign, "iteration": iteration, **vars(decision), "created_at": stamp})
        metrics[f"curriculum_level_{spec.name}"] = decision.level
        if decision.pass_rate is not None:
            metrics[f"curriculum_pass_rate_{spec.name}"] = round(decision.pass_rate, 4)
    rt.store.replace("curriculum", {"campaign": rt.campaign, "iteration": iteration}, rows)
    return levels, metrics


def turn_limit_top(env: Environment, config: CampaignConfig) -> tuple[int, str | None]:
    """:func:`reachable_top` of ``env``'s ladder with the campaign's tokenizer and turn limit: a function of the
    config, computed once per environment instance (a model without a tokenizer here, e.g. served elsewhere: no
    cap)."""
    ladder = cached_ladder(env)
    if ladder is None:
        return 0, None
    key = (config.model.path, config.model.models_dir, config.max_new_tokens(env.name), config.seed)
    cache = vars(env).setdefault("_curriculum_reach", {})
    if key not in cache:
        # late: torch (through the runtime and the model files): `evertrain report` reads the levels without it
        from evertrain.models import ModelError
        from evertrain.models.checkpoint import load_tokenizer, resolve_base
        from evertrain.runtime import seed_for

        try:
            tokenizer = load_tokenizer(resolve_base(config.model))
        except (ModelError, OSError, ValueError):
            cache[key] = (ladder.levels - 1, None)
        else:
            def count(text: str) -> int:
                return len(tokenizer(text, add_special_tokens=False)["input_ids"])

            cache[key] = reachable_top(ladder, config.max_new_tokens(env.name), count,
                                       seed_for(config.seed, "reach", env.name))
    return cache[key]


def _reach(rt: Any, env_name: str) -> tuple[int, str | None]:
    """:func:`turn_limit_top` for an environment of the campaign, logged once per runtime when it caps."""
    top, capped = turn_limit_top(rt.env(env_name), rt.config)
    logged = vars(rt).setdefault("_curriculum_reach_logged", set())
    if capped and env_name not in logged:
        logged.add(env_name)
        logging.getLogger("evertrain").warning("%s curriculum: %s", env_name, capped)
    return top, capped


def stored_level(rt: Any, iteration: int, env: str) -> int | None:
    """The level curate stored for ``env`` at ``iteration`` (None: no curriculum row)."""
    return rt.store.curriculum_level(rt.campaign, iteration, env)


def pass_rates(rt: Any, iteration: int) -> History:
    """Measured pass rate of each given problem over the campaign's iterations before ``iteration``."""
    def history(ids: list[str]) -> dict[str, float]:
        if not ids:
            return {}
        return rt.store.problem_pass_rates(rt.campaign, iteration, ids)

    return history


def candidates(rt: Any, iteration: int, env: Environment, n: int, seed: int) -> list[Problem]:
    """Training candidates of ``env`` for ``iteration``: at its stored curriculum level when it has one,
    else the environment's own draw (curriculum off, or no ladder)."""
    level = stored_level(rt, iteration, env.name) if rt.config.curriculum.enabled else None
    ladder = cached_ladder(env) if level is not None else None
    if ladder is None or level is None:
        return env.problems("train", n, seed)
    return ladder.problems(min(level, ladder.levels - 1), n, seed, pass_rates(rt, iteration))


# --- the gate's problems ------------------------------------------------------------------------------


def gate_problems(env: Environment, config: CampaignConfig, rotation: int | None = None) -> list[Problem]:
    """The promotion gate's held-out problems of ``env`` (split ``eval``): ``config.eval_size(env)`` of them for one
    ``rotation`` (``eval.rotations``: the k-th set is every rotations-th problem of the pool from the k-th on, so each
    holds a share of every level), or the whole pool of ``config.held_out_size(env)`` (None: what curation refuses).

    ``eval.levels = 'configured'``: the environment's own held-out pool. ``'curriculum'``: the same number spread
    evenly across its curriculum levels up to the highest the turn limit can express (:func:`turn_limit_top`), each
    level's share drawn once with a seed of its own (a generator's configured level, and a fixed data set, from the
    environment's own pool), interleaved so that every look of a sequential gate holds a share of every level. A pure
    function of the config: curation, the broad sealed set and the endpoint's traces all keep out exactly the
    problems the gate compares on.
    """
    strata = _gate_strata(env, config)
    if rotation is not None:  # each set takes every rotations-th problem of every level: a share of each level
        strata = [stratum[rotation % config.eval.rotations::config.eval.rotations] for stratum in strata]
    return [problem for row in zip_longest(*strata) for problem in row if problem is not None]


def _gate_strata(env: Environment, config: CampaignConfig) -> list[list[Problem]]:
    """The gate's whole held-out pool of ``env`` (every rotation's), one list per level, no problem twice."""
    # late: torch (through the runtime and the model files): `evertrain report` reads the levels without it
    from evertrain.runtime import seed_for

    n = config.held_out_size(env.name)
    ladder = cached_ladder(env) if config.eval.levels == "curriculum" else None
    # levels whose answers the turn limit cuts off are left out: both models could only score 0 there
    levels = turn_limit_top(env, config)[0] + 1 if ladder is not None else 1
    if ladder is None or levels < 2:
        return [env.problems("eval", n, config.seed)]
    shares = [n // levels + (level < n % levels) for level in range(levels)]
    drawn: list[list[Problem]] = []
    own = 0
    for level, share in enumerate(shares):
        got = ladder.gate(level, share, seed_for(config.seed, "gate", env.name, level)) if share else []
        if got is None:
            own += share
        else:
            drawn.append(got[:share])
    if own:
        drawn.insert(0, env.problems("eval", own, config.seed))
    seen: set[str] = set()
    strata = []
    for stratum in drawn:
        mine = []
        for problem in stratum:
            if problem.id not in seen:
                seen.add(problem.id)
                mine.append(replace(problem, split="eval"))
        strata.append(mine)
    return strata


# --- the broad sealed set ------------------------------------------------------------------------------


def draw_broad(rt: Any) -> list[dict[str, Any]]:
    """The broad sealed set's rows: ``broad_per_level`` problems of every level of every environment and of
    its transfer split (a fixed data set: of its test split), none of them the gate's."""
    # late: torch (through the runtime and the model files): `evertrain report` reads the levels without it
    from evertrain.runtime import seed_for

    config, per = rt.config, rt.config.curriculum.broad_per_level
    stamp, rows, seen = now(), [], set()
    gate = {p.id for spec in config.environments for p in gate_problems(rt.env(spec.name), config)}
    for spec in config.environments:
        env, gate_size = rt.env(spec.name), config.held_out_size(spec.name)
        ladder = cached_ladder(env)
        drawn: list[tuple[int | None, str, Problem]] = []
        if ladder is not None:
            for level in range(ladder.levels):
                seed = seed_for(config.seed, "broad", spec.name, level)
                drawn += [(level, "level", p) for p in ladder.broad(level, per, seed)]
        if ladder is None or isinstance(ladder, BandLadder):
            drawn += [(None, "test", p) for p in env.sealed_problems("test", per, config.seed, gate_size)]
        drawn += [(None, "transfer", p) for p in env.sealed_problems("transfer", per, config.seed, gate_size)]
        for level, source, problem in drawn:
            if problem.id in gate or problem.id in seen:
                continue
            seen.add(problem.id)
            rows.append({"campaign": rt.campaign, "problem_id": problem.id, "env": spec.name, "level": level,
                         "source": source, "prompt": problem.prompt, "payload": to_json(problem.payload),
                         "created_at": stamp})
    return rows


def ensure_broad(rt: Any) -> int:
    """Draw and store the broad sealed set once per campaign (never again: it must not move); its size."""
    if not rt.config.curriculum.broad_per_level:
        return 0
    have = rt.store.broad_sealed_count(rt.campaign)
    if have:
        return have
    rows = draw_broad(rt)
    rt.store.replace("broad_sealed", {"campaign": rt.campaign}, rows)
    return len(rows)


def broad_ids(rt: Any) -> frozenset[str]:
    """The ids of the campaign's broad sealed set (empty when it has none)."""
    return rt.store.broad_sealed_ids(rt.campaign)


def broad_guard(rt: Any) -> tuple[frozenset[str], Any]:
    """What curation refuses for the broad sealed set: its ids, and the word n-grams of its natural-language
    problems (a data set's; the environment's boilerplate dropped), as for the gate's problems."""
    ids = broad_ids(rt)
    cache = vars(rt).setdefault("_broad_guard", {})
    if ids not in cache:
        index = NgramIndex(n=rt.config.curation.decontamination_ngram)
        for env_name in {p.env for p in broad_problems(rt)}:
            env = rt.env(env_name)
            if env.templated:
                continue
            mine = NgramIndex(n=rt.config.curation.decontamination_ngram)
            for problem in broad_problems(rt):
                if problem.env == env_name:
                    mine.add(problem.prompt)
            mine.drop_boilerplate([p.prompt for p in env.problems("train", 200, rt.config.seed)])
            index.grams |= mine.grams
        cache.clear()
        cache[ids] = index
    return ids, cache[ids]


def broad_problems(rt: Any) -> list[Problem]:
    """The campaign's broad sealed set as problems of split ``broad`` (stored order: environment, level)."""
    frame = rt.store.broad_sealed_problems(rt.campaign)
    return [Problem(env=row.env, id=row.problem_id, prompt=row.prompt, payload=json.loads(row.payload),
                    split="broad")  # type: ignore[arg-type]
            for row in frame.itertuples(index=False)]


def levels_over_iterations(store: Any, campaign: str) -> list[dict[str, Any]]:
    """Every iteration's curriculum rows (the report's section); empty for a store without the table."""
    return store.curriculum_rows(campaign)


def format_levels(rows: list[dict[str, Any]]) -> list[str]:
    lines: dict[int, list[str]] = {}
    for row in rows:
        moved = "" if row["action"] in ("hold", "start") else f" {row['action']}"
        lines.setdefault(int(row["iteration"]), []).append(f"{row['env']} {int(row['level'])}/{int(row['max_level'])}"
                                                           f"{moved}")
    return [f"curriculum i={iteration}: " + ", ".join(parts) for iteration, parts in sorted(lines.items())]
