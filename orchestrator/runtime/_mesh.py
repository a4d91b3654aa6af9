"""Meshes: ``open_mesh``, mesh and actor handles, supervision and respawn.

A mesh handle is a wire value: passed as an argument or returned from an
endpoint it arrives as a handle in the receiving process, which opens its own
connections (in its own trio loop) on first use. Only the process that opened
the mesh (the owner) watches the processes, can respawn ranks and stops them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, Literal, TypeVar

import trio
from pydantic import BaseModel

from ._actor import Actor, EndpointDef, _Spec, endpoints_of
from ._calls import EndpointRef
from ._conn import Connection, connection
from ._curve import Curve, default_identity, set_default_identity
from ._errors import ActorDied
from ._owner import Owner
from ._tracing import span
from ._wire import encode, register_handle_decoder

__all__ = ["ActorRef", "HostSpec", "Mesh", "open_mesh"]

A = TypeVar("A", bound=Actor)


class HostSpec(BaseModel):
    """An actor host (``python -m orchestrator.runtime.host``) that spawns actors for a controller."""

    address: str
    """The host's control address, ``tcp://HOST:PORT``."""
    public_key: str
    """The host's CurveZMQ public key (z85), printed by the host at start-up."""


def _copy(exc: ActorDied) -> ActorDied:
    return ActorDied(exc.name, exc.rank, exc.reason)


