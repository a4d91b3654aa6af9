"""The async controller, its links to the actors, and its checkpointed state.

    from orchestrator.controller import Controller, ControllerState, Links

`Controller(cfg, links, state, ...)` drives a run over three typed links
(`TrainerLink`, `PoolLink`, `EnvLink`); `orchestrator.controller.meshes` builds them
over actor meshes, tests over in-memory fakes.
"""

from orchestrator.controller._controller import Controller, MetricsSink
from orchestrator.controller._training import TrainerLost
from orchestrator.controller.links import (
    Checkpointer,
    EnvLink,
    Links,
    PoolLink,
    TrainerLink,
)
from orchestrator.controller.state import STATE_FILE, ControllerState

__all__ = [
    "STATE_FILE",
    "Checkpointer",
    "Controller",
    "ControllerState",
    "EnvLink",
    "Links",
    "MetricsSink",
    "PoolLink",
    "TrainerLink",
    "TrainerLost",
]
