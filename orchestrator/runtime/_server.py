"""Actor side: one ROUTER socket read by one task at a time; calls run on reusable tasks.

A call with nothing queued ahead of it starts inline in the task that holds the
reader role: a plain ``def`` endpoint runs to its end there, and an ``async def``
endpoint runs until its first suspension (most fast endpoints never suspend, and
reply at once). If it suspends, that task keeps running it to its end, with the
call's own cancel scope, and hands the reader role to a parked task. Calls that
arrive while earlier ones have not started yet are handed to parked tasks
(spawned when none is idle) and start in arrival order; each call can be
cancelled on its own.

Message kinds (header ``"kind"``): ``init`` (constructor arguments, once),
``call`` (reply expected), ``send`` (fire-and-forget), ``cancel`` (cancel the
running call with the same id from the same peer). Replies: ``ok`` (value),
``err`` (exception type, message, traceback), ``bad`` (the request itself was
invalid: malformed message, unknown endpoint, arguments that fail validation).

Malformed input never stops the actor: the reader answers ``bad`` when it can
tell who asked, else drops the message. Either way it is counted per peer
(``_actor.wire_rejects``, read by every actor's ``runtime_stats`` endpoint) and
logged on stderr at most once per second per peer.
"""

from __future__ import annotations

import contextvars
import traceback
import types
from typing import Any

import outcome
import trio
import zmq

from . import _tracing
from ._actor import Actor, EndpointDef, _Spec, endpoints_of, wire_rejects
from ._errors import WireError
from ._ratelimit import clip
from ._steps import Started, awaiting, resume
from ._wire import SCALAR_TYPES, SCALARS, decode, dumps, encode, loads
from ._zsock import ZSocket, log

__all__ = ["Server", "exception_info"]

_MAX_IDLE = 32  # idle server tasks kept for reuse
_READ = "read"  # the job of holding the reader role


def exception_info(exc: BaseException) -> dict[str, str]:
    t = type(exc)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    tb = "".join(traceback.format_exception(exc))
    return {"type": name, "msg": str(exc), "tb": tb}


