"""The environment interface users implement, and the task registry.

An environment plays one episode: ``reset`` gives the first observation, each
``step`` takes the assistant's reply and returns the next observation, a reward
and whether the episode is over. Observations are text or token ids (one user
turn), or chat messages (a dict or a list of dicts, e.g. ``tool`` results); the
run's chat format renders them (``actors.chat``) and their tokens are never
trained on. Methods may be plain or ``async``; plain ones
run in a worker thread (bounded per task, see ``_threads``; ``blocking = False`` runs
them on the loop), async ones on the
actor's event loop, where they must never call blocking code (a watchdog names an
async environment that does).

A fresh environment instance is built for every episode from the registry
(``make_env(task)`` calls the registered factory with ``task.params``), so
instances need no locking and no reset-between-episodes hygiene.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from actors.types import TaskSpec

__all__ = [
    "Environment",
    "Observation",
    "StepOutcome",
    "make_env",
    "make_task_specs",
    "register_task",
    "registered_tasks",
    "task_factory",
]

Observation = str | list[int] | dict[str, Any] | list[dict[str, Any]]
"""Text or token ids (one user turn), or chat messages (``{"role", "content", ...}``)."""


class StepOutcome(BaseModel):
    """What the environment answers to one assistant reply."""

    model_config = ConfigDict(extra="forbid")

    observation: str | list[int] | dict[str, Any] | list[dict[str, Any]]
    """Next turn: user text or ids, or messages such as ``{"role": "tool", "content": ...}``
    (ignored when ``done``: the model never sees it)."""
    reward: float = 0.0
    """Reward for this step; the episode's return is the sum over steps."""
    done: bool = False
    """True ends the episode."""


class Environment:
    """Base class of an environment. Subclass and implement ``reset`` and ``step``.

    ``reset(task) -> Observation`` and ``step(action_text, action_ids) -> StepOutcome``
    may be plain or ``async def``. ``action_ids`` are the generated ids of the reply
    (including a generated stop token), ``action_text`` their decoding without specials.
    A ``step`` with a third parameter (``message``) also gets the reply as a parsed
    assistant message (``content`` and, for templates with tools, ``tool_calls``).

    Class attributes the episode runner reads:

    - ``max_turns``: the runner ends the episode after this many assistant turns
      even if the environment never says done.
    - ``max_new_tokens``: per-turn generation limit; ``None`` uses the sampling
      params' limit.
    - ``tools``: OpenAI-style function schemas handed to the chat template (None: no
      tools); the reply's tool calls arrive in ``message["tool_calls"]``.

    Plain (non-async) methods, and the constructor, run in a worker thread (unless
    ``blocking = False``), so a slow or stuck environment cannot block the actor and
    its timeout fires; the threads of one task are bounded (``EnvConfig.env_threads``),
    and calls stuck past their timeout are counted in the actor's ``stats``. ``async`` methods run on the
    actor's event loop: they must await, never block (a watchdog reports one that does).

    Params: the constructor receives ``task.params`` and should raise ValueError or
    TypeError for bad ones; ``actors.env.check_task`` constructs one instance before
    the run starts to check them. An environment whose constructor is expensive or
    has side effects defines a ``validate_params(params)`` classmethod instead.

    Errors: any exception from ``reset``/``step`` ends the episode as a failed
    trajectory (reward 0, the error text and the tail of its traceback recorded);
    the actor keeps serving.
    """

    max_turns: int = 1
    max_new_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    blocking: bool = True
    """Whether the plain methods and the constructor may block (I/O, a subprocess, long
    compute). True (the default): they run in worker threads, as described above. False
    declares them quick pure computation: they run on the actor's event loop, with no
    thread hop (measured at about 40% of the env actor's CPU on a one-token demo task:
    benchmarks/records/2026-12-03-env-inline.md), but their timeout cannot fire and one
    that does block stalls every episode of the actor (the watchdog names it). The
    built-in tasks set it."""

    def reset(self, task: TaskSpec) -> Observation | Awaitable[Observation]:
        raise NotImplementedError(f"{type(self).__name__}.reset")

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome | Awaitable[StepOutcome]:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> Awaitable[None] | None:
        """Release what the episode held (a connection, a sandbox); called once the episode
        has ended, however it ended, plain methods in a worker thread. Nothing by default."""


EnvFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvFactory] = {}


def register_task(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Class decorator registering an environment factory under ``name``.

    The factory (usually the class) is called with ``**task.params`` per episode.
    Re-registering a name replaces the old factory only if it is the same
    qualified name (so module reloads work); otherwise ValueError.
    """

    def deco(factory: EnvFactory) -> EnvFactory:
        old = _REGISTRY.get(name)
        if old is not None and _qualname(old) != _qualname(factory):
            raise ValueError(f"task {name!r} is already registered to {_qualname(old)}")
        _REGISTRY[name] = factory
        return factory

    return deco


def _qualname(f: Any) -> str:
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"


def registered_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_REGISTRY)


def task_factory(name: str) -> EnvFactory | None:
    """The factory registered under ``name``, or None. A library task's name
    (``"reasoning_gym:<dataset>"``, ``"openenv:<client>"``: ``actors.env.libs``) resolves
    to its adapter, which raises ``LibraryMissing`` naming the extra when the library is
    not installed."""
    factory = _REGISTRY.get(name)
    if factory is None and ":" in name:
        from actors.env.libs import library_factory

        factory = library_factory(name)
    return factory


def make_env(task: TaskSpec) -> Environment:
    """A fresh environment for ``task``: the registered factory called with ``task.params``.

    Raises KeyError naming the task when it is not registered, TypeError naming the
    parameters when the factory rejects them.
    """
    factory = task_factory(task.task)
    if factory is None:
        raise KeyError(f"unknown task {task.task!r}; registered: {registered_tasks()}")
    try:
        return factory(**task.params)
    except TypeError as e:
        raise TypeError(f"task {task.task!r} rejected params {task.params}: {e}") from e


def make_task_specs(
    task: str, num_prompts: int, group_size: int, *, seed: int = 0, params: dict[str, Any] | None = None
) -> list[TaskSpec]:
    """``num_prompts`` prompts × ``group_size`` episodes each, grouped for GRPO.

    Episodes of one prompt share ``prompt_id``, ``group_id`` and ``seed`` (so they
    play the same instance, e.g. the same secret); prompts get distinct seeds
    derived from ``seed``.
    """
    if num_prompts < 1 or group_size < 1:
        raise ValueError(f"num_prompts={num_prompts} and group_size={group_size} must be >= 1")
    specs = []
    for i in range(num_prompts):
        pid = f"{task}/{seed}/{i}"
        specs += [
            TaskSpec(task=task, prompt_id=pid, group_id=pid, seed=seed * 1_000_003 + i, params=dict(params or {}))
            for _ in range(group_size)
        ]
    return specs
