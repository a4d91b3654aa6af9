"""Worker threads for plain (sync) environment methods: bounded per task, stuck calls counted.

Every plain `reset`/`step` runs in a worker thread so that neither a slow nor a stuck
environment blocks the actor's event loop, and its timeout can fire. A thread cannot
be killed: a call past its timeout is abandoned (the episode fails at once) while its
thread keeps running until the environment returns, if ever. Such a call is *stuck*.

Each task gets its own `trio.CapacityLimiter` of `per_task` threads, and a stuck
thread keeps its slot until it returns. So one task whose calls hang can use up only
its own slots (its further calls then fail, saying every thread is stuck) and never
the threads of other tasks or the runtime's shared pool (trio's default limiter,
which would otherwise be exhausted by stuck calls of every task at once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

__all__ = ["EnvCallTimeout", "EnvThreads"]


class EnvCallTimeout(Exception):
    """An environment call ran past its limit (or found no free thread within it)."""


@dataclass
class _Call:
    started: bool = False
    finished: bool = False
    abandoned: bool = False
    counted: bool = False


class EnvThreads:
    """Runs plain environment methods in bounded per-task thread pools.

    Cancellation: cancelling `run` (the caller's scope) abandons the call like a
    timeout does, but raises the cancellation instead of EnvCallTimeout.
    """

    def __init__(self, per_task: int = 16) -> None:
        if per_task < 1:
            raise ValueError(f"per_task must be >= 1, got {per_task}")
        self.per_task = per_task
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._lock = threading.Lock()
        self._stuck: dict[str, int] = {}
        self._stuck_total: dict[str, int] = {}

    def stuck(self) -> dict[str, int]:
        """Per task: calls abandoned past their timeout whose thread still runs."""
        with self._lock:
            return {t: n for t, n in self._stuck.items() if n}

    def stuck_total(self) -> dict[str, int]:
        """Per task: calls ever abandoned while their thread was running."""
        with self._lock:
            return dict(self._stuck_total)

    async def run(self, task: str, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
        """`fn(*args)` in one of `task`'s threads; EnvCallTimeout after `timeout` seconds
        (waiting for a thread included). Exceptions of `fn` propagate."""
        limiter = self._limiters.get(task)
        if limiter is None:
            limiter = self._limiters[task] = trio.CapacityLimiter(self.per_task)
        call = _Call()

        def work() -> Any:
            with self._lock:
                if call.abandoned:  # cancelled before the thread got to it: do not run it at all
                    return None
                call.started = True
            try:
                return fn(*args)
            finally:
                with self._lock:
                    call.finished = True
                    if call.counted:
                        self._stuck[task] -= 1

        try:
            with trio.move_on_after(timeout) as cs:
                return await trio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=limiter)
        finally:
            with self._lock:
                call.abandoned = not call.finished
                if call.started and not call.finished:
                    call.counted = True
                    self._stuck[task] = self._stuck.get(task, 0) + 1
                    self._stuck_total[task] = self._stuck_total.get(task, 0) + 1
                stuck = self._stuck.get(task, 0)
        assert cs.cancelled_caught
        if call.counted:
            raise EnvCallTimeout(
                f"environment {what} timed out after {timeout:g} s; its thread is still "
                f"running ({stuck} of {self.per_task} threads of task {task!r} stuck)"
            )
        raise EnvCallTimeout(
            f"environment {what} found no free thread within {timeout:g} s: all "
            f"{self.per_task} threads of task {task!r} are busy ({stuck} stuck in calls "
            f"past their timeout)"
        )
