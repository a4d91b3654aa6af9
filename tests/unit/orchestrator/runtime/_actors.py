"""Small purpose-named actors for the runtime tests (importable by actor processes)."""

from __future__ import annotations

import contextvars
import os
from typing import TYPE_CHECKING, Any

import trio
from pydantic import BaseModel, ConfigDict

from orchestrator.runtime import Actor, ActorRef, Mesh, current_rank, endpoint, span

if TYPE_CHECKING:
    import torch


class Counter(Actor):
    def __init__(self, start: int) -> None:
        self.n = start

    @endpoint
    async def incr(self, by: int = 1) -> int:
        self.n += by
        return self.n

    @endpoint
    def value(self) -> int:
        return self.n

    @endpoint
    async def echo(self, x: int) -> int:
        await trio.lowlevel.checkpoint()
        return x

    @endpoint
    def rank(self) -> int:
        return current_rank()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    async def block(self) -> None:
        await trio.sleep_forever()

    @endpoint
    async def nap(self, seconds: float) -> None:
        await trio.sleep(seconds)


class Gate(Actor):
    """Calls park on ``wait`` until ``open``; ``wait_parked(n)`` returns once n calls are parked."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.changed = trio.Event()
        self.parked = 0
        self.cancelled = 0
        self.order: list[int] = []

    def _bump(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @endpoint
    async def wait(self) -> str:
        self.parked += 1
        self._bump()
        try:
            await self.event.wait()
        except trio.Cancelled:
            self.cancelled += 1
            self._bump()
            raise
        return "opened"

    @endpoint
    def open(self) -> None:
        self.event.set()

    @endpoint
    def counts(self) -> dict[str, int]:
        return {"parked": self.parked, "cancelled": self.cancelled}

    @endpoint
    async def wait_parked(self, n: int) -> None:
        while self.parked < n:
            await self.changed.wait()

    @endpoint
    async def wait_cancelled(self, n: int) -> None:
        while self.cancelled < n:
            await self.changed.wait()

    @endpoint
    async def record(self, i: int) -> None:
        self.order.append(i)
        await trio.lowlevel.checkpoint()

    @endpoint
    def recorded(self) -> list[int]:
        return self.order

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Holder(Actor):
    """Async endpoints that take task-bound trio state (a lock, a cancel scope, a nursery)
    before their first suspension and release it after; and what a call sees of the
    trace context and context variables."""

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.n = 0

    @endpoint
    async def locked_incr(self) -> int:
        async with self.lock:  # the lock's owner is the task that acquired it
            n = self.n + 1
            await trio.lowlevel.checkpoint()
            self.n = n
            return n

    @endpoint
    async def scoped(self, seconds: float) -> bool:
        with trio.move_on_after(seconds) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
        return scope.cancelled_caught

    @endpoint
    async def trace_seen(self, suspend: bool) -> str | None:
        from orchestrator.runtime._tracing import current_traceparent

        if suspend:
            await trio.lowlevel.checkpoint()
        return current_traceparent()

    @endpoint
    async def set_var(self, value: str, suspend: bool) -> str:
        _VAR.set(value)
        if suspend:
            await trio.lowlevel.checkpoint()
        return _VAR.get()

    @endpoint
    async def get_var(self) -> str:
        return _VAR.get()


_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("holder_var", default="unset")


class Item(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    weights: Any
    tags: tuple[str, ...] = ()


class Echo(Actor):
    @endpoint
    def shm_segments_created(self) -> int:
        """Shared-memory segments this process has made to send frames (reuse adds none)."""
        from orchestrator.runtime._shm import segments_created

        return segments_created()

    @endpoint
    async def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def thread_policies(self) -> dict[str, int]:
        """This process's threads by name (its main thread as "main"; ZeroMQ's are "ZMQbg/..."),
        with their scheduling policy."""
        pid = os.getpid()
        tasks = f"/proc/{pid}/task"
        return {
            "main" if int(t) == pid else open(f"{tasks}/{t}/comm").read().strip(): os.sched_getscheduler(int(t))
            for t in os.listdir(tasks)
        }

    @endpoint
    def lent(self, nbytes: int, value: int) -> torch.Tensor:
        """A tensor written straight into memory the runtime lends for sending."""
        import torch

        from orchestrator.runtime import lend_buffer

        return torch.frombuffer(lend_buffer(nbytes), dtype=torch.uint8).fill_(value)

    @endpoint
    async def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @endpoint
    async def item(self, item: Item) -> Item:
        return item

    @endpoint
    async def scale(self, xs: list[float], factor: float = 2.0) -> list[float]:
        return [x * factor for x in xs]

    @endpoint
    def liar(self) -> int:
        return "not an int"  # type: ignore[return-value]


class Relay(Actor):
    """Calls another actor it was handed (a handle crossing the wire)."""

    @endpoint
    async def via_mesh(self, counters: Mesh[Counter], by: int) -> list[int]:
        return await counters.incr.call(by)

    @endpoint
    async def via_actor(self, counter: ActorRef[Counter], by: int) -> int:
        return await counter.incr.call_one(by)

    @endpoint
    async def traced_child(self, label: str) -> None:
        with span("relay.inner", label=label):
            pass

    @endpoint
    async def failing_episode(self, label: str) -> None:
        """A ``rollout`` that opens a step, a kept kind with a child, another step, and fails."""
        with span("rollout", label=label):
            with span("env.step", turn=0):
                pass
            with span("relay.kept"), span("relay.kept.part"):
                pass
            with span("env.step", turn=1):
                pass
            raise RuntimeError("episode broke")


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor failed")


class Lifecycle(Actor):
    """Starts a background task in on_start; on_stop leaves a file behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ticks = 0
        self.started = trio.Event()

    async def on_start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._background)

    async def _background(self) -> None:
        self.ticks += 1
        self.started.set()
        await trio.sleep_forever()

    @endpoint
    async def background_ran(self) -> bool:
        await self.started.wait()
        return self.ticks == 1

    async def on_stop(self) -> None:
        await trio.Path(self.path).write_text("stopped")


class HangsOnRestart(Actor):
    """Constructs normally, except while the file `hang` exists: then its constructor never
    returns (a respawn that hangs)."""

    def __init__(self, hang: str) -> None:
        import time

        while os.path.exists(hang):
            time.sleep(0.1)

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Leaver(Actor):
    """On SIGTERM, answers its waiting call with ``size`` bytes, then lets the process exit
    (as a leaving host tells each owner that it left, then stops)."""

    def __init__(self) -> None:
        self.leave = trio.Event()
        self.answered = trio.Event()
        self.waiting = trio.Event()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def last_word(self, size: int) -> bytes:
        self.waiting.set()
        await self.leave.wait()
        self.answered.set()
        return b"x" * size

    @endpoint
    async def wait_waiting(self) -> None:
        await self.waiting.wait()

    async def on_signal(self) -> None:
        self.leave.set()
        await self.answered.wait()


class QuickLeaver(Leaver):
    """A Leaver whose process ends the moment its last reply has left (the owner then
    sees the exit while a large reply may still be on its way in)."""

    async def on_signal(self) -> None:
        from orchestrator.runtime._child import replies_sent

        await super().on_signal()
        await replies_sent()
        os._exit(0)


class Collector(Actor):
    """Reports its process's cyclic-collector settings."""

    def __init__(self) -> None:
        self.made_at_start = [object() for _ in range(1000)]

    @endpoint
    def gc_state(self) -> tuple[int, int]:
        import gc

        return gc.get_threshold()[0], gc.get_freeze_count()
