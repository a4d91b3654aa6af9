"""Actor side: one ROUTER socket, one reader task; async calls run on reusable worker tasks.

A plain ``def`` endpoint with nothing queued ahead of it runs inline in the
reader. Async calls are handed to parked worker tasks (spawned when none is
idle), started in arrival order; each call can be cancelled on its own.

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

import traceback
from typing import Any

import outcome
import trio
import zmq

from . import _tracing
from ._actor import Actor, EndpointDef, _Spec, endpoints_of, wire_rejects
from ._errors import WireError
from ._ratelimit import clip
from ._wire import SCALARS, decode, dumps, encode, loads
from ._zsock import ZSocket, log

__all__ = ["Server", "exception_info"]

_MAX_IDLE = 32  # idle worker tasks kept for reuse


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
        self.z = ZSocket(sock, self._on_message, copy_parts=2, spin=True, shm=local)
        self._nursery: trio.Nursery | None = None
        self._next_seq = 0
        self._started = 0
        self._turns: dict[int, trio.Event] = {}
        self._idle: list[trio.lowlevel.Task] = []
        # Calls handed to a worker and not started yet; a cancel removes its call from here,
        # and the worker then skips it.
        self._queued: set[tuple[bytes, Any]] = set()
        self._init_spec = _Spec(cls.__init__, f"{cls.__qualname__}.__init__")

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.z.run)
                task_status.started()
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
            self.z.send([ident, dumps(header), *frames])
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
        frames: list[Any] = []
        try:
            tree = (
                value
                if type(value) in SCALARS
                else encode(value, frames, where="return value" if spec is None else f"{spec.qualname} return value")
            )
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
    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            self._rejected(frames[0] if frames else None, f"dropped a message with {len(frames)} frame(s)")
            return
        ident = frames[0]
        try:
            header = loads(frames[1])
        except WireError as exc:
            self._bad(ident, None, str(exc))
            return
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
        seq = self._next_seq
        self._next_seq += 1
        tp = header.get("trace")
        if not ep.is_async and self._started == seq and self.ready.is_set():
            # Nothing queued ahead of it: run a plain function inline, without a task.
            self._started += 1
            with _tracing.remote_parent(tp):
                self._run_sync(ep, ident, rid, args, kwargs, reply)
            return
        job = (seq, ep, ident, rid, args, kwargs, reply, tp)
        self._queued.add((ident, rid))
        if self._idle:
            trio.lowlevel.reschedule(self._idle.pop(), outcome.Value(job))
        else:
            assert self._nursery is not None
            self._nursery.start_soon(self._worker, job)

    def _decode_args(self, header: dict[str, Any], frames: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        a, w = header.get("args", []), header.get("kwargs", {})
        if type(a) is not list or type(w) is not dict:
            raise WireError("arguments must be a list and keyword arguments an object")
        if len(frames) == 1 and not w and all(type(x) in SCALARS for x in a):
            return a, w
        args, kwargs = decode([a, w], frames)
        return args, kwargs

    def _run_sync(
        self, ep: EndpointDef[Any, Any], ident: bytes, rid: int, args: list[Any], kwargs: dict[str, Any], reply: bool
    ) -> None:
        try:
            value = ep.fn(self.actor, *args, **kwargs)
        except Exception as exc:
            self._error(ident, rid, exc, reply, ep.spec.qualname)
        else:
            if reply:
                self._answer(ident, rid, value, ep.spec)

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

    async def _worker(self, job: tuple[Any, ...]) -> None:
        """Run calls, parking between them (reusing a task is cheaper than spawning one).

        The worker's cancel scope is registered under the running call's key, so
        a cancel message cancels exactly that call; the worker then ends (a new
        one is spawned when needed). A call cancelled while still queued never
        starts. At most ``_MAX_IDLE`` workers park.
        """
        task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        with trio.CancelScope() as scope:
            while True:
                seq, ep, ident, rid, args, kwargs, reply, tp = job
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
                        with _tracing.remote_parent(tp):
                            if ep.is_async:
                                value = await ep.fn(self.actor, *args, **kwargs)
                            else:
                                value = ep.fn(self.actor, *args, **kwargs)
                except Exception as exc:
                    self._error(ident, rid, exc, reply, ep.spec.qualname)
                else:
                    if reply:
                        self._answer(ident, rid, value, ep.spec)
                finally:
                    self.running.pop(key, None)
                del job, args, kwargs, value  # nothing of a finished call stays referenced
                if len(self._idle) >= _MAX_IDLE:
                    return
                self._idle.append(task)
                job = await trio.lowlevel.wait_task_rescheduled(abort)

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


def actor_class(path: str) -> type[Actor]:
    """Import ``module:QualName`` (from the command line of a trusted spawner, never a message)."""
    import importlib

    module, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return obj
