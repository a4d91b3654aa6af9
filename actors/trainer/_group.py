"""``TrainerGroup``: a trainer mesh of N ranks presented as the one trainer the controller drives.

The controller knows nothing of FSDP (docs/architecture.md, The user's world): it calls ``version``,
``train_step``, ``updates_for``, ``ack``, ``save_checkpoint`` and ``restart`` on one
trainer link (``orchestrator.controller.TrainerLink``). ``TrainerGroup`` is that link
over an N-rank mesh: the collective calls (``train_step``, ``evaluate``,
``save_checkpoint``, ``digest``, ``full_weights``) go to every rank at once and return
rank 0's answer; the others go to rank 0 alone, which holds the publisher.

Failure: when any rank dies (crash, kill, OOM) a collective call raises
``TrainerRankDied`` naming the rank, within the runtime's death detection (seconds).
It is not an ``ActorDied``: the controller's in-place trainer restart does not apply
(a group cannot continue with a rank missing), so the run fails; the surviving ranks
may be stuck in a collective, which is harmless: leaving the mesh stops (SIGTERM, then
SIGKILL) every rank. ``flotilla run --resume`` continues from the last checkpoint.
Cancellation: cancelling a call abandons it at the caller; the ranks finish the step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio

from actors.trainer._actor import TrainerActor
from actors.trainer._config import StepResult, TrainerConfig
from actors.trainer._dist import rendezvous_address
from actors.trainer._sft import SftResult, SftSequence
from actors.types import MissingTrajectories, Trajectory, TrajectoryRef
from orchestrator.runtime import ActorDied, ActorError, Mesh, open_mesh
from policies import RecipeConfig

__all__ = ["TrainerGroup", "TrainerRankDied", "open_trainer", "trainer_mesh"]

ERROR_WAIT_S = 10.0
"""After one rank raises, how long the others may take to finish or fail."""
COLLECTIVE = ("train_step", "evaluate", "save_checkpoint", "digest", "full_weights", "adapter_weights")
"""Endpoints every rank must take together."""


class TrainerRankDied(RuntimeError):
    """A rank of the trainer group died; the group cannot go on (resume from a checkpoint)."""

    def __init__(self, rank: int, endpoint: str, reason: str) -> None:
        super().__init__(
            f"trainer rank {rank} died during {endpoint}: {reason}; the trainer "
            "group cannot continue without it (resume with --resume RUN_DIR)"
        )
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
            raise ActorError(err.remote_type, f"trainer rank {rank}: {err.message}", err.traceback_text) from err
        return results[0]


class TrainerGroup:
    """The trainer link over a trainer mesh (see the module docstring); the controller's
    ``TrainerLink`` protocol plus the other endpoints tests and tools use."""

    def __init__(self, mesh: Mesh[TrainerActor], envs: Mesh[Any] | None = None) -> None:
        self.mesh = mesh
        self.envs = envs  # holds the trajectories a batch of refs names
        self.size = len(mesh)
        self._main = mesh[0]

    def __repr__(self) -> str:
        return f"TrainerGroup({self.mesh!r}, ranks={self.size})"

    async def _all(self, name: str, *args: Any) -> Any:
        return await _AllRanks(self.mesh, name).call_one(*args)

    # -- collectives: every rank, rank 0's answer
    async def train_step(self, batch: list[Trajectory | TrajectoryRef]) -> StepResult | MissingTrajectories:
        """Every rank fetches the held trajectories of ``batch`` itself (``actors.held``)."""
        return await self._all("train_step", batch, self.envs)

    async def evaluate(self, batch: list[Trajectory], recipe: RecipeConfig | None = None) -> StepResult:
        return await self._all("evaluate", batch, recipe)

    async def sft_step(self, batch: list[SftSequence], lr: float) -> SftResult:
        return await self._all("sft_step", batch, lr)

    async def sft_evaluate(self, batch: list[SftSequence]) -> SftResult:
        return await self._all("sft_evaluate", batch)

    async def save_checkpoint(self, directory: str) -> str:
        return await self._all("save_checkpoint", directory)

    async def digest(self) -> str:
        return await self._all("digest")

    async def full_weights(self) -> dict[str, Any]:
        """The weights samplers use (LoRA: merged), fp32, by HF name: what export writes."""
        return await self._all("full_weights")

    async def adapter_weights(self) -> dict[str, Any]:
        """The LoRA adapter tensors alone ({} without LoRA): what an adapter export writes."""
        return await self._all("adapter_weights")

    # -- rank 0 alone
    async def version(self) -> int:
        return await self._main.version.call_one()

    async def updates_for(self, receiver: str, have: int, precision: str) -> list[list[bytes]]:
        return await self._main.updates_for.call_one(receiver, have, precision)

    async def update_path(self, receiver: str, have: int, precision: str, part_bytes: int) -> dict[str, Any]:
        return await self._main.update_path.call_one(receiver, have, precision, part_bytes)

    async def keyframe_part(
        self, precision: str, version: int, seq: int, part_bytes: int
    ) -> tuple[dict[str, Any], list[bytes]]:
        return await self._main.keyframe_part.call_one(precision, version, seq, part_bytes)

    async def acks(self, precision: str, held: dict[str, int]) -> None:
        await self._main.acks.call_one(precision, held)

    async def keyframe(self, precision: str) -> list[bytes]:
        return await self._main.keyframe.call_one(precision)

    async def size_report(self) -> dict[str, Any]:
        return await self._main.size_report.call_one()

    def is_dead(self) -> bool:
        return bool(self.mesh.dead_ranks)

    async def ping(self) -> None:
        """Returns once every rank's process answers a cheap call (liveness)."""
        await self.mesh.runtime_stats.call()

    async def restart(self) -> int:
        """A group cannot replace one rank in place (the survivors' process group is
        broken); raises ``TrainerRankDied`` for the dead rank: the run stops and resumes
        from its last checkpoint with ``--resume``."""
        dead = self.mesh.dead_ranks
        raise TrainerRankDied(
            dead[0] if dead else -1, "restart", f"a {self.size}-rank trainer group does not restart in place"
        )


def trainer_mesh(
    config: TrainerConfig,
    resume_from: str | None = None,
    missing_ok: bool = False,
    *,
    weights_key: str | None = None,
    name: str = "trainer",
    env: Mapping[str, str] | None = None,
    grace: float = 5.0,
) -> AbstractAsyncContextManager[Mesh[TrainerActor]]:
    """``open_mesh`` of ``config.procs`` trainer ranks (one process each). With several
    ranks they meet at ``config.rendezvous``, torchrun's ``MASTER_ADDR``/``MASTER_PORT``,
    or a free loopback port (``_dist.rendezvous_address``). Leaving the block stops every
    rank, also on error and cancellation. ``weights_key`` seals rank 0's weight messages
    (see ``TrainerActor``)."""
    address = rendezvous_address(config.rendezvous) if config.procs > 1 else None
    return open_mesh(
        TrainerActor,
        config,
        resume_from,
        missing_ok,
        weights_key,
        address,
        procs=config.procs,
        name=name,
        env=env,
        grace=grace,
    )


@asynccontextmanager
async def open_trainer(
    config: TrainerConfig,
    resume_from: str | None = None,
    *,
    name: str = "trainer",
    env: Mapping[str, str] | None = None,
    grace: float = 5.0,
) -> AsyncIterator[TrainerGroup]:
    """``trainer_mesh`` as a ``TrainerGroup``."""
    async with trainer_mesh(config, resume_from, name=name, env=env, grace=grace) as mesh:
        yield TrainerGroup(mesh)
