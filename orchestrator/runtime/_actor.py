"""Actors and typed endpoints.

An endpoint's signature is the contract: callers are checked against it
(missing or unknown arguments raise ``TypeError`` before anything is sent) and
arguments are validated on arrival with pydantic ``TypeAdapter``s built from
the method's type hints (cached per endpoint; a value whose type already is a
plain builtin annotation skips pydantic). Return values are validated against
the return annotation at the caller.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import trio
from pydantic import ConfigDict, PydanticUserError, TypeAdapter

__all__ = ["Actor", "EndpointDef", "current_rank", "endpoint", "endpoints_of"]

P = ParamSpec("P")
R = TypeVar("R")

rank_of_this_process = 0  # set once by the actor process entry point


def current_rank() -> int:
    """The rank of the actor served by this process (0 outside actor processes)."""
    return rank_of_this_process


_PLAIN = (int, float, str, bool, bytes)
_ARBITRARY = ConfigDict(arbitrary_types_allowed=True)


class Actor:
    """Base class of every actor.

    Subclasses live at module top level in an importable module (child
    processes import them by ``module:QualName``). The constructor runs in the
    actor's own process with arguments sent over the wire; ``on_start`` may
    start long-lived tasks in the actor's nursery; ``on_stop`` runs on a normal
    stop (SIGTERM from the mesh owner), not after SIGKILL.

    Concurrency: calls to one actor run as concurrent trio tasks, started in
    arrival order; a plain ``def`` endpoint runs to completion, and an ``async
    def`` endpoint with no call queued ahead of it runs up to its first
    suspension, before the next message is read. Blocking compute blocks the
    actor's loop (allowed). Each call runs in a context of its own: context
    variables one call sets are not seen by another.
    """

    async def on_start(self, nursery: trio.Nursery) -> None:
        """Start long-lived tasks of the actor (they are cancelled when the actor stops)."""

    async def on_signal(self) -> None:
        """The process got SIGTERM (or SIGINT): drain. Runs before the running calls are
        cancelled and ``on_stop`` runs, while calls are still served, for at most
        ``_child.DRAIN_S`` seconds; the default does nothing."""

    async def on_stop(self) -> None:
        """Clean up before the process exits (bounded by the owner's grace period)."""


class _Param:
    __slots__ = ("adapter", "name", "plain")

    def __init__(self, name: str, ann: Any) -> None:
        self.name = name
        self.plain = ann if ann in _PLAIN else None
        self.adapter = _adapter(ann)

    def check(self, value: Any) -> Any:
        if self.adapter is None or type(value) is self.plain:
            return value
        return self.adapter.validate_python(value)


def _adapter(ann: Any) -> TypeAdapter[Any] | None:
    if ann is Any or ann is inspect.Parameter.empty or ann is object:
        return None
    try:
        return TypeAdapter(ann, config=_ARBITRARY)
    except PydanticUserError:  # models and dataclasses carry their own config
        try:
            return TypeAdapter(ann)
        except Exception:
            return None
    except Exception:
        return None


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    fn = inspect.unwrap(fn)
    try:
        return typing.get_type_hints(fn)
    except Exception:
        hints: dict[str, Any] = {}
        for name, ann in getattr(fn, "__annotations__", {}).items():
            if isinstance(ann, str):
                try:
                    ann = eval(ann, fn.__globals__)
                except Exception:
                    ann = Any
            hints[name] = ann
        return hints


class _Spec:
    """Signature and validators of one endpoint, built on first use."""

    def __init__(self, fn: Callable[..., Any], qualname: str) -> None:
        self.qualname = qualname
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())[1:]  # drop self
        self.signature = sig.replace(parameters=params)
        hints = _hints(fn)
        self.params = {p.name: _Param(p.name, hints.get(p.name, Any)) for p in params}
        self.var_kw = next((self.params[p.name] for p in params if p.kind is p.VAR_KEYWORD), None)
        self.var_pos = next((self.params[p.name] for p in params if p.kind is p.VAR_POSITIONAL), None)
        # Positional-or-keyword parameters that a plain positional call fills in order.
        self.positional = [
            self.params[p.name] for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        # A simple signature whose parameters are all unannotated (or Any): nothing to check.
        self.unchecked = self.simple and all(p.adapter is None for p in self.positional)
        self.required = sum(1 for p in params if p.default is p.empty)
        # The numbers of positional arguments a call without keywords may pass.
        self.arity = range(self.required, len(self.positional) + 1) if self.simple else range(0)
        ret = hints.get("return", Any)
        self.ret_none = ret is None or ret is type(None)
        self.ret: _Param | None = None  # None: nothing to check
        if not self.ret_none:
            ret_param = _Param("return", ret)
            if ret_param.adapter is not None:
                self.ret = ret_param
        # Whether validate_return can refuse or convert a value (not when the return's
        # annotation is absent, Any or object).
        self.checks_return = self.ret_none or self.ret is not None

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Caller side: the arguments fit the signature (types are checked on arrival)."""
        if not kwargs and len(args) in self.arity:
            return
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.qualname}: {exc}") from None

    def validate_args(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Receiver side: bind and validate; raises TypeError/ValidationError on bad input."""
        if not kwargs and len(args) in self.arity:
            if self.unchecked:
                return args, kwargs
            return [p.check(v) for p, v in zip(self.positional, args, strict=False)], kwargs
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.qualname}: {exc}") from None
        for name, value in bound.arguments.items():
            p = self.params[name]
            if p is self.var_pos:
                bound.arguments[name] = tuple(p.check(v) for v in value)
            elif p is self.var_kw:
                bound.arguments[name] = {k: p.check(v) for k, v in value.items()}
            else:
                bound.arguments[name] = p.check(value)
        return list(bound.args), bound.kwargs

    def validate_return(self, value: Any) -> Any:
        if self.ret_none:
            if value is not None:
                raise TypeError(f"{self.qualname} returned {type(value).__name__}, declared None")
            return None
        return value if self.ret is None else self.ret.check(value)


