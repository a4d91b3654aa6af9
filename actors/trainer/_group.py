"""``TrainerGroup``: a trainer mesh of N ranks presented as the one trainer the controller drives.

The controller knows nothing of FSDP (DESIGN §9): it calls ``version``,
``train_step``, ``updates_for``, ``ack``, ``forget``, ``keyframe`` and
``save_checkpoint`` on one trainer link, each as ``link.<name>.call_one(...)``.
``TrainerGroup`` keeps that shape: the collective calls (``train_step``,
``evaluate``, ``save_checkpoint``, ``digest``) go to every rank at once and return
rank 0's answer; the others go to rank 0 alone, which holds the publisher.

Failure: when any rank dies (crash, kill, OOM) a collective call raises
``TrainerRankDied`` naming the rank, within the runtime's death detection (seconds);
the surviving ranks may be stuck in a collective, which is harmless: leaving
``open_trainer`` stops (SIGTERM, then SIGKILL) every rank. A group cannot continue
with a rank missing; the run resumes from its last checkpoint (``--resume``).
Cancellation: cancelling a call abandons it at the caller; the ranks finish the step.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from actors.trainer._actor import TrainerActor
from actors.trainer._config import TrainerConfig
from actors.trainer._dist import rendezvous_address
from orchestrator.runtime import ActorDied, ActorError, EndpointRef, Mesh, open_mesh

__all__ = ["TrainerGroup", "TrainerRankDied", "open_trainer"]

ERROR_WAIT_S = 10.0
"""After one rank raises, how long the others may take to finish or fail."""
COLLECTIVE = ("train_step", "evaluate", "save_checkpoint", "digest", "full_weights")
"""Endpoints every rank must take together."""


class TrainerRankDied(RuntimeError):
    """A rank of the trainer group died; the group cannot go on (resume from a checkpoint)."""

    def __init__(self, rank: int, endpoint: str, reason: str) -> None:
        super().__init__(f"trainer rank {rank} died during {endpoint}: {reason}; the trainer "
                         "group cannot continue without it (resume with --resume RUN_DIR)")
        self.rank = rank


class _AllRanks:
    """``call_one`` on every rank at once; rank 0's result.

    The ranks are awaited concurrently: a death anywhere fails the call at once (a rank
    waiting in a collective for a dead peer would otherwise hold it). When a rank raises,
    the others get ``ERROR_WAIT_S`` to finish or fail (a bad batch fails on every rank
    alike; a death elsewhere is preferred as the reported cause), then the first error
    is raised, prefixed with the rank that raised it.
    """

    def __init__(self, mesh: Mesh[TrainerActor], name: str) -> None:
        self._mesh, self._name = mesh, name

    async def call_one(self, *args: Any, **kwargs: Any) -> Any:
        results: dict[int, Any] = {}
        errors: list[tuple[int, ActorError]] = []
        died: list[ActorDied] = []

        async def one(rank: int, scope: trio.CancelScope) -> None:
            try:
                ref = self._mesh.endpoint(self._name, [rank])
                results[rank] = await ref.call_one(*args, **kwargs)
            except ActorDied as e:
                died.append(e)
                scope.cancel()
            except ActorError as e:
                errors.append((rank, e))
                scope.deadline = min(scope.deadline, trio.current_time() + ERROR_WAIT_S)

        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                for rank in range(len(self._mesh)):
                    nursery.start_soon(one, rank, scope)
        if died:
            raise TrainerRankDied(died[0].rank, self._name, died[0].reason) from died[0]
        if errors:
            rank, err = errors[0]
            raise ActorError(err.remote_type, f"trainer rank {rank}: {err.message}",
                             err.traceback_text) from err
        return results[0]


class TrainerGroup:
    """The trainer link over ``mesh`` (see the module docstring). ``size``: ranks."""

    def __init__(self, mesh: Mesh[TrainerActor]) -> None:
        self.mesh = mesh
        self.size = len(mesh)

    def __getattr__(self, name: str) -> _AllRanks | EndpointRef[Any, Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in COLLECTIVE:
            return _AllRanks(self.mesh, name)
        return getattr(self.mesh[0], name)

    def __repr__(self) -> str:
        return f"TrainerGroup({self.mesh!r}, ranks={self.size})"


@asynccontextmanager
async def open_trainer(config: TrainerConfig, resume_from: str | None = None, *,
                       name: str = "trainer", env: Mapping[str, str] | None = None,
                       grace: float = 5.0) -> AsyncIterator[TrainerGroup]:
    """Spawn ``config.procs`` trainer ranks (one process each) and yield them as one
    ``TrainerGroup``. With several ranks they meet at ``config.rendezvous``, torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``, or a free loopback port (``_dist.rendezvous_address``).
    Leaving the block stops every rank, also on error and cancellation."""
    address = rendezvous_address(config.rendezvous) if config.procs > 1 else None
    async with open_mesh(TrainerActor, config, resume_from, address, procs=config.procs,
                         name=name, env=env, grace=grace) as mesh:
        yield TrainerGroup(mesh)
