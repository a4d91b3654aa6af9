"""Importing the user's task modules: dotted module names or ``.py`` files.

``[task] modules = ["my_pkg.tasks", "path/to/tasks.py"]``: each entry is imported in
every environment process before its first episode (and once in the controller, which
checks the task and its parameters before any actor starts), so their
``@register_task`` classes exist there.  A file is imported under a module name
derived from its absolute path, the same in every process, so re-registering the
same class (a second import) is harmless.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["TaskModuleError", "import_task_module", "import_task_modules", "resolve_callable"]


_FILE_IMPORT = threading.RLock()


class TaskModuleError(ImportError):
    """A task module (or a ``module:function`` reference) could not be imported; one line."""


def _is_path(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def import_task_module(entry: str) -> ModuleType:
    """Import one entry: a dotted module name, or the path of a ``.py`` file.

    Raises TaskModuleError naming the entry and the cause (missing file, syntax error,
    an exception raised while the module ran).
    """
    try:
        if not _is_path(entry):
            return importlib.import_module(entry)
        path = Path(entry).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {path}")
        name = f"flotilla_tasks_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        # Environments' worker threads may import the same file at once: one runs it, the
        # others wait (a module in sys.modules before it has finished running is half made).
        with _FILE_IMPORT:
            if name in sys.modules:
                return sys.modules[name]
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path} as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TaskModuleError(f"task module {entry!r} failed to import: {type(e).__name__}: {first}") from e


def import_task_modules(entries: Sequence[str]) -> list[ModuleType]:
    """Import every entry in order (see ``import_task_module``)."""
    return [import_task_module(e) for e in entries]


def resolve_callable(ref: str) -> Callable[..., Any]:
    """``"module:function"`` (module dotted or a ``.py`` path) -> the function.

    Raises TaskModuleError naming the reference when it is malformed, the module fails
    to import, or the attribute is missing or not callable.
    """
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise TaskModuleError(f"{ref!r} is not of the form 'module:function'")
    fn = getattr(import_task_module(module_ref), attr, None)
    if not callable(fn):
        raise TaskModuleError(f"{ref!r}: module {module_ref!r} has no function {attr!r}")
    return fn
