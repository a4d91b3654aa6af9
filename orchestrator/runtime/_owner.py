"""The owner's side of a mesh: spawning ranks, supervising them, respawning, stopping.

Supervision: one task per process waits for its exit (local: the process
handle; remote: a long-lived ``wait_exit`` call on its host). A host that stops
answering (a partition) does not make its ranks dead: their calls fail with
``ActorDied`` while their connections are down, and work again once the link is
back; the supervisor waits on the process again then. A host that answers without
the process (restarted meanwhile) marks the rank dead. A respawn that does
not finish within ``restart_timeout`` (when given) is stopped and the rank marked
dead. An exit the owner did not cause marks the rank dead, fails its calls with ``ActorDied``
and calls ``on_death``, once the replies the process sent before it ended are in (at
most ``EXIT_SETTLE_S``). ``shutdown`` (run shielded when the mesh closes) fails
outstanding calls, SIGTERMs every process, SIGKILLs what outlives the grace
period and reaps everything.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import trio

from ._conn import Connection, close_connection, connection, reply_value
from ._curve import Curve
from ._errors import ActorDied, ActorError
from ._proc import ActorProcess, child_env, spawn_local, stop_all
from ._zsock import log

if TYPE_CHECKING:
    from ._mesh import Mesh

__all__ = ["Owner", "RankSlot"]

EXIT_SETTLE_S = 2.0
"""Longest the owner waits, once a rank's process ended, for replies still on its link."""


class RankSlot:
    __slots__ = ("address", "conn", "died", "proc", "ready", "state")

    def __init__(self) -> None:
        self.address = ""
        self.proc: ActorProcess | None = None
        self.conn: Connection | None = None
        self.state: Literal["starting", "live", "dead"] = "starting"
        self.ready = trio.Event()
        self.died: ActorDied | None = None