class EndpointDef(Generic[P, R]):
    """An ``@endpoint`` method. On an actor instance it is the plain bound method."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name: str = fn.__name__
        self.is_async = inspect.iscoroutinefunction(inspect.unwrap(fn)) or inspect.iscoroutinefunction(fn)
        self._spec: _Spec | None = None
        self._owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self._owner = owner.__qualname__

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> EndpointDef[P, R]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Callable[P, Any]: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    @property
    def spec(self) -> _Spec:
        if self._spec is None:
            self._spec = _Spec(self.fn, f"{self._owner}.{self.name}")
        return self._spec


@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> EndpointDef[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R]) -> EndpointDef[P, R]: ...
def endpoint(fn: Callable[..., Any]) -> EndpointDef[Any, Any]:
    """Mark an actor method (``async def`` or ``def``) as callable from other processes."""
    return EndpointDef(fn)


def endpoints_of(cls: type) -> dict[str, EndpointDef[Any, Any]]:
    """All endpoints of an actor class, including inherited ones."""
    cached = cls.__dict__.get("_flotilla_endpoints")
    if cached is not None:
        return cached
    found: dict[str, EndpointDef[Any, Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            if isinstance(attr, EndpointDef):
                found[name] = attr
            elif name in found:
                del found[name]  # overridden by a non-endpoint
    cls._flotilla_endpoints = found  # type: ignore[attr-defined]
    return found


class WireRejects:
    """Requests this process's server rejected as invalid (malformed frames or header,
    unknown endpoint, arguments that fail validation), counted in total and per peer and
    logged at most once per `interval_s` whichever the peer (a flood may come from many
    connections, each its own peer), so a flood of bad messages is not a flood of lines.
    Touched only from the actor's trio thread."""

    MAX_PEERS = 1024

    def __init__(self, interval_s: float = 5.0) -> None:
        from ._ratelimit import RateLimiter

        self.total = 0
        self.by_peer: dict[str, int] = {}
        self._limit = RateLimiter(interval_s)

    def record(self, peer: str, message: str, emit: Callable[[str], None]) -> None:
        """Count a rejection from `peer`; `message` (already bounded: outside values
        clipped) is emitted if no rejection was logged in the last interval."""
        self.total += 1
        if peer in self.by_peer or len(self.by_peer) < self.MAX_PEERS:
            self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        self._limit.log("rejected", message, emit)

    def snapshot(self) -> dict[str, Any]:
        return {"rejected_messages": self.total, "rejected_by_peer": dict(self.by_peer)}


wire_rejects = WireRejects()
"""This process's counter (one server per actor process): the server records, and every
actor's ``runtime_stats`` endpoint reads it."""


def _runtime_stats(self: Actor) -> dict[str, Any]:
    """What the runtime counted in this actor's process: requests rejected as invalid,
    in total (``rejected_messages``) and per peer (``rejected_by_peer``, by ZeroMQ identity)."""
    return wire_rejects.snapshot()


Actor.runtime_stats = endpoint(_runtime_stats)  # type: ignore[attr-defined]  # every actor has it
Actor.runtime_stats.__set_name__(Actor, "runtime_stats")  # type: ignore[attr-defined]
