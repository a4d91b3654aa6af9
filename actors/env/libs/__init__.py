"""Tasks from environment libraries: reasoning-gym, verifiers and OpenEnv.

``[task] kind = "reasoning_gym" | "verifiers" | "openenv"`` with ``name`` the library's
own identifier (a reasoning-gym dataset, a verifiers environment id, an OpenEnv client
class) plays that library's task. The run's task name is then ``"<kind>:<name>"``: the
registry (``actors.env.task_factory``) resolves such names here, importing the adapter
(and its library) only when a task of that kind is used.

* ``reasoning_gym`` and ``openenv`` adapters are ordinary ``Environment`` classes played
  by the episode runner (exact ids, supports and versions as for any registered task).
* ``verifiers`` environments run their own rollout loop against an OpenAI client; the
  environment actor points that client at a gateway session (``actors.gateway``), so
  every token is captured as for a harness (see ``_verifiers``).

A library that is not installed fails with ``LibraryMissing``: one line naming the
extra to install (``pip install -e '.[reasoning-gym]'``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["EXTRAS", "KINDS", "LibraryMissing", "library_factory", "require", "split_task_name"]

KINDS = ("reasoning_gym", "verifiers", "openenv")
"""Task kinds that come from an environment library."""

EXTRAS = {
    "reasoning_gym": ("reasoning_gym", "reasoning-gym"),
    "verifiers": ("verifiers", "verifiers"),
    "openenv": ("openenv", "openenv"),
}
"""kind -> (the module it imports, the pyproject extra that installs it)."""


class LibraryMissing(ImportError):
    """The library of a task kind is not installed; the message names the extra."""


def require(kind: str) -> None:
    """Raise LibraryMissing unless the library of ``kind`` imports."""
    module, extra = EXTRAS[kind]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise LibraryMissing(
            f"task.kind {kind!r} needs the {extra} package ({type(e).__name__}: "
            f"{e}); install it with: pip install -e '.[{extra}]'"
        ) from None


def split_task_name(task: str) -> tuple[str, str] | None:
    """``"reasoning_gym:leg_counting"`` -> ``("reasoning_gym", "leg_counting")``; None for a
    name that is no library task."""
    kind, sep, name = task.partition(":")
    if not sep or kind not in KINDS or not name:
        return None
    return kind, name


def library_factory(task: str) -> Callable[..., Any] | None:
    """The environment factory of a library task name (None when ``task`` is none).
    Raises LibraryMissing when its library is not installed."""
    parts = split_task_name(task)
    if parts is None or parts[0] == "verifiers":  # verifiers episodes run via the gateway
        return None
    kind, name = parts
    require(kind)
    if kind == "reasoning_gym":
        from actors.env.libs._reasoning_gym import ReasoningGymTask as cls
    else:
        from actors.env.libs._openenv import OpenEnvTask as cls
    factory = functools.partial(cls, name)
    factory.validate_params = functools.partial(cls.validate_params, name)  # type: ignore[attr-defined]
    return factory