class Mesh(Generic[A]):
    """Actors of one class, indexable by rank; ``mesh.<endpoint>`` targets all of them.

    Endpoint names that clash with mesh attributes (``name``, ``size``,
    ``respawn``, ``endpoint``) are reached with ``mesh.endpoint("name")``.
    """

    def __init__(
        self,
        name: str,
        cls_path: str,
        endpoints: list[str],
        addresses: list[str],
        keys: list[str | None],
        owner: Owner | None = None,
        identity: Curve | None = None,
    ) -> None:
        self.name = name
        self._identity = identity  # client keypair for tcp; None: this process's default
        self._cls_path = cls_path
        self._ep_names = endpoints
        self._handle_addresses = addresses  # a handle's; the owner's mesh reads the owner's
        self._keys = keys
        self._owner = owner
        self._defs: dict[str, EndpointDef[Any, Any]] | None = None
        cls = _loaded_actor(cls_path)
        if cls is not None:
            self._defs = endpoints_of(cls)
        self._refs = [ActorRef(self, r) for r in range(len(self._addresses))]

    @property
    def _addresses(self) -> list[str]:
        return self._owner.addresses if self._owner is not None else self._handle_addresses

    @property
    def addresses(self) -> list[str]:
        """ZeroMQ address of each rank (ipc:// or tcp://)."""
        return list(self._addresses)

    @property
    def size(self) -> int:
        return len(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)

    def __iter__(self) -> Iterator[ActorRef[A]]:
        return iter(self._refs)

    def __getitem__(self, rank: int) -> ActorRef[A]:
        return self._refs[rank]

    def __repr__(self) -> str:
        return f"<Mesh {self.name} of {self._cls_path} x{self.size}>"

    def endpoint(self, name: str, ranks: list[int] | None = None) -> EndpointRef[Any, Any]:
        ep = self._defs.get(name) if self._defs is not None else None
        if ep is None and name not in self._ep_names:
            raise AttributeError(f"{self._cls_path} has no endpoint {name!r}")
        return EndpointRef(self, list(range(self.size)) if ranks is None else ranks, name, ep)

    def __getattr__(self, name: str) -> EndpointRef[Any, Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        ref = self.endpoint(name)
        self.__dict__[name] = ref  # later lookups skip __getattr__
        return ref

    # -- wire ---------------------------------------------------------------------
    def __flotilla_wire__(self) -> dict[str, Any]:
        return {"kind": "mesh", **self._desc()}

    def _desc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cls": self._cls_path,
            "eps": self._ep_names,
            "addrs": list(self._addresses),
            "keys": list(self._keys),
        }

    @classmethod
    def _from_desc(cls, d: dict[str, Any]) -> Mesh[Any]:
        name, path, eps, addrs, keys = d["name"], d["cls"], d["eps"], d["addrs"], d["keys"]
        if not (
            isinstance(name, str)
            and isinstance(path, str)
            and _strs(eps)
            and _strs(addrs)
            and isinstance(keys, list)
            and len(keys) == len(addrs)
            and all(k is None or isinstance(k, str) for k in keys)
        ):
            raise ValueError("malformed mesh descriptor")
        return cls(name, path, eps, addrs, keys)

    # -- connections (ConnectionSource, used by endpoint calls) -----------------------
    async def connect(self, rank: int) -> Connection:
        """The rank's connection, waiting while it (re)starts; ActorDied if it is dead."""
        if self._owner is None:
            return self._remote_connection(rank)
        slot = self._owner.slots[rank]
        while slot.state == "starting":
            await slot.ready.wait()
        if slot.state == "dead" or slot.conn is None:
            assert slot.died is not None
            raise _copy(slot.died)
        return slot.conn

    def connection_now(self, rank: int) -> Connection | None:
        """The connection if usable now, None while restarting; ActorDied if dead."""
        if self._owner is None:
            conn = self._remote_connection(rank)
            if conn.dead is not None:
                raise _copy(conn.dead)
            return conn
        slot = self._owner.slots[rank]
        if slot.state == "live" and slot.conn is not None:
            if slot.conn.dead is not None:  # e.g. its process ended, its last replies coming in
                raise _copy(slot.conn.dead)
            return slot.conn
        if slot.state == "starting":
            return None
        assert slot.died is not None
        raise _copy(slot.died)

    def _remote_connection(self, rank: int) -> Connection:
        key = self._keys[rank]
        return connection(
            self._addresses[rank],
            name=self.name,
            rank=rank,
            server_key=key.encode() if key else None,
            identity=(self._identity or default_identity()) if key else None,
        )

    # -- supervision ----------------------------------------------------------------
    def place(self, rank: int, host: HostSpec) -> None:
        """Start ``rank`` on ``host`` (a vacant rank, or one whose host left): its old
        process, if any, is stopped first. Returns at once, as ``respawn``; owner only."""
        if self._owner is None:
            raise RuntimeError(f"only the process that opened mesh {self.name!r} can place its ranks")
        self._keys[rank] = host.public_key
        self._owner.place(rank, host_mesh(host, self._owner.curve))

    def respawn(self, rank: int) -> None:
        """Start a fresh process for ``rank`` (stopping the old one if it still runs).

        Returns at once; calls on the rank wait until the new actor has been
        constructed (``ActorDied`` if that fails). Only the owner can respawn.
        """
        if self._owner is None:
            raise RuntimeError(f"only the process that opened mesh {self.name!r} can respawn it")
        with span("actor.respawn", mesh=self.name, rank=rank):
            self._owner.respawn(rank)

    @property
    def pids(self) -> list[int | None]:
        """Each rank's process id on its host (owner only), None while it (re)starts."""
        if self._owner is None:
            raise RuntimeError(f"only the process that opened mesh {self.name!r} knows its pids")
        return [s.proc.pid if s.proc is not None else None for s in self._owner.slots]

    def death_reason(self, rank: int) -> str | None:
        """Why ``rank`` is dead (owner only), None while it is not."""
        if self._owner is None:
            raise RuntimeError(f"only the process that opened mesh {self.name!r} knows its ranks' deaths")
        slot = self._owner.slots[rank]
        return slot.died.reason if slot.state == "dead" and slot.died is not None else None

    @property
    def rank_hosts(self) -> list[str | None]:
        """The host address each rank runs on (owner only): None for this machine or a
        vacant rank."""
        if self._owner is None:
            raise RuntimeError(f"only the process that opened mesh {self.name!r} knows its hosts")
        return [m.addresses[0] if m is not None else None for m in self._owner.rank_hosts]

    @property
    def dead_ranks(self) -> list[int]:
        """Ranks known dead (owner only; empty elsewhere)."""
        if self._owner is None:
            return []
        return self._owner.ranks_in("dead")

    @property
    def state_changes(self) -> int:
        """A count that moves whenever a rank starts, comes up or dies (owner only; 0
        elsewhere): what `dead_ranks` and `starting_ranks` report changed only if it moved."""
        return 0 if self._owner is None else self._owner.state_changes

    @property
    def starting_ranks(self) -> list[int]:
        """Ranks being (re)started: spawned or respawned, not constructed yet (owner only;
        empty elsewhere)."""
        if self._owner is None:
            return []
        return self._owner.ranks_in("starting")


