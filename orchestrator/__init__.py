"""Flotilla's controller and actor runtime.

`run` (train from a config) loads lazily, so importing `orchestrator` stays light
(no torch) for the CLI and for actor processes.
"""

from .runtime import (
    Actor,
    ActorDied,
    ActorError,
    ActorRef,
    Curve,
    EndpointRef,
    HostSpec,
    Mesh,
    configure_tracing,
    current_rank,
    endpoint,
    open_mesh,
    span,
    traced,
)

__all__ = [
    "Actor",
    "ActorDied",
    "ActorError",
    "ActorRef",
    "Curve",
    "EndpointRef",
    "HostSpec",
    "Mesh",
    "configure_tracing",
    "current_rank",
    "endpoint",
    "open_mesh",
    "run",
    "span",
    "traced",
]


def __getattr__(name: str):
    if name == "run":
        from .entry.runner import run

        return run
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
