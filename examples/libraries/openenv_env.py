"""An OpenEnv environment, its client and its server app: guess a secret number.

What a team that keeps its tasks as OpenEnv environments has: typed Action/Observation
models, a server-side ``Environment`` and an ``EnvClient`` subclass. Flotilla plays it over
that client (``[task] kind = "openenv"``, ``name = "examples/libraries/openenv_env.py:GuessClient"``).

Serve it (one environment per WebSocket session) before the run:

    python -m uvicorn --app-dir examples/libraries openenv_env:app --port 8765

The words are the built-in tiny model's vocabulary, so the example trains that model.
"""

from __future__ import annotations

import random
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    """The assistant's reply; its first integer word is the guess."""

    text: str


class GuessObservation(Observation):
    """What the environment says back."""

    message: str = ""


class GuessEnvironment(Environment):
    """A secret in 0..n-1 from the reset seed; ``higher``/``lower`` after a wrong guess,
    reward 1 and done on the right one, done after ``turns`` guesses."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, n: int = 8, turns: int = 3) -> None:
        super().__init__()
        self.n, self.turns = n, turns
        self.secret, self._state = 0, State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = random.Random(seed).randrange(self.n)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message=f"guess the number from 0 to {self.n - 1} in {self.turns} turns")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        guess = next((int(w) for w in action.text.split() if w.isdecimal()), None)
        if guess == self.secret:
            return GuessObservation(message="correct", reward=1.0, done=True)
        message = "invalid" if guess is None else ("higher" if guess < self.secret else "lower")
        return GuessObservation(message=message, reward=0.0, done=self._state.step_count >= self.turns)

    @property
    def state(self) -> State:
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The environment's own client (a WebSocket session per instance)."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"text": action.text}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        obs = payload.get("observation", {})
        return StepResult(
            observation=GuessObservation(
                message=obs.get("message", ""), done=payload.get("done", False), reward=payload.get("reward")
            ),
            reward=payload.get("reward"),
            done=payload.get("done", False),
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
