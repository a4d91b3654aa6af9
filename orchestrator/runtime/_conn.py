"""Client side: one DEALER socket per (trio loop, actor address), shared by all calls.

A single reader task per connection demultiplexes replies by request id into
the pending table. Connections live in a per-loop registry so that every
handle to the same actor in one process shares one socket; their reader tasks
are trio system tasks because a handle can arrive anywhere (inside a message,
in any task) and must still work; the owner of a mesh closes its connections
when the mesh closes, and the rest close when the trio run ends.

Failure model: a connection is *dead* after the owner saw the process exit,
after ZeroMQ reported the peer disconnected (ipc: at once; tcp: heartbeats
within ~3 s), after a CurveZMQ refusal, or when no handshake happened within
``connect_timeout``. Every pending call then fails with ``ActorDied`` and new
calls fail fast until a handshake succeeds again (or the owner respawns).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any, Protocol

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ._errors import ActorDied, ActorError
from ._ratelimit import clip
from ._wire import SCALARS, decode, dumps, loads
from ._zsock import CHECKPOINT_S, SPIN_S, ZSocket, context, log, log_repeated, tune

__all__ = ["Connection", "ConnectionSource", "Pending", "close_connection", "connection", "reply_value"]

SETTLE_POLL_S = 0.005
"""How often ``Connection.settle`` looks whether the link has closed."""

_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_monitor_ids = itertools.count()


class Pending:
    """One outstanding request: completed exactly once with a reply or an error.

    A waiter parks its task directly (cheaper than ``trio.Event``); a ``sink``
    (used by ``stream``) is called instead when the reply arrives.
    """

    __slots__ = ("conn", "done", "error", "frames", "header", "rank", "rid", "sink", "t0", "task")

    def __init__(
        self, conn: Connection, rid: int, sink: Callable[[Pending], None] | None, rank: int, t0: float
    ) -> None:
        self.conn = conn
        self.rid = rid
        self.done = False
        self.task: Any = None
        self.header: dict[str, Any] | None = None
        self.frames: list[Any] = []
        self.error: BaseException | None = None
        self.sink = sink
        self.rank = rank
        self.t0 = t0  # when the request was sent

    def _done(self) -> None:
        self.done = True
        if self.sink is not None:
            self.sink(self)
        elif self.task is not None:
            trio.lowlevel.reschedule(self.task)
            self.task = None

    async def wait(self) -> None:
        """Wait for completion. Cancellation: the call is abandoned (remote task cancelled)."""
        if self.done:
            await trio.lowlevel.checkpoint()
            return
        conn = self.conn
        if conn.rtt_ewma < 2 * SPIN_S:  # replies come back fast: spin first (see _zsock)
            conn.spun_waits += 1
            deadline = self.t0 + SPIN_S
            z = conn.z
            checkpointed = False
            next_cp = 0.0
            try:
                while True:
                    # This core's other threads run first (ZeroMQ's I/O thread has the
                    # request just sent to pass on): a poll, let alone a trio checkpoint,
                    # costs several times a yield.
                    os.sched_yield()
                    # The first poll also reads what arrived while the request was sent
                    # (``Connection.request`` left that check to it).
                    z.poll()
                    now = perf_counter()
                    if self.done or now >= deadline:
                        break
                    if now >= next_cp:  # other tasks run at least every CHECKPOINT_S
                        await trio.lowlevel.checkpoint()
                        checkpointed = True
                        next_cp = perf_counter() + CHECKPOINT_S
            except BaseException:  # cancelled while spinning
                if not self.done:
                    self.abandon()
                raise
            if self.done:
                if not checkpointed:  # a wait is a checkpoint, once
                    await trio.lowlevel.checkpoint()
                return
        self.task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.task = None
            self.abandon()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def abandon(self) -> None:
        """The caller gave up (cancelled): forget the reply and cancel the remote task."""
        self.conn.cancel(self.rid)


class Connection:
    """A DEALER socket to one actor address with request-id demultiplexing."""

    def __init__(
        self,
        address: str,
        *,
        name: str,
        rank: int,
        server_key: bytes | None,
        identity: Any | None,
        connect_timeout: float | None,
    ) -> None:
        self.address = address
        self.name = name
        self.rank = rank
        self.pending: dict[int, Pending] = {}
        self.dead: ActorDied | None = None
        self.sticky = False  # set by the owner: stays dead until respawn
        self.connected = False
        self.rtt_ewma = 0.0  # seconds, over this connection's recent replies
        self.spun_waits = 0  # waits that polled before parking (replies were coming back fast)
        self.registry_key: tuple[str, bytes | None, bytes | None] = (address, None, None)
        self._ids = itertools.count(1)
        self._connect_timeout = connect_timeout
        self.scope = trio.CancelScope()
        sock = context().socket(zmq.DEALER)
        tune(sock, tcp=address.startswith("tcp://"))
        if server_key is not None:
            if identity is None:
                raise ValueError(
                    f"{address} needs CurveZMQ: pass curve= to open_mesh or set FLOTILLA_CURVE_* in this process"
                )
            sock.curve_serverkey = server_key
            sock.curve_publickey = identity.public
            sock.curve_secretkey = identity.secret
        mon_addr = f"inproc://flotilla-mon-{next(_monitor_ids)}"
        sock.monitor(mon_addr, _EVENTS)
        mon = context().socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        # libzmq's I/O thread sends monitor events with a *blocking* send: a full
        # or unconnected monitor pipe would freeze every socket of the process.
        # Unlimited HWM here, and the monitor is disabled before either end closes.
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.connect(mon_addr)
        sock.connect(address)
        self.z = ZSocket(sock, self._on_reply, close_on_exit=False, shm=address.startswith("ipc://"), marked=True)
        self._mon = ZSocket(mon, self._on_event, close_on_exit=False, copy_parts=2)

    # -- sending ---------------------------------------------------------------
    def request(
        self,
        header: dict[str, Any],
        frames: list[Any],
        *,
        reply: bool,
        sink: Callable[[Pending], None] | None = None,
        rank: int = 0,
        waits_next: bool = False,
    ) -> Pending | None:
        """Send a request; returns its pending entry (None for fire-and-forget).

        ``waits_next``: the caller waits on this entry right away, without awaiting
        anything first; if that wait will spin, its first poll reads what arrived
        during the send (so the send does not look), and the entry is made once the
        request has left: nothing can complete it before that wait, and making it then
        takes it off the round trip's path.
        Raises ActorDied at once when the connection is dead.
        """
        if self.dead is not None:
            raise self.dead
        rid = next(self._ids)
        header["id"] = rid
        spins = waits_next and reply and sink is None and self.rtt_ewma < 2 * SPIN_S
        t0 = perf_counter()
        p = None
        if reply and not spins:
            p = self.pending[rid] = Pending(self, rid, sink, rank, t0)
        try:
            if frames:
                self.z.send([dumps(header), *frames], check=not spins)
            else:
                self.z.send_header(dumps(header), check=not spins)
        except zmq.ZMQError as exc:
            self.pending.pop(rid, None)
            raise ActorDied(self.name, self.rank, f"send failed: {exc}") from None
        if spins:
            p = self.pending[rid] = Pending(self, rid, sink, rank, t0)
        return p

    def cancel(self, rid: int) -> None:
        if self.pending.pop(rid, None) is not None and self.dead is None and not self.z.closed:
            try:
                self.z.send_header(dumps({"id": rid, "kind": "cancel"}))
            except zmq.ZMQError:
                pass

    # -- receiving -------------------------------------------------------------
    def _on_reply(self, frames: list[Any]) -> bool:
        """Complete the call a reply answers; True (end the drain) once no call is
        pending: anything still queued is then a reply nobody waits for, read by the
        next request's send check or its wait's first poll."""
        try:
            header = loads(frames[0])
        except ValueError as exc:
            log_repeated("malformed reply", f"{self.name}[{self.rank}]: dropped a malformed reply: {clip(exc)}")
            return False
        pending = self.pending
        p = pending.pop(header.get("id"), None)  # type: ignore[arg-type]
        if p is None:
            return False  # reply to a cancelled call
        self.rtt_ewma += 0.2 * (perf_counter() - p.t0 - self.rtt_ewma)
        p.header = header
        p.frames = frames
        p._done()
        return not pending

    def _on_event(self, frames: list[Any]) -> None:
        ev = parse_monitor_message(frames)["event"]
        if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
            if self.dead is not None and not self.sticky:
                self.dead = None
        elif ev == zmq.EVENT_DISCONNECTED:
            self.connected = False
            # Replies that arrived before the link closed are still queued on the data
            # socket (its reader may not have run yet): deliver them before failing the rest.
            self.z.poll()
            self.fail(ActorDied(self.name, self.rank, f"connection to {self.address} lost"))
        elif ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.fail(
                ActorDied(
                    self.name,
                    self.rank,
                    f"refused by {self.address}: CurveZMQ authentication failed "
                    "(this process's public key is not in the actor's allowed keys)",
                )
            )
        else:
            self.fail(ActorDied(self.name, self.rank, f"handshake with {self.address} failed"))

    def fail(self, exc: ActorDied, *, sticky: bool = False) -> None:
        """Mark dead and fail every pending call with ``exc`` (the first reason is kept)."""
        if self.dead is None:
            self.dead = exc
        else:
            exc = self.dead
        self.sticky = self.sticky or sticky
        pending, self.pending = self.pending, {}
        for p in pending.values():
            p.error = exc
            p._done()

    async def settle(self, exc: ActorDied, limit: float) -> None:
        """The process behind this connection ended (``exc`` says how). Replies it sent
        before may still be on the link: ZeroMQ reads and decrypts a CURVE message whole
        before it delivers any of it (~0.2 s for 64 MiB here). Waits, at most ``limit``
        s, until no call is pending or the link has closed (its disconnect delivers what
        came before it); new calls fail with ``exc`` meanwhile. The caller then fails
        what is left."""
        if self.dead is None:
            self.dead = exc  # kept as the reason when the disconnect fails the rest
        with trio.move_on_after(limit):
            while self.pending and self.connected and not self.z.closed:
                await trio.sleep(SETTLE_POLL_S)

    async def _watch_connect(self) -> None:
        assert self._connect_timeout is not None
        await trio.sleep(self._connect_timeout)
        if not self.connected and self.dead is None:
            self.fail(
                ActorDied(self.name, self.rank, f"no connection to {self.address} within {self._connect_timeout:g} s")
            )

    async def run(self) -> None:
        """Reader and monitor tasks; on exit the sockets are closed and pending calls fail."""
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.z.run)
                    nursery.start_soon(self._mon.run)
                    if self._connect_timeout is not None:
                        nursery.start_soon(self._watch_connect)
        except Exception as exc:
            log(f"connection to {self.address} failed: {exc!r}")
        finally:
            if not self.z.closed:
                try:
                    self.z.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self.z.close()
            self._mon.close()
            if self.dead is None:
                self.fail(ActorDied(self.name, self.rank, "connection closed"))


# Connections are shared per (address, server key, client key): a handle that expects
# another server key, or presents another identity, gets a connection of its own.
_ConnKey = tuple[str, bytes | None, bytes | None]
_registry: trio.lowlevel.RunVar[dict[_ConnKey, Connection]] = trio.lowlevel.RunVar("flotilla_conns")


def _conns() -> dict[_ConnKey, Connection]:
    try:
        return _registry.get()
    except LookupError:
        conns: dict[_ConnKey, Connection] = {}
        _registry.set(conns)
        return conns


def connection(
    address: str,
    *,
    name: str,
    rank: int,
    server_key: bytes | None = None,
    identity: Any | None = None,
    connect_timeout: float | None = 10.0,
) -> Connection:
    """The shared connection of this trio loop to ``address`` (for this server key and
    client identity), opened on first use."""
    conns = _conns()
    key = (address, server_key, identity.public if identity is not None else None)
    conn = conns.get(key)
    if conn is None or conn.z.closed:
        conn = Connection(
            address, name=name, rank=rank, server_key=server_key, identity=identity, connect_timeout=connect_timeout
        )
        conn.registry_key = key
        conns[key] = conn
        trio.lowlevel.spawn_system_task(conn.run, name=f"flotilla-conn {address}")
    return conn


def close_connection(conn: Connection, exc: ActorDied) -> None:
    """Close ``conn`` for good, failing its pending and future calls with ``exc``."""
    conn.fail(exc, sticky=True)
    conn.scope.cancel()
    conns = _conns()
    if conns.get(conn.registry_key) is conn:
        del conns[conn.registry_key]


class ConnectionSource(Protocol):
    """Where endpoint calls find the connection to a rank (a mesh handle implements it)."""

    name: str

    def connection_now(self, rank: int) -> Connection | None:
        """The rank's connection if it can take a request now; None while the rank is
        (re)starting; ActorDied if it is dead."""

    async def connect(self, rank: int) -> Connection:
        """The rank's connection, waiting while it (re)starts; ActorDied if it is dead."""


def reply_value(p: Pending) -> Any:
    """The value carried by a finished request's reply (None for a reply without one).

    Raises what the reply says: ActorDied (the actor is gone), ActorError (the endpoint
    raised; remote type, message and traceback), TypeError (arguments refused on arrival).
    """
    if p.error is not None:
        e = p.error
        if isinstance(e, ActorDied):
            raise ActorDied(e.name, e.rank, e.reason)  # a fresh copy: one traceback per raise
        raise e
    h = p.header
    assert h is not None
    kind = h.get("kind")
    if kind == "ok":
        value = h.get("value")
        if len(p.frames) > 1 or type(value) not in SCALARS:
            value = decode(value, p.frames)
        return value
    if kind == "err":
        x = h.get("error") or {}
        raise ActorError(str(x.get("type")), str(x.get("msg")), str(x.get("tb")))
    if kind == "bad":
        raise TypeError(f"rank {p.rank} rejected the call: {h.get('message')}")
    raise ActorError("WireError", f"unexpected reply kind {kind!r}", "")
