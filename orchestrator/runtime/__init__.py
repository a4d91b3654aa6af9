"""Monarch-style actors on trio + ZeroMQ, with span/traced helpers.

Public API::

    class Counter(Actor):
        def __init__(self, start: int) -> None: ...
        @endpoint
        async def incr(self, by: int = 1) -> int: ...

    async with open_mesh(Counter, 0, procs=2, name="counter") as mesh:
        await mesh[0].incr.call_one(5)      # one actor
        await mesh.incr.call(1)             # all, list in rank order
        await mesh.incr.choose(1)           # one, least loaded
        mesh.incr.broadcast(1)              # all, fire-and-forget
        async for v in mesh.incr.stream(1): ...  # all, values in completion order

Nothing here imports torch; tensors are handled when they are met.
"""

from ._actor import Actor, EndpointDef, current_rank, endpoint
from ._calls import EndpointRef
from ._curve import Curve
from ._errors import ActorDied, ActorError, WireError
from ._mesh import ActorRef, HostSpec, Mesh, host_mesh, open_mesh
from ._ratelimit import CLIP_CHARS, RateLimiter, clip
from ._shm import lend_buffer
from ._traceio import spans_not_written
from ._tracing import configure_tracing, span, traced

__all__ = [
    "CLIP_CHARS",
    "Actor",
    "ActorDied",
    "ActorError",
    "ActorRef",
    "Curve",
    "EndpointDef",
    "EndpointRef",
    "HostSpec",
    "Mesh",
    "RateLimiter",
    "WireError",
    "clip",
    "configure_tracing",
    "current_rank",
    "endpoint",
    "host_mesh",
    "lend_buffer",
    "open_mesh",
    "span",
    "spans_not_written",
    "traced",
]
