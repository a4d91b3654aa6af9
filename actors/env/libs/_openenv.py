"""``[task] kind = "openenv"``: an OpenEnv environment, played over its own client.

``name`` is the environment's client class (``"my_env.client:MyEnv"``, an
``openenv.core.EnvClient`` subclass; a ``.py`` path works as the module), ``params.base_url``
the address of its running server (``uvicorn my_env.server.app:app``, a container, a Space).
Each episode opens its own client session (a WebSocket: the server keeps one environment
per session, so allow as many concurrent sessions as episodes run at once), calls
``reset(seed=task.seed, **reset_args)``, then one ``step`` per assistant reply, and closes
the session when the episode ends (``Environment.close``).

Text in, text out: the reply becomes ``Action(**{action_field: reply})`` (the action class
comes from the client's generic parameters, or ``params.action``; ``action_field`` defaults to
its only required field), and each observation is shown to the model as its
``observation_field`` (default: the observation's fields other than done/reward/metadata, as
JSON). The step's ``reward`` (None counts 0) and ``done`` are the environment's own.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from actors.env._interface import Environment, StepOutcome
from actors.env._modules import resolve_callable
from actors.types import TaskSpec

__all__ = ["OpenEnvTask"]

_SKIP = ("done", "reward", "metadata")


def _client_class(spec: str) -> type:
    from openenv.core import EnvClient

    cls = resolve_callable(spec)
    if not (isinstance(cls, type) and issubclass(cls, EnvClient)):
        raise TypeError(f"openenv: {spec!r} is not an openenv.core.EnvClient subclass")
    return cls


def _action_class(client: type, spec: str | None) -> type:
    if spec is not None:
        return resolve_callable(spec)  # type: ignore[return-value]
    for base in getattr(client, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type):
            return args[0]
    raise TypeError(
        f"openenv: cannot tell {client.__name__}'s action class from its generic "
        f"parameters; give params.action = 'module:Class'"
    )


def _text_field(action: type, field: str | None) -> str:
    fields = getattr(action, "model_fields", None)
    if fields is None:
        raise TypeError(f"openenv: action class {action.__name__} is not a pydantic model")
    if field is not None:
        if field not in fields:
            raise ValueError(f"openenv: action {action.__name__} has no field {field!r} (fields: {', '.join(fields)})")
        return field
    required = [n for n, f in fields.items() if f.is_required()]
    if len(required) != 1:
        raise ValueError(
            f"openenv: action {action.__name__} has required fields {required}; "
            f"say which takes the reply with params.action_field"
        )
    return required[0]


class OpenEnvTask(Environment):
    """An OpenEnv environment as a multi-turn text task (module docstring). Plain methods:
    the client's synchronous wrapper runs in the episode's worker thread."""

    def __init__(
        self,
        client: str,
        base_url: str,
        action: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        max_turns: int = 8,
        reset_args: dict[str, Any] | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"openenv: max_turns={max_turns} must be >= 1")
        self.client_cls = _client_class(client)
        self.action_cls = _action_class(self.client_cls, action)
        self.action_field = _text_field(self.action_cls, action_field)
        self.base_url, self.observation_field = base_url, observation_field
        self.max_turns, self.max_new_tokens = max_turns, max_new_tokens
        self.reset_args = dict(reset_args or {})
        self.session: Any = None
        self.turn = 0

    @classmethod
    def validate_params(cls, client: str, params: dict[str, Any]) -> None:
        """The client and action classes resolve and the params fit (nothing connects)."""
        cls(client, **params)

    def _text(self, observation: Any) -> str:
        if self.observation_field is not None:
            return str(getattr(observation, self.observation_field))
        if isinstance(observation, dict):
            data = {k: v for k, v in observation.items() if k not in _SKIP}
        else:
            data = observation.model_dump(exclude=set(_SKIP))
        if len(data) == 1 and isinstance(next(iter(data.values())), str):
            return next(iter(data.values()))
        return json.dumps(data, sort_keys=True, default=str)

    def close(self) -> None:
        """End the client session (the episode runner calls this however the episode ended)."""
        if self.session is not None:
            session, self.session = self.session, None
            session.close()

    def reset(self, task: TaskSpec) -> str:
        self.session = self.client_cls(base_url=self.base_url).sync()
        self.session.connect()
        self.turn = 0
        result = self.session.reset(seed=task.seed, **self.reset_args)
        return self._text(result.observation)

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        self.turn += 1
        result = self.session.step(self.action_cls(**{self.action_field: action_text}))
        done = bool(result.done)
        return StepOutcome(observation=self._text(result.observation), reward=float(result.reward or 0.0), done=done)
