"""A watchdog for the env actor's event loop: names an async environment that blocks it.

An `async def` environment method that calls blocking code (`time.sleep`, a
synchronous socket, a long computation) freezes every episode of the actor and its
own timeout cannot fire: trio cancels only at an `await`. Nothing can preempt it,
but it can be seen: a trio instrument notes which task is running a step and since
when; a watchdog thread looks every `poll_s` and, when one step has run longer than
`threshold_s`, reports the environment call that task is in (labels come from
`label`), once per stall, rate-limited per environment. Stalls are also counted for
`stats`, with the longest one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from orchestrator.runtime import RateLimiter

__all__ = ["LoopWatchdog"]


class LoopWatchdog(trio.abc.Instrument):
    """Detects steps of the event loop longer than `threshold_s` and names the culprit.

    `run` is its lifetime (start it in a nursery with `nursery.start`): it installs
    the instrument and the thread, and removes both when cancelled. `report` is
    called from the watchdog thread (it must be thread-safe; printing is).
    """

    def __init__(
        self,
        report: Callable[[str], None],
        *,
        threshold_s: float = 1.0,
        poll_s: float = 0.1,
        report_interval_s: float = 10.0,
    ) -> None:
        self.threshold_s = threshold_s
        self.poll_s = poll_s
        self._report = report
        self._limit = RateLimiter(report_interval_s)
        self._labels: dict[Any, str] = {}
        self._running: Any = None
        self._since = time.perf_counter()
        self._stall_label = ""  # the label a stalling step held when it left it
        self.stalls = 0
        self.longest_s = 0.0
        self.last_blocker = ""

    # -- instrument (runs in the trio thread, around every task step) ------------------
    def before_task_step(self, task: Any) -> None:
        self._since = time.perf_counter()
        self._running = task

    def after_task_step(self, task: Any) -> None:
        if self._running is not task:  # the step that installed the instrument had no "before"
            return
        self._running = None
        took = time.perf_counter() - self._since
        if took > self.threshold_s:
            self.stalls += 1
            self.longest_s = max(self.longest_s, took)
            self.last_blocker = self._stall_label or self._name(task)
        self._stall_label = ""

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """While inside, the current trio task is reported as `name` if it stalls the loop."""
        task = trio.lowlevel.current_task()
        self._labels[task] = name
        try:
            yield
        finally:
            self._labels.pop(task, None)
            if self._running is task and time.perf_counter() - self._since > self.threshold_s:
                self._stall_label = name  # the step goes on past the label; keep who stalled it

    def _name(self, task: Any) -> str:
        return self._labels.get(task) or f"trio task {getattr(task, 'name', task)!r}"

    # -- lifetime ----------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(stop,), name="env-loop-watchdog", daemon=True)
        trio.lowlevel.add_instrument(self)
        thread.start()
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            stop.set()
            trio.lowlevel.remove_instrument(self)
            thread.join()

    def _watch(self, stop: threading.Event) -> None:
        reported: tuple[Any, float] | None = None
        while not stop.wait(self.poll_s):
            task, since = self._running, self._since
            if task is None or (task, since) == reported:
                continue
            blocked = time.perf_counter() - since
            if blocked > self.threshold_s:
                reported = (task, since)
                name = self._name(task)
                self._limit.log(
                    name,
                    f"env actor: {name} has blocked the event loop for {blocked:.1f} s "
                    "(an async environment calling blocking code: every episode of this "
                    "actor is frozen and timeouts cannot fire; make the method plain "
                    "to run it in a thread)",
                    self._report,
                )