class ActorRef(Generic[A]):
    """One actor of a mesh: ``ref.<endpoint>.call_one(...)``."""

    def __init__(self, mesh: Mesh[A], rank: int) -> None:
        self.mesh = mesh
        self.rank = rank

    def __repr__(self) -> str:
        return f"<Actor {self.mesh.name}[{self.rank}]>"

    def __getattr__(self, name: str) -> EndpointRef[Any, Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        ref = self.mesh.endpoint(name, [self.rank])
        self.__dict__[name] = ref
        return ref

    def __flotilla_wire__(self) -> dict[str, Any]:
        return {"kind": "actor", "mesh": self.mesh._desc(), "rank": self.rank}

    @classmethod
    def _from_desc(cls, d: dict[str, Any]) -> ActorRef[Any]:
        mesh, rank = Mesh._from_desc(d["mesh"]), d["rank"]
        if type(rank) is not int or not 0 <= rank < mesh.size:
            raise ValueError(f"bad rank {rank!r}")
        return mesh[rank]


def host_mesh(h: HostSpec, curve: Curve | None) -> Mesh[Any]:
    """A handle on the ``flotilla host`` at ``h`` (its HostActor)."""
    return Mesh(
        f"host {h.address}",
        "orchestrator.runtime.host:HostActor",
        ["spawn", "wait_exit", "stop", "signal", "ping"],
        [h.address],
        [h.public_key],
        identity=curve,
    )


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _loaded_actor(path: str) -> type[Actor] | None:
    module, _, qual = path.partition(":")
    obj: Any = sys.modules.get(module)  # never import on behalf of a message
    for part in qual.split("."):
        ok = obj is not None and not part.startswith("_") and hasattr(obj, "__dict__")
        obj = vars(obj).get(part) if ok else None  # no module __getattr__ for a message
    return obj if isinstance(obj, type) and issubclass(obj, Actor) else None


register_handle_decoder("mesh", Mesh._from_desc)
register_handle_decoder("actor", ActorRef._from_desc)


@asynccontextmanager
async def open_mesh(
    cls: type[A],
    *args: Any,
    procs: int = 1,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    transport: Literal["ipc", "tcp"] = "ipc",
    curve: Curve | None = None,
    hosts: Sequence[HostSpec] | None = None,
    tcp_host: str = "127.0.0.1",
    grace: float = 5.0,
    on_death: Callable[[ActorDied], None] | None = None,
    restart_timeout: float | None = None,
    vacant: int = 0,
    **kwargs: Any,
) -> AsyncIterator[Mesh[A]]:
    """Spawn ``procs`` processes each running ``cls(*args, **kwargs)``; yield the mesh.

    Every rank is constructed before the block starts (a constructor error
    raises ``ActorError``, a process that dies during start-up ``ActorDied``).
    Leaving the block in any way (normally, by exception, by cancellation)
    fails outstanding calls with ``ActorDied``, sends SIGTERM (``on_stop``
    runs), SIGKILLs what is still alive after ``grace`` seconds and reaps
    every process. ``on_death`` is called (in the owner's loop) when a rank
    dies; the owner may then call ``mesh.respawn(rank)``. A respawn that does not
    finish (constructed) within ``restart_timeout`` seconds is stopped and the rank
    marked dead (None: no limit; the first start is never limited).

    ``transport="tcp"`` needs ``curve``; with ``hosts`` the ranks are spread
    round-robin over remote actor hosts (tcp + curve). ``vacant`` adds that many ranks
    after the ``procs`` ones with no process and no host (dead, reason "vacant"), for
    hosts that join later: ``mesh.place(rank, HostSpec)`` starts one there (``procs``
    may then be 0). Constructor keyword
    arguments that clash with these options must be passed positionally.
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"open_mesh needs an Actor subclass, got {cls!r}")
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise TypeError(
            f"{cls.__qualname__} must be defined at top level of an importable "
            "module (actor processes import it by name)"
        )
    if procs < 1 and not (procs == 0 and vacant > 0):
        raise ValueError(f"procs must be >= 1, got {procs}")
    if vacant and curve is None:
        raise ValueError("vacant ranks are placed on hosts later: pass curve=")
    if (transport == "tcp" or hosts) and curve is None:
        raise ValueError("tcp meshes need curve= (CurveZMQ keys); see Curve.generate/from_dir")
    _Spec(cls.__init__, f"{cls.__qualname__}.__init__").check_call(args, kwargs)
    frames: list[Any] = []
    a = encode(list(args), frames, where=f"{cls.__qualname__}() argument")
    w = encode(dict(kwargs), frames, where=f"{cls.__qualname__}() argument")
    cls_path = f"{cls.__module__}:{cls.__qualname__}"
    name = name or cls.__name__.lower()
    # The nursery holds only supervisors (which never raise); unwrap the group trio
    # puts around an exception from start-up or from the body, so callers see e.g.
    # ActorError or their own exception, not an ExceptionGroup.
    unwrapped: BaseException | None = None
    try:
        async with _mesh_lifetime(
            cls,
            cls_path,
            name,
            procs,
            env,
            transport,
            curve,
            hosts,
            tcp_host,
            grace,
            on_death,
            ((a, w), frames),
            restart_timeout,
            vacant,
        ) as mesh:
            yield mesh
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        unwrapped = group.exceptions[0]
    if unwrapped is not None:
        raise unwrapped


@asynccontextmanager
async def _mesh_lifetime(
    cls: type[A],
    cls_path: str,
    name: str,
    procs: int,
    env: Mapping[str, str] | None,
    transport: str,
    curve: Curve | None,
    hosts: Sequence[HostSpec] | None,
    tcp_host: str,
    grace: float,
    on_death: Callable[[ActorDied], None] | None,
    init: tuple[Any, list[Any]],
    restart_timeout: float | None = None,
    vacant: int = 0,
) -> AsyncIterator[Mesh[A]]:
    async with trio.open_nursery() as nursery:
        host_meshes = []
        if hosts:
            importlib.import_module(".host", __package__)  # typed endpoints for host handles
        if hosts or vacant:
            importlib.import_module(".host", __package__)
        for h in hosts or ():
            host_meshes.append(host_mesh(h, curve))
        keys: list[str | None] = [
            host_meshes[r % len(host_meshes)]._keys[0]
            if host_meshes
            else curve.public.decode()
            if curve is not None and transport == "tcp"
            else None
            for r in range(procs)
        ] + [None] * vacant
        if curve is not None:
            set_default_identity(curve)
        owner = Owner(
            name=name,
            cls_path=cls_path,
            procs=procs,
            init=init,
            nursery=nursery,
            env=dict(env or {}),
            transport=transport,
            curve=curve,
            hosts=host_meshes,
            tcp_host=tcp_host,
            grace=grace,
            on_death=on_death,
            restart_timeout=restart_timeout,
            vacant=vacant,
        )
        mesh: Mesh[A] = Mesh(name, cls_path, list(endpoints_of(cls)), [], keys, owner=owner, identity=curve)
        try:
            await owner.start_all()
            yield mesh
        finally:
            with trio.CancelScope(shield=True):
                await owner.shutdown()
            nursery.cancel_scope.cancel()
