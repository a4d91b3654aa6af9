"""Endpoint call kinds: call_one, call, choose, broadcast, stream.

Delivery and failure, per kind:

- ``call_one``: exactly one actor; its value. ``ActorError`` if the endpoint
  raised, ``ActorDied`` if the actor is or becomes dead, ``TypeError`` for
  arguments that do not fit the signature or fail validation on arrival.
- ``call``: every actor of the target; values in rank order. The first failure
  (in rank order) is raised and the other outstanding calls are abandoned.
- ``choose``: one live actor with the fewest calls in flight from this
  process, ties broken by the lowest rank.
- ``broadcast``: every live actor, fire-and-forget, no delivery guarantee
  (dead or restarting ranks are skipped, errors go to the actor's stderr).
- ``stream``: every actor; an async iterator of *values in completion order*
  (not rank order). A failure is raised from the iterator when it arrives.

Cancellation: a cancelled caller abandons its outstanding calls and sends a
cancel message, so the remote task is cancelled too (a plain ``def`` endpoint
that already ran is not undone). Timeouts are the caller's ``trio.fail_after``.
Arguments are referenced, not copied, until sent: do not mutate a tensor or
bytearray passed to ``broadcast`` right after the call.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Generic, ParamSpec, TypeVar

import trio

from ._actor import EndpointDef
from ._conn import Connection, ConnectionSource, Pending, reply_value
from ._errors import ActorDied
from ._tracing import current_traceparent
from ._wire import SCALAR_TYPES, SCALARS, encode

__all__ = ["EndpointRef"]

P = ParamSpec("P")
R = TypeVar("R")


class EndpointRef(Generic[P, R]):
    """One endpoint on a set of ranks of a mesh (all of them, or one for ``mesh[i]``)."""

    def __init__(self, src: ConnectionSource, ranks: list[int], name: str, ep: EndpointDef[P, R] | None) -> None:
        self._src = src
        self._ranks = ranks
        self._name = name
        self._ep = ep
        self._spec = ep.spec if ep is not None else None
        # The numbers of positional arguments a call without keywords may pass unchecked.
        self._arity = range(sys.maxsize) if self._spec is None else self._spec.arity
        self._qual = ep.spec.qualname if ep is not None else f"{src.name}.{name}"
        self._checks_return = self._spec is not None and self._spec.checks_return

    def __repr__(self) -> str:
        return f"<endpoint {self._qual} on ranks {self._ranks}>"

    # -- building requests ------------------------------------------------------
    def _header(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        frames: list[Any] = []
        plain = not kwargs and len(args) in self._arity
        if plain:
            for v in args:  # a loop: a few times cheaper than issuperset(map(type, args)) for a few values
                if type(v) not in SCALAR_TYPES:
                    plain = False
                    break
        if plain:
            # Plain values that fit the signature: most calls.
            header: dict[str, Any] = {"kind": kind, "endpoint": self._name, "args": list(args)}
        else:
            if self._spec is not None:
                self._spec.check_call(args, kwargs)
            a = [
                v if type(v) in SCALARS else encode(v, frames, where=f"{self._qual} argument {i}")
                for i, v in enumerate(args)
            ]
            header = {"kind": kind, "endpoint": self._name, "args": a}
            if kwargs:
                header["kwargs"] = {
                    k: encode(v, frames, where=f"{self._qual} argument {k!r}") for k, v in kwargs.items()
                }
        tp = current_traceparent()
        if tp is not None:
            header["trace"] = tp
        return header, frames

    def _result(self, p: Pending) -> Any:
        value = reply_value(p)
        if not self._checks_return:
            return value
        assert self._spec is not None
        try:
            return self._spec.validate_return(value)
        except TypeError:
            raise
        except Exception as exc:
            raise TypeError(f"{self._qual} returned a value that does not match its annotation: {exc}") from None

    async def _wait(self, p: Pending) -> Any:
        await p.wait()
        return self._result(p)

    # -- call kinds ---------------------------------------------------------------
    # A call to a dead actor raises ActorDied after a trio checkpoint, never synchronously:
    # a loop that retries on ActorDied still lets other tasks (and Ctrl-C) run.
    async def call_one(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call exactly one actor (the target must have one rank) and return its value."""
        if len(self._ranks) != 1:
            raise ValueError(f"call_one on {len(self._ranks)} actors; index the mesh (mesh[i]) or use call/choose")
        rank = self._ranks[0]
        header, frames = self._header("call", args, kwargs)
        try:
            conn = self._src.connection_now(rank) or await self._src.connect(rank)
            p = conn.request(header, frames, reply=True, rank=rank, waits_next=True)
        except ActorDied:
            await trio.lowlevel.checkpoint()
            raise
        assert p is not None
        await p.wait()
        return self._result(p)

    async def call(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Call every actor; values in rank order."""
        header, frames = self._header("call", args, kwargs)
        pending: list[Pending] = []
        try:
            for rank in self._ranks:
                conn = await self._src.connect(rank)
                p = conn.request(dict(header), frames, reply=True, rank=rank)
                assert p is not None
                pending.append(p)
            return [await self._wait(p) for p in pending]
        except BaseException as exc:
            for p in pending:
                p.abandon()
            if isinstance(exc, ActorDied):
                await trio.lowlevel.checkpoint()
            raise

    async def choose(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the live actor with the fewest calls in flight (ties: lowest rank)."""
        header, frames = self._header("call", args, kwargs)
        best: tuple[int, int, Connection] | None = None
        first_death: ActorDied | None = None
        for rank in self._ranks:
            try:
                conn = self._src.connection_now(rank)
            except ActorDied as exc:
                first_death = first_death or exc
                continue
            if conn is None:
                continue
            load = len(conn.pending)
            if best is None or load < best[0]:
                best = (load, rank, conn)
        if best is None:
            if first_death is not None:
                await trio.lowlevel.checkpoint()
                raise first_death
            # Every candidate is restarting: wait for the first rank to come back.
            return await EndpointRef(self._src, self._ranks[:1], self._name, self._ep).call_one(*args, **kwargs)
        try:
            p = best[2].request(header, frames, reply=True, rank=best[1], waits_next=True)
        except ActorDied:
            await trio.lowlevel.checkpoint()
            raise
        assert p is not None
        return await self._wait(p)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every live actor without waiting for (or receiving) any reply."""
        header, frames = self._header("send", args, kwargs)
        for rank in self._ranks:
            try:
                conn = self._src.connection_now(rank)
                if conn is not None:
                    conn.request(dict(header), frames, reply=False)
            except ActorDied:
                continue

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[R]:
        """Call every actor; iterate over the values as they arrive (completion order)."""
        header, frames = self._header("call", args, kwargs)
        return _Stream(self, header, frames)


class _Stream(AsyncIterator[Any]):
    """Replies of one ``stream`` call, in completion order.

    Breaking out of the loop early leaves the other calls running unless
    ``aclose()`` is called (which abandons them); their replies are dropped.
    """

    def __init__(self, ref: EndpointRef[Any, Any], header: dict[str, Any], frames: list[Any]) -> None:
        self._ref = ref
        self._header = header
        self._frames = frames
        self._sent = False
        self._pending: list[Pending] = []
        self._remaining = 0
        self._done: deque[Pending] = deque()
        self._wakeup = trio.Event()

    def _sink(self, p: Pending) -> None:
        # May run inside a later request's send (replies are drained there too).
        self._remaining -= 1
        self._done.append(p)
        self._wakeup.set()

    async def _send(self) -> None:
        self._sent = True
        self._remaining = len(self._ref._ranks)
        for rank in self._ref._ranks:
            conn = await self._ref._src.connect(rank)
            p = conn.request(dict(self._header), self._frames, reply=True, sink=self._sink, rank=rank)
            assert p is not None
            self._pending.append(p)

    async def __anext__(self) -> Any:
        try:
            if not self._sent:
                await self._send()
            while not self._done:
                if self._remaining == 0:
                    raise StopAsyncIteration
                self._wakeup = trio.Event()
                await self._wakeup.wait()
            return self._ref._result(self._done.popleft())
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            if not p.done:
                p.abandon()
        self._remaining = 0
        self._done.clear()