class Server:
    """Serves one actor instance on a bound ROUTER socket.

    Cancellation: cancelling ``serve`` cancels every running call (callers see
    the process go away) and then runs ``on_stop``. Errors: endpoint exceptions
    become ``err`` replies; the actor keeps serving.
    """

    def __init__(self, cls: type[Actor], sock: zmq.Socket[Any], *, name: str, rank: int, local: bool = False) -> None:
        self.cls = cls
        self.name = name
        self.rank = rank
        self.endpoints: dict[str, EndpointDef[Any, Any]] = endpoints_of(cls)
        self.actor: Actor | None = None
        self.ready = trio.Event()
        self.running: dict[tuple[bytes, Any], trio.CancelScope] = {}
        # local: bound on ipc://, so every peer shares the machine (large frames via /dev/shm)
        self.z = ZSocket(sock, self._on_message, copy_parts=2, spin=True, shm=local, close_on_exit=False, marked=True)
        self.linger_ms = 0  # how long replies still queued at close get to leave (after a drain)
        self._nursery: trio.Nursery | None = None
        self._next_seq = 0
        self._started = 0
        self._turns: dict[int, trio.Event] = {}
        self._idle: list[trio.lowlevel.Task] = []
        # Calls handed to a worker and not started yet; a cancel removes its call from here,
        # and the worker then skips it.
        self._queued: set[tuple[bytes, Any]] = set()
        self._init_spec = _Spec(cls.__init__, f"{cls.__qualname__}.__init__")
        # The task in the reader role while it reads, and its cancel scope (which becomes
        # the scope of an async call that suspends in its first step there).
        self._reader: trio.lowlevel.Task | None = None
        self._reader_scope: trio.CancelScope | None = None
        # That call, between its suspension and the end of the reader's drain.
        self._adopted: _Adopted | None = None

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await nursery.start(self._task, _READ)
                    task_status.started()
            finally:
                self.z.close(self.linger_ms)
        finally:
            if self.actor is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    try:
                        await self.actor.on_stop()
                    except Exception as exc:
                        log(f"{self.name}[{self.rank}].on_stop raised: {exc!r}")

    # -- replies ---------------------------------------------------------------
    def _reply(self, ident: bytes, header: dict[str, Any], frames: list[Any] = ()) -> None:  # type: ignore[assignment]
        try:
            if frames:
                self.z.send([ident, dumps(header), *frames])
            else:
                self.z.send_header(dumps(header), ident)
        except zmq.ZMQError as exc:
            log(f"{self.name}[{self.rank}]: reply not sent: {exc}")

    def _rejected(self, ident: Any, msg: str) -> None:
        try:
            peer = bytes(memoryview(ident)).hex()
        except TypeError:  # no frame at all
            peer = "?"
        wire_rejects.record(
            peer, f"{self.name}[{self.rank}]: rejected a request from peer {clip(peer, 64)}: {clip(msg)}", log
        )

    def _bad(self, ident: bytes, rid: Any, msg: str) -> None:
        self._rejected(ident, msg)
        self._reply(ident, {"id": rid if type(rid) is int else None, "kind": "bad", "message": msg})

    def _answer(self, ident: bytes, rid: Any, value: Any, spec: _Spec | None) -> None:
        if type(value) in SCALARS:
            self._reply(ident, {"id": rid, "kind": "ok", "value": value})
            return
        frames: list[Any] = []
        try:
            tree = encode(value, frames, where="return value" if spec is None else f"{spec.qualname} return value")
        except TypeError as exc:
            self._reply(ident, {"id": rid, "kind": "err", "error": exception_info(exc)})
            return
        self._reply(ident, {"id": rid, "kind": "ok", "value": tree}, frames)

    def _error(self, ident: bytes, rid: Any, exc: BaseException, reply: bool, what: str) -> None:
        if reply:
            self._reply(ident, {"id": rid, "kind": "err", "error": exception_info(exc)})
        else:
            log(f"{self.name}[{self.rank}]: {what} raised:\n" + exception_info(exc)["tb"])

    # -- dispatch --------------------------------------------------------------
    def _on_message(self, frames: list[Any]) -> bool | None:
        if len(frames) < 2:
            self._rejected(frames[0] if frames else None, f"dropped a message with {len(frames)} frame(s)")
            return
        ident = frames[0]
        try:
            header = loads(frames[1])
        except WireError as exc:
            self._bad(ident, None, str(exc))
            return
        if len(header) == 4 and len(frames) == 2 and header.get("kind") == "call":
            done = self._plain_call(ident, header)
            if done is not None:
                return done
        rid, kind = header.get("id"), header.get("kind")
        if kind == "cancel":
            key = (ident, rid)
            if key in self.running:
                self.running[key].cancel()
            else:  # not started yet (if queued): it never will be
                self._queued.discard(key)
            return
        if type(rid) is not int:
            self._bad(ident, None, f"request id must be an integer, got {rid!r}")
            return
        try:
            args, kwargs = self._decode_args(header, frames[1:])
        except (WireError, TypeError) as exc:
            self._bad(ident, rid, str(exc))
            return
        if kind == "init":
            assert self._nursery is not None
            self._nursery.start_soon(self._init, ident, rid, args, kwargs)
            return
        if kind not in ("call", "send"):
            self._bad(ident, rid, f"unknown message kind {kind!r}")
            return
        name = header.get("endpoint")
        ep = self.endpoints.get(name) if type(name) is str else None
        if ep is None:
            self._bad(ident, rid, f"{self.cls.__qualname__} has no endpoint {name!r}")
            return
        try:
            args, kwargs = ep.spec.validate_args(args, kwargs)
        except Exception as exc:
            self._bad(ident, rid, f"{ep.spec.qualname}: invalid arguments: {exc}")
            return
        reply = kind == "call"
        tp = header.get("trace")
        if self._starts_here(ep):
            return self._run_inline(ep, ident, rid, args, kwargs, reply, tp)
        seq = self._next_seq
        self._next_seq += 1
        self._queued.add((ident, rid))
        self._hand_on((seq, ep, ident, rid, args, kwargs, reply, tp))

    def _plain_call(self, ident: bytes, header: dict[str, Any]) -> bool | None:
        """Most calls' path: a call with nothing but plain positional values (no keyword
        arguments, frames or trace: a header of id, kind, endpoint and args) that fit the
        endpoint's signature and pass its checks, and that can start here
        (``_starts_here``). It is served as ``_run_inline`` serves a call, with ``_step``
        and a plain value's ``_answer`` written out: on a small machine the four Python
        calls that saves were several percent of a round trip
        (benchmarks/records/2026-12-07-plain-call-path.md). Returns None when the message
        is not such a call (nothing was done: the general path takes it), else what
        ``_on_message`` returns."""
        rid, name, args = header.get("id"), header.get("endpoint"), header.get("args")
        ep = self.endpoints.get(name) if type(name) is str else None
        if ep is None or type(rid) is not int or type(args) is not list:
            return None
        spec = ep.spec
        if not (len(args) in spec.arity and SCALAR_TYPES.issuperset(map(type, args)) and self._starts_here(ep)):
            return None
        if not spec.unchecked:
            try:
                args, _ = spec.validate_args(args, {})
            except Exception:
                return None  # the general path says what is wrong
        self._next_seq += 1
        self._started += 1
        ctx = contextvars.copy_context()
        try:
            if not ep.is_async:
                value = ctx.run(ep.fn, self.actor, *args)
            else:
                coro = ep.fn(self.actor, *args)
                if type(coro) is not types.CoroutineType:
                    coro = awaiting(coro)
                try:
                    trap = ctx.run(coro.send, None)
                except StopIteration as stop:
                    value = stop.value
                else:
                    self._adopt(Started(coro, trap, ctx), (ident, rid), ep, True)
                    return True
        except Exception as exc:
            self._error(ident, rid, exc, True, spec.qualname)
            return False
        if type(value) in SCALAR_TYPES:
            try:
                self.z.send_header(dumps({"id": rid, "kind": "ok", "value": value}), ident)
            except zmq.ZMQError as exc:
                log(f"{self.name}[{self.rank}]: reply not sent: {exc}")
        else:
            self._answer(ident, rid, value, spec)
        return False

    def _starts_here(self, ep: EndpointDef[Any, Any]) -> bool:
        """Whether a call arriving now can start where it was read, without a task hop:
        nothing is queued ahead of it, and a plain function runs to its end in any task,
        while an async one's first step runs only in the reader task (which can then run
        it on, see ``_run_inline``)."""
        return (
            self._started == self._next_seq
            and self._adopted is None
            and self.ready.is_set()
            and (not ep.is_async or trio.lowlevel.current_task() is self._reader)
        )

    def _hand_on(self, job: Any) -> None:
        """Give a job (a queued call, or the reader role) to a parked task, or a new one."""
        if self._idle:
            trio.lowlevel.reschedule(self._idle.pop(), outcome.Value(job))
        else:
            assert self._nursery is not None
            self._nursery.start_soon(self._task, job)

    def _decode_args(self, header: dict[str, Any], frames: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        a, w = header.get("args", []), header.get("kwargs", {})
        if type(a) is not list or type(w) is not dict:
            raise WireError("arguments must be a list and keyword arguments an object")
        if len(frames) == 1 and not w and SCALAR_TYPES.issuperset(map(type, a)):
            return a, w
        args, kwargs = decode([a, w], frames)
        return args, kwargs

    def _step(self, ep: EndpointDef[Any, Any], args: list[Any], kwargs: dict[str, Any], tp: Any) -> Any:
        """Run a call's first step (a plain function: all of it) in a context of its own.

        Returns the value when the call finished, a ``Started`` when it suspended (the
        caller's task must resume it, see ``resume``); raises what the endpoint raised.
        The context is a copy of the task's (one a new task would get), so what a call
        sets there (its trace parent, its spans, context variables) stays its own.
        """
        ctx = contextvars.copy_context()
        if tp is not None:
            ctx.run(_tracing.adopt_remote_parent, tp)
        if not ep.is_async:
            return ctx.run(ep.fn, self.actor, *args, **kwargs)
        # A wrapper that is not itself a coroutine function runs its own code now: under the
        # caller's span when there is one.
        coro = ep.fn(self.actor, *args, **kwargs) if tp is None else ctx.run(ep.fn, self.actor, *args, **kwargs)
        if type(coro) is not types.CoroutineType:  # another awaitable: await it in a coroutine
            coro = awaiting(coro)
        try:
            trap = ctx.run(coro.send, None)
        except StopIteration as stop:
            return stop.value
        return Started(coro, trap, ctx)

    def _run_inline(
        self,
        ep: EndpointDef[Any, Any],
        ident: bytes,
        rid: int,
        args: list[Any],
        kwargs: dict[str, Any],
        reply: bool,
        tp: Any,
    ) -> bool:
        """Start a call where the message was read (inside a drain), without a task hop.

        If it finishes (a plain function always does; most fast async endpoints never
        suspend), it is answered now. If an async call suspends (only in the reader task),
        it is adopted: the reader's cancel scope becomes the call's (a cancel message
        cancels it), and once the drain is over this task hands the reader role on and
        resumes the call (``_finish``). Between the suspension and the resumption this
        task neither waits nor runs endpoint code, so to trio it is as if this task had
        awaited the endpoint.

        Returns whether the call was adopted, which ends the drain (``_on_message``'s
        return): until its trap is yielded to trio, this task must run nothing else. A
        later message's handler could wake that trap early (a cancel aborts another call's
        wait, whose abort sends on a connection and completes the replies read there,
        this call's among them); trio then finds the task scheduled twice if the call is
        cancelled too. The next reader drains what is left before it waits.
        """
        self._next_seq += 1
        self._started += 1
        try:
            value = self._step(ep, args, kwargs, tp)
        except Exception as exc:
            self._error(ident, rid, exc, reply, ep.spec.qualname)
            return False
        if type(value) is not Started:
            if reply:
                self._answer(ident, rid, value, ep.spec)
            return False
        self._adopt(value, (ident, rid), ep, reply)
        return True

    def _adopt(self, started: Started, key: tuple[bytes, int], ep: EndpointDef[Any, Any], reply: bool) -> None:
        """Make a call that suspended in its first step the reader task's (``_run_inline``)."""
        assert self._reader_scope is not None
        self.running[key] = self._reader_scope
        self._adopted = _Adopted(started, key, ep, reply)

    async def _finish(self, call: _Adopted) -> None:
        """Run an adopted call from its first suspension to its end, and answer it."""
        (ident, rid), ep = call.key, call.ep
        try:
            value = await resume(call.started)
        except Exception as exc:
            self._error(ident, rid, exc, call.reply, ep.spec.qualname)
        else:
            if call.reply:
                self._answer(ident, rid, value, ep.spec)
        finally:
            self.running.pop(call.key, None)

    async def _turn(self, seq: int) -> None:
        """Wait until every earlier call has started (trio does not start tasks in FIFO order)."""
        if not self.ready.is_set():
            await self.ready.wait()
        if self._started != seq:
            ev = self._turns[seq] = trio.Event()
            await ev.wait()
        self._pass_turn(seq)

    def _pass_turn(self, seq: int) -> None:
        self._started = seq + 1
        nxt = self._turns.pop(seq + 1, None)
        if nxt is not None:
            nxt.set()

    async def _task(self, job: Any, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A server task: runs jobs, parking between them (reusing a task is cheaper than
        spawning one).

        A job is a queued call or the reader role (``_READ``). A reader reads until an
        async call it started suspends; it then hands the role on and finishes that call.
        The cancel scope a call runs in is registered under the call's key while it
        runs, so a cancel message cancels exactly that call; the task then carries on
        under a fresh scope. A call cancelled while still queued never starts. At most
        ``_MAX_IDLE`` tasks park; the rest end.
        """
        task_status.started()
        task = trio.lowlevel.current_task()
        while True:
            with trio.CancelScope() as scope:
                while True:
                    if job is _READ:
                        self._reader, self._reader_scope = task, scope
                        try:
                            await self.z.read(until=self._has_adopted)
                        finally:
                            self._reader = self._reader_scope = None
                        call, self._adopted = self._adopted, None
                        assert call is not None
                        self._hand_on(_READ)
                        await self._finish(call)
                        del call
                    else:
                        await self._run_job(job, scope)
                    del job  # nothing of a finished call stays referenced
                    job = await self._park(task)
                    if job is None:
                        return
            # A cancel message cancelled this task's call (or cancelled it as it ended).
            job = await self._park(task)
            if job is None:
                return

    def _has_adopted(self) -> bool:
        return self._adopted is not None

    async def _park(self, task: trio.lowlevel.Task) -> Any:
        """Wait for the next job; None when enough tasks are parked already."""
        if len(self._idle) >= _MAX_IDLE:
            return None

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        self._idle.append(task)
        return await trio.lowlevel.wait_task_rescheduled(abort)

    async def _run_job(self, job: tuple[Any, ...], scope: trio.CancelScope) -> None:
        """Run one queued call once every earlier call has started (unless it was cancelled)."""
        seq, ep, ident, rid, args, kwargs, reply, tp = job
        del job
        key = (ident, rid)
        value = None
        try:
            if self._started != seq or not self.ready.is_set():
                with trio.CancelScope(shield=True):
                    await self._turn(seq)
            else:
                self._pass_turn(seq)
            if key not in self._queued:  # the caller cancelled it before it started
                reply = False
            else:
                self._queued.discard(key)
                self.running[key] = scope
                value = self._step(ep, args, kwargs, tp)
                if type(value) is Started:
                    value = await resume(value)
        except Exception as exc:
            self._error(ident, rid, exc, reply, ep.spec.qualname)
        else:
            if reply:
                self._answer(ident, rid, value, ep.spec)
        finally:
            self.running.pop(key, None)

    async def autostart(self) -> None:
        """Construct the actor with no arguments (for processes nobody sends ``init`` to)."""
        actor = self.cls()
        assert self._nursery is not None
        await actor.on_start(self._nursery)
        self.actor = actor
        self.ready.set()

    async def _init(self, ident: bytes, rid: int, args: list[Any], kwargs: dict[str, Any]) -> None:
        if self.actor is not None:
            self._bad(ident, rid, "actor already initialised")
            return
        try:
            args, kwargs = self._init_spec.validate_args(args, kwargs)
            actor = self.cls(*args, **kwargs)
            assert self._nursery is not None
            await actor.on_start(self._nursery)
        except Exception as exc:
            self._reply(ident, {"id": rid, "kind": "err", "error": exception_info(exc)})
            return
        self.actor = actor
        self.ready.set()
        self._reply(ident, {"id": rid, "kind": "ok", "value": None})


class _Adopted:
    """A call that suspended in its first step in the reader task, run on by that task."""

    __slots__ = ("ep", "key", "reply", "started")

    def __init__(self, started: Started, key: tuple[bytes, int], ep: EndpointDef[Any, Any], reply: bool) -> None:
        self.started = started
        self.key = key
        self.ep = ep
        self.reply = reply
