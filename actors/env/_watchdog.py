"""A watchdog for the env actor's event loop: names an async environment that blocks it.

An `async def` environment method that calls blocking code (`time.sleep`, a
synchronous socket, a long computation) freezes every episode of the actor and its
own timeout cannot fire: trio cancels only at an `await`. Nothing can preempt it,
but it can be seen: a trio instrument notes which task is running a step and since
when; a watchdog thread looks every `poll_s` and, when one step has run longer than
`threshold_s`, reports the environment call that task is in (labels come from
`label`), once per stall, rate-limited per environment. Stalls are also counted for
`stats`, with the longest one.

The report says what the loop's thread did meanwhile, from the kernel's per-thread
scheduler counters (Linux): computing, waiting in a blocking call, or waiting for a CPU.
The last is not the environment's fault: a machine with more busy processes than cores
stalls every loop on it.
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

Counters = tuple[float, float, float]
"""A thread's scheduler counters: (clock, seconds on a CPU, seconds waiting for one)."""


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
        self._schedstat = ""  # the loop thread's scheduler counters (Linux), set by `run`
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
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
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
        # A step, and the counters of the poll before the one that first saw it: they cover
        # the step from its start even when this thread first runs long after (a starved
        # loop thread holding the GIL delays it too).
        first_seen: tuple[Any, float, Counters | None] | None = None
        last = self._counters()
        while not stop.wait(self.poll_s):
            task, since = self._running, self._since
            previous, last = last, self._counters()
            if task is None or (task, since) == reported:
                continue
            if first_seen is None or first_seen[:2] != (task, since):
                first_seen = (task, since, previous)
            blocked = time.perf_counter() - since
            if blocked > self.threshold_s:
                reported = (task, since)
                name = self._name(task)
                self._limit.log(
                    name,
                    f"env actor: {name} has blocked the event loop for {blocked:.1f} s"
                    f"{_what_it_did(first_seen[2], last)}",
                    self._report,
                )

    def _counters(self) -> Counters | None:
        """The loop thread's counters now, or None where the kernel does not give them."""
        try:
            with open(self._schedstat, "rb") as f:
                on_cpu, waiting = f.read().split()[:2]
            return time.perf_counter(), int(on_cpu) / 1e9, int(waiting) / 1e9
        except (OSError, ValueError):  # not Linux, or the counters are missing
            return None


_BLOCKING_ADVICE = (
    "every episode of this actor is frozen and timeouts cannot fire; make the method plain to run it in a thread"
)


def _what_it_did(before: Counters | None, now: Counters | None) -> str:
    """The report's second half: what the loop's thread did between the two readings."""
    if before is None or now is None or now[0] - before[0] < 0.05:
        return f" (an async environment calling blocking code: {_BLOCKING_ADVICE})"
    span = now[0] - before[0]
    on_cpu, waiting = (now[1] - before[1]) / span, (now[2] - before[2]) / span
    if waiting >= 0.5:
        return (
            f" (its thread waited for a CPU {waiting:.0%} of the last {span:.1f} s: this machine has more "
            "busy processes than cores, so the environment may not be at fault)"
        )
    if on_cpu >= 0.5:
        return f" (computing, {on_cpu:.0%} on a CPU: an async environment running blocking work; {_BLOCKING_ADVICE})"
    return (
        f" (in a blocking call, {on_cpu:.0%} on a CPU: an async environment calling blocking code; {_BLOCKING_ADVICE})"
    )
