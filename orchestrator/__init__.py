"""Flotilla's controller and actor runtime."""

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
    "span",
    "traced",
]
