"""The environment, its action, observation and state, and the app that serves it."""

from __future__ import annotations

import random
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

STEPS = 2  # right answers an episode needs
ASK = "Reply with the new total as a number."


class CountAction(Action):
    answer: int = Field(..., description="the new running total")


class CountObservation(Observation):  # done and reward come from Observation
    message: str = ""


class CountState(State):  # episode_id and step_count come from State
    total: int = 0
    expected: int = 0
    operations: list[int] = Field(default_factory=list)
    steps: int = STEPS


def _say(operand: int) -> str:
    return f"Add {operand}." if operand >= 0 else f"Subtract {-operand}."


class CountEnvironment(Environment[CountAction, CountObservation, CountState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: episodes never share state

    def __init__(self) -> None:
        super().__init__()
        self._state = CountState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, steps: int = STEPS,
              **kwargs: Any) -> CountObservation:
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 20:
            raise ValueError(f"steps must be a whole number from 1 to 20, got {steps!r}")
        rng = random.Random(seed)
        start = rng.randint(1, 12)
        operations = [rng.choice([-1, 1]) * rng.randint(1, 5) for _ in range(steps)]
        self._state = CountState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, total=start,
                                 expected=start + operations[0], operations=operations, steps=steps)
        return CountObservation(message=f"Start at {start}. {_say(operations[0])} {ASK}", done=False, reward=0.0)

    def step(self, action: CountAction, timeout_s: float | None = None, **kwargs: Any) -> CountObservation:
        state = self._state
        if state.step_count >= state.steps:
            return CountObservation(message="The episode is over.", done=True, reward=0.0)
        if action.answer != state.expected:
            state.step_count = state.steps
            return CountObservation(message=f"Wrong: the total was {state.expected}.", done=True, reward=0.0)
        state.step_count += 1
        state.total = state.expected
        if state.step_count == state.steps:
            return CountObservation(message=f"Right: {state.total}. Done.", done=True, reward=1.0)
        operand = state.operations[state.step_count]
        state.expected = state.total + operand
        return CountObservation(message=f"Right: {state.total}. {_say(operand)} {ASK}", done=False, reward=0.0)

    @property
    def state(self) -> CountState:
        return self._state


app = create_app(CountEnvironment, CountAction, CountObservation, env_name="openenv_count", max_concurrent_envs=256)
