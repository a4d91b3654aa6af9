"""Checking a task before any actor starts: it exists, and it accepts its params.

`check_task` imports the task modules (as every env actor will), looks the task up
in the registry and validates its params: with the factory's `validate_params`
classmethod when it has one (for environments whose constructor is expensive or
has side effects), else by constructing one instance (constructors check their
params; no episode is played). Run-config loading calls it, so an unknown task or
a bad param is one line naming the field, not a failure in every episode.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from actors.env._interface import registered_tasks, task_factory
from actors.env._modules import TaskModuleError, import_task_module
from actors.env.libs import LibraryMissing

__all__ = ["TaskCheckError", "check_task"]


class TaskCheckError(ValueError):
    """The task cannot be played: the message names the field (task.name, .params, .modules)."""


def _first_line(e: BaseException | None) -> str:
    text = str(e).strip() if e is not None else ""
    return text.splitlines()[0] if text else ""


def check_task(name: str, params: dict[str, Any] | None = None, modules: Iterable[str] = ()) -> None:
    """Raise TaskCheckError unless task `name` exists (after importing `modules`) and
    accepts `params`."""
    params = dict(params or {})
    for module in modules:  # dotted names or .py paths, as the env actors import them
        try:
            import_task_module(module)
        except TaskModuleError as e:  # the user's module: any error is theirs to see, in one line
            cause = e.__cause__
            raise TaskCheckError(
                f"task.modules: cannot import {module!r}: {type(cause).__name__}: {_first_line(cause)}"
            ) from None
    try:
        factory = task_factory(name)
    except LibraryMissing as e:
        raise TaskCheckError(str(e)) from None
    if factory is None:
        raise TaskCheckError(f"task.name: unknown task {name!r} (registered: {', '.join(registered_tasks())})")
    validate = getattr(factory, "validate_params", None)
    try:
        if validate is not None:
            validate(params)
            return
        try:
            inspect.signature(factory).bind(**params)
        except TypeError as e:
            raise TaskCheckError(f"task.params: task {name!r} does not take {params}: {e}") from None
        except ValueError:  # no signature to inspect (a builtin): constructing will tell
            pass
        factory(**params)
    except TaskCheckError:
        raise
    except Exception as e:
        raise TaskCheckError(f"task.params: task {name!r} rejected {params}: {type(e).__name__}: {e}") from None