class Owner:
    """The owner's view of a mesh: processes, slots, supervision tasks."""

    def __init__(
        self,
        *,
        name: str,
        cls_path: str,
        procs: int,
        init: tuple[Any, list[Any]],
        nursery: trio.Nursery,
        env: dict[str, str],
        transport: str,
        curve: Curve | None,
        hosts: list[Mesh[Any]],
        tcp_host: str,
        grace: float,
        on_death: Callable[[ActorDied], None] | None,
        restart_timeout: float | None = None,
        vacant: int = 0,
    ) -> None:
        self.addresses = [""] * (procs + vacant)  # each rank's address; a respawn may change it
        self.name, self.cls_path, self.init = name, cls_path, init
        self.nursery, self.env, self.transport, self.curve = nursery, env, transport, curve
        self.hosts, self.tcp_host, self.grace, self.on_death = hosts, tcp_host, grace, on_death
        self.restart_timeout = restart_timeout
        self.slots = [RankSlot() for _ in range(procs + vacant)]
        self._in_state: dict[str, list[int]] | None = None  # see ranks_in
        self.state_changes = 0  # bumped by every write of a slot's state (see Mesh.state_changes)
        # The host of each rank (None: this machine, or a vacant rank not placed yet).
        self.rank_hosts: list[Mesh[Any] | None] = [
            hosts[r % len(hosts)] if hosts and r < procs else None for r in range(procs + vacant)
        ]
        self.started = procs  # ranks started by start_all; the rest are vacant
        for rank in range(procs, procs + vacant):
            self._set_state(rank, "dead", ActorDied(name, rank, "vacant: no host placed yet"))
            self.slots[rank].ready.set()
        self.procs: list[ActorProcess] = []
        self.closing = False
        self.tmpdir = tempfile.mkdtemp(prefix="flotilla-") if transport == "ipc" and not hosts else None

    def _set_state(self, rank: int, state: Literal["starting", "live", "dead"], died: ActorDied | None = None) -> None:
        """The only writer of a slot's state (and its death), so `ranks_in` stays true."""
        slot = self.slots[rank]
        slot.state, slot.died = state, died
        self._in_state = None
        self.state_changes += 1

    def ranks_in(self, state: Literal["starting", "live", "dead"]) -> list[int]:
        """The ranks whose slot is in `state`, ascending (a fresh list). Read several times
        per placement decision, for pools of hundreds of ranks: kept until a state changes."""
        if self._in_state is None:
            self._in_state = {"starting": [], "live": [], "dead": []}
            for r, slot in enumerate(self.slots):
                self._in_state[slot.state].append(r)
        return list(self._in_state[state])

    async def _spawn(self, rank: int, mine: list[ActorProcess]) -> ActorProcess:
        slot = self.slots[rank]

        def register(proc: ActorProcess) -> None:
            self.procs.append(proc)
            mine.append(proc)

        host_mesh = self.rank_hosts[rank]
        if host_mesh is not None:
            from .host import RemoteProcess

            host = host_mesh[0]
            return await RemoteProcess.spawn(
                host, self.cls_path, name=self.name, rank=rank, env=self.env, register=register
            )
        if self.tmpdir is not None:
            bind = f"ipc://{self.tmpdir}/{rank}"
        else:  # tcp: a respawned rank reuses its port so handles held elsewhere stay valid
            bind = slot.address or f"tcp://{self.tcp_host}:*"
        return await spawn_local(
            self.cls_path, name=self.name, rank=rank, bind=bind, env=child_env(self.env, self.curve), register=register
        )

    async def start(self, rank: int, mine: list[ActorProcess] | None = None) -> None:
        """Spawn, connect and construct one rank; raises ActorDied/ActorError on failure.
        Processes it spawns are also appended to `mine`."""
        slot = self.slots[rank]
        proc = await self._spawn(rank, [] if mine is None else mine)
        slot.proc, slot.address = proc, proc.address
        self.addresses[rank] = proc.address
        self.nursery.start_soon(self._supervise, rank, proc)
        key = self.curve.public if self.curve is not None and proc.address.startswith("tcp://") else None
        if self.rank_hosts[rank] is not None:
            key = self.rank_hosts[rank]._keys[0].encode()
        conn = connection(
            proc.address, name=self.name, rank=rank, server_key=key, identity=self.curve, connect_timeout=None
        )
        slot.conn = conn
        a, frames = self.init
        p = conn.request({"kind": "init", "args": a[0], "kwargs": a[1]}, frames, reply=True, rank=rank)
        assert p is not None
        await p.wait()
        reply_value(p)
        if slot.proc is proc and slot.state == "starting":
            self._set_state(rank, "live")
            slot.ready.set()

    async def start_all(self) -> None:
        errors: dict[int, BaseException] = {}

        async def one(rank: int) -> None:
            try:
                await self.start(rank)
            except Exception as exc:
                errors[rank] = exc
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for rank in range(self.started):
                nursery.start_soon(one, rank)
        if errors:
            raise errors[min(errors)]

    async def _supervise(self, rank: int, proc: ActorProcess) -> None:
        try:
            how = await proc.wait_exit()
        except ActorDied as exc:
            how = exc.reason
        except Exception as exc:
            how = f"lost track of the process: {exc!r}"
        slot = self.slots[rank]
        if self.closing or slot.proc is not proc:
            return
        exc = ActorDied(self.name, rank, how)
        if slot.conn is not None:  # what the process answered before it ended still counts
            await slot.conn.settle(exc, EXIT_SETTLE_S)
            if self.closing or slot.proc is not proc:
                return
        self._mark_dead(rank, exc)

    def _mark_dead(self, rank: int, exc: ActorDied) -> None:
        slot = self.slots[rank]
        self._set_state(rank, "dead", exc)
        slot.ready.set()
        if slot.conn is not None:
            close_connection(slot.conn, exc)
            slot.conn = None
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except Exception as err:
                log(f"on_death callback raised: {err!r}")

    def place(self, rank: int, host: Mesh[Any]) -> None:
        """Move ``rank`` to ``host`` and start it there (see ``Mesh.place``)."""
        if self.closing:
            raise RuntimeError(f"mesh {self.name!r} is closed")
        self.rank_hosts[rank] = host
        self.respawn(rank)

    def respawn(self, rank: int) -> None:
        if self.closing:
            raise RuntimeError(f"mesh {self.name!r} is closed")
        slot = self.slots[rank]
        if slot.state == "starting":
            return
        old = slot.proc
        self._set_state(rank, "starting")
        slot.ready = trio.Event()
        slot.proc = None
        if slot.conn is not None:
            close_connection(slot.conn, ActorDied(self.name, rank, "respawned"))
            slot.conn = None
        self.nursery.start_soon(self._restart, rank, old)

    async def _restart(self, rank: int, old: ActorProcess | None) -> None:
        if old is not None:
            with trio.CancelScope(shield=True):
                await old.stop(self.grace)
        mine: list[ActorProcess] = []
        try:
            limit = self.restart_timeout if self.restart_timeout is not None else float("inf")
            with trio.fail_after(limit):
                await self.start(rank, mine)
        except (ActorDied, ActorError, OSError, trio.TooSlowError) as exc:
            if isinstance(exc, trio.TooSlowError):
                # A start that hangs (a frozen new process, a host that stopped answering):
                # stop what it spawned, then the rank is dead like any failed respawn.
                reason = f"respawn did not finish within {self.restart_timeout:g} s"
                self.slots[rank].proc = None  # its exit is not a new death
                with trio.CancelScope(shield=True):
                    for proc in mine:
                        await proc.stop(self.grace)
            else:
                reason = exc.reason if isinstance(exc, ActorDied) else f"respawn failed: {exc}"
            if not self.closing:
                self._mark_dead(rank, ActorDied(self.name, rank, reason))

    async def shutdown(self) -> None:
        """Fail outstanding calls, stop and reap every process. Call shielded."""
        self.closing = True
        for rank, slot in enumerate(self.slots):
            exc = ActorDied(self.name, rank, "mesh closed")
            if slot.conn is not None:
                close_connection(slot.conn, exc)
                slot.conn = None
            self._set_state(rank, "dead", exc)
            slot.ready.set()
        await stop_all(self.procs, self.grace)
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
