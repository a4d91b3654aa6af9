"""A call's first step taken by hand where its message was read, and the rest of it.

``Server._run_inline`` starts an ``async def`` endpoint by sending into its coroutine
itself, in the reader task, so that a call that never suspends is answered without a
task hop. A call that does suspend is run on by the same task through ``resume``, which
is what ``await coro`` would have done from that first step on.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Generator
from typing import Any

__all__ = ["Started", "awaiting", "resume"]


class Started:
    """A call whose first step suspended: its coroutine, the trap it yielded, its context."""

    __slots__ = ("coro", "ctx", "trap")

    def __init__(self, coro: Any, trap: Any, ctx: contextvars.Context) -> None:
        self.coro = coro
        self.trap = trap
        self.ctx = ctx


async def awaiting(aw: Any) -> Any:
    """A coroutine around an awaitable that is not one (an endpoint may return any)."""
    return await aw


@types.coroutine
def resume(started: Started) -> Generator[Any, Any, Any]:
    """The rest of ``await coro`` after its first step was taken by hand (in its context)
    and yielded ``trap``: what the running task's scheduler sends or throws goes on to the
    coroutine, as ``yield from`` does (PEP 380), each step run in the call's context."""
    coro, trap, ctx = started.coro, started.trap, started.ctx
    del started
    while True:
        try:
            sent = yield trap
        except GeneratorExit:
            ctx.run(coro.close)
            raise
        except BaseException as exc:
            try:
                trap = ctx.run(coro.throw, exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                trap = ctx.run(coro.send, sent)
            except StopIteration as stop:
                return stop.value
